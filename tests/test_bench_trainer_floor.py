"""The instrument of the trainer-route benchmark on a realistic model (`bench.trainer_floor`).

Its parts are checked for what a wrong figure would come from: the realistic model's tokenizer
acting as Llama-3's (two BOS when a templated text is tokenized with special tokens), the chat
texts' lengths, the vendored serve_rm.py being OpenRLHF's file unchanged, the floor scoring each
row as an unpadded forward does, and the table marking its targets; then one smoke run of the
whole section on tiny sizes (three servers started: slow). Nothing about speed.
"""

from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path

import pytest

from real_fixtures import real_models

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bench import realistic

    real_models()
    return realistic.build_model(tmp_path_factory.mktemp("realistic") / "rm", shape=realistic.TINY)


def test_the_tokenizer_writes_one_bos_and_adds_a_second_as_llama3s(tiny_model: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from bench import realistic

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    text = tok.apply_chat_template([{"role": "user", "content": "Is the sky blue?"},
                                    {"role": "assistant", "content": "Yes, on a clear day."}], tokenize=False)
    bos = tok.bos_token_id
    assert text.startswith(realistic.BOS)
    plain, special = tok(text, add_special_tokens=False)["input_ids"], tok(text)["input_ids"]
    assert plain[0] == bos and plain[1] != bos
    assert special[:2] == [bos, bos] and special[1:] == plain
    assert tok.pad_token_id is not None and tok.pad_token_id != bos and tok.model_max_length == 512
    config = AutoConfig.from_pretrained(str(tiny_model))
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.vocab_size == len(tok)
    assert realistic.SHAPE == {"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 1536,
                               "num_attention_heads": 6, "num_key_value_heads": 2}


def test_chat_texts_have_the_issue_lengths_and_repeat() -> None:
    from bench import realistic

    real_models()
    texts = realistic.chat_texts(160)
    lengths = [len(x) for x in realistic.tokenizer()(texts, add_special_tokens=False)["input_ids"]]
    assert min(lengths) >= 100 and 160 <= statistics.median(lengths) <= 260
    assert 0.08 <= sum(n > 512 for n in lengths) / len(lengths) <= 0.25
    assert all(t.startswith(realistic.BOS) and t.count(realistic.BOS) == 1 for t in texts)
    assert realistic.chat_texts(160) == texts and realistic.chat_texts(160, seed=1) != texts


def test_the_vendored_serve_rm_is_openrlhfs_file_unchanged() -> None:
    """Every verbatim file's body has the git blob its header names; with REWARDSTACK_TRAINER_SOURCES
    naming a fetched OpenRLHF git directory, that blob is the file's at the named commit."""
    from bench import peer

    blobs = peer.vendored_blobs()
    assert {"openrlhf/cli/serve_rm.py", "openrlhf/utils/utils.py", "openrlhf/utils/config.py",
            "openrlhf/utils/logging_utils.py"} <= set(blobs)
    assert {path: named for path, (named, _) in blobs.items()} == {path: body for path, (_, body) in blobs.items()}
    sources = os.environ.get("REWARDSTACK_TRAINER_SOURCES")
    if sources:
        git_dir = sources.split(":")[0]
        for path, (named, _) in blobs.items():
            upstream = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{peer.SOURCE_COMMIT}:{path}"],
                                      check=True, capture_output=True, text=True).stdout.strip()
            assert upstream == named, path


def test_the_floor_scores_each_row_as_its_own_unpadded_forward(tiny_model: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from bench import realistic
    from bench.floors import static_batches

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_model)).eval()
    rows = tok(realistic.chat_texts(7), add_special_tokens=False, truncation=True, max_length=512)["input_ids"]
    _, scores = static_batches(model, rows, tok.pad_token_id, 3)
    with torch.inference_mode():
        alone = [model(input_ids=torch.tensor([r])).logits[0, 0].item() for r in rows]
    assert max(abs(a - b) for a, b in zip(scores, alone)) < 1e-5


def test_the_table_marks_each_target() -> None:
    from bench.trainer_floor import shapes, table

    loads = shapes(8, 4, 2, 2, 4)
    rate = {"rewardstack": 95.0, "peer": 60.0, "floor": 100.0}
    sps = {(s.name, w): [v, v / 2] for s in loads for w, v in rate.items()}
    sps[(loads[0].name, "rewardstack")] = [70.0, 30.0]  # one shape under 0.9x the floor (50 / 75)
    rewards = {"peer": [0.5, 1.0], "floor": [0.5, 1.0], "rewardstack": [0.5, 1.3]}
    lines = table(sps, rewards, {8: 1}, loads, 2)
    targets = [line for line in lines if line.startswith("TARGET")]
    assert len(targets) == 6
    assert sum(line.endswith("NOT met") for line in targets) == 1 and "0.67x NOT met" in targets[0]
    assert any("1.58x met" in line for line in targets)  # 71.25 / 45 (medians) on the multi-sample shapes
    sanity = [line for line in lines if line.startswith("SANITY")]
    assert sanity[0].startswith("SANITY rewardstack") and sanity[0].endswith("NOT met)")
    assert sanity[1].endswith("(within 1e-4: met)")


@pytest.mark.slow
def test_the_section_runs_on_tiny_sizes(tiny_standins: Path) -> None:
    from bench.trainer_floor import measure

    lines = measure(8, 1, clients=4, multi_clients=2, multi_size=2, big=4, flood_clients=2, flood_size=2, steps=2,
                    standins=tiny_standins, tiny=True)
    out = "\n".join(lines)
    for row in ("| 4 clients x 1 sample |", "| 2 clients x 2 samples |", "| 1 client x 4 samples |",
                "TARGET validator p99 under the flood <= 2.0x alone"):
        assert row in out, row
    assert sum(line.startswith("TARGET") for line in lines) == 7
    # serve_rm (its own source, the loader replaced) and the floor give the same rewards on 4 padded rows.
    assert "SANITY floor rewards against serve_rm's on the same 4 texts" in out and "(within 1e-4: met)" in out
