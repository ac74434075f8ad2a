"""Tests of the shared-prefix machinery: common token prefixes, padding groups, equal numbers."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2Model, GPTJConfig, GPTJModel, LlamaConfig, LlamaModel

from rewardstack._scorers.prefix import PrefixRunner, common_prefix_len, padding_groups, split_prefix


def test_common_prefix_len_leaves_one_token_each() -> None:
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5]]) == 3
    assert common_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shortest keeps one token
    assert common_prefix_len([[1, 2], [3, 2]]) == 0
    assert common_prefix_len([[7]]) == 0
    assert common_prefix_len([]) == 0
    pre, rest = split_prefix([[1, 2, 3, 4], [1, 2, 9]])
    assert pre == [1, 2] and rest == [[3, 4], [9]]
    assert split_prefix([[1, 2, 3], [1, 2, 4]], enabled=False)[0] == []


def test_padding_groups_bound_waste() -> None:
    lengths = [5, 100, 7, 8000, 90, 6]
    groups = padding_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) * longest <= 1.25 * sum(lengths[i] for i in g) or len(g) == 1


def _bodies() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    v = 500
    return [
        GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=v, n_positions=256)),
        GPTJModel(GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=v, n_positions=256, rotary_dim=8)),
        LlamaModel(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=v, max_position_embeddings=256)),
    ]


def test_prefix_runs_equal_full_runs() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 500, (40,), generator=g).tolist()
    seqs = [base + torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 6, 23, 2, 60)]
    for body in _bodies():
        body.eval()
        pre, suffixes = split_prefix(seqs)
        assert len(pre) == 40
        runner = PrefixRunner(body, pre)
        with torch.inference_mode():
            hidden, mask = runner.run(suffixes)
            assert mask.sum().item() == sum(len(s) for s in suffixes)
            for k, s in enumerate(seqs):
                full = body(input_ids=torch.tensor([s])).last_hidden_state[0]
                got = runner.rows(hidden, torch.full((len(s),), k), torch.arange(len(s)))
                torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-5)


def test_no_prefix_runs_whole_inputs() -> None:
    body = _bodies()[0].eval()
    seqs = [[1, 2, 3], [4, 5]]
    runner = PrefixRunner(body, [])
    with torch.inference_mode():
        hidden, _ = runner.run(seqs)
        full = body(input_ids=torch.tensor([[4, 5]])).last_hidden_state[0]
    torch.testing.assert_close(hidden[1, :2], full, rtol=1e-4, atol=1e-5)
