"""Remote-code checkpoints and the decoders' two paths (cache objects or full sequences).

The BTLM-like stand-in (`rewardstack._planning.btlm`) is a checkpoint folder with its own
configuration/modeling files and `auto_map`, written like 2023 remote code (tuple caches, ALiBi,
SwiGLU, muP output scale); it loads only through `trust_remote_code`. DPO on it must match the
literal per-position reference. Native stand-ins forced onto the full-sequence fallback must give
the same scores as on the shared-prefix cache path.
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path

import pytest
import torch

from causal_fixtures import close, make_runtime, model_config, reference_dpo
from rewardstack.config import ModelConfig
from rewardstack.errors import ModelLoadError
from rewardstack._hub import load_source
from rewardstack._scorers import dahoas, dpo, judge, kvcache, reciprocate
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._scorers.prefix import PrefixRunner
from rewardstack._standins import (
    make_btlm_checkpoint, make_dahoas_standin, make_dpo_standin, make_judge_standin, make_reciprocate_standin,
)
from tests.soak.synthetic import text

BOUND = 384  # the stand-in's token bound: the reference runs full [L, V] logits at it


@pytest.fixture(scope="module")
def btlm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_btlm_checkpoint(tmp_path_factory.mktemp("remote") / "btlm", max_length=BOUND)


def _btlm_cfg(folder: Path, **options: object) -> ModelConfig:
    return ModelConfig(name="dpo_reward_model", path=str(folder), weight=1.0, dtype="float32",
                       trust_remote_code=True, options={"tune_logits_chunk": False, "calibration_length": 64, **options})


@pytest.fixture(scope="module")
def btlm_scorer(btlm_folder: Path) -> dpo.DpoScorer:
    return dpo.build(_btlm_cfg(btlm_folder), make_runtime())  # type: ignore[return-value]


def test_loads_only_through_its_own_code(btlm_folder: Path, btlm_scorer: dpo.DpoScorer) -> None:
    """The folder's modeling file is what runs (a transformers_modules class); no opt-in, no load."""
    cls = type(btlm_scorer.model)
    assert cls.__name__ == "BTLMLMHeadModel" and cls.__module__.startswith("transformers_modules.")
    assert btlm_scorer.scale == pytest.approx(0.5)  # the muP output scale is read from the model
    cfg = _btlm_cfg(btlm_folder)
    cfg.trust_remote_code = False
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        dpo.build(cfg, make_runtime())


def test_probe_sends_legacy_cache_model_to_fallback(btlm_scorer: dpo.DpoScorer, caplog: pytest.LogCaptureFixture) -> None:
    sc = btlm_scorer
    assert sc.use_prefix is False
    assert sc.runtime.memory.cost_model("dpo_reward_model") is not None  # calibrated on that path
    with caplog.at_level(logging.INFO, logger="rewardstack.kvcache"):
        assert kvcache.choose_path("dpo_reward_model", sc.body, sc.vocab) is False
    msg = caplog.records[-1].getMessage()
    assert "full-sequence fallback" in msg and "DynamicCache" in msg  # the log says why


def test_probe_catches_a_model_that_ignores_the_cache(tmp_path: Path) -> None:
    """A body that silently drops the cache object runs, but its numbers are wrong: fallback. A body
    without use_cache or position_ids also takes the fallback, which passes it neither."""
    folder = tmp_path / "gpt2"
    make_dpo_standin(folder, max_length=64)
    from transformers import AutoModelForCausalLM

    body = AutoModelForCausalLM.from_pretrained(str(folder)).eval().base_model
    assert kvcache.takes_cache_objects(body, body.config.vocab_size)[0]

    class Forgetful(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = body

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return self.inner(input_ids=input_ids, use_cache=False)

    ok, why = kvcache.takes_cache_objects(Forgetful(), body.config.vocab_size)
    assert not ok and "differs" in why

    class Minimal(torch.nn.Module):  # no use_cache, no position_ids, no **kwargs
        def __init__(self) -> None:
            super().__init__()
            self.inner = body

        def forward(self, input_ids, attention_mask=None):  # noqa: ANN001, ANN201
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    assert not kvcache.takes_cache_objects(Minimal(), body.config.vocab_size)[0]
    seqs = [[5, 6, 7, 8], [9, 10]]
    h, mask = PrefixRunner(Minimal(), []).run(seqs)  # the fallback's call: nothing it cannot take
    for k, x in enumerate(seqs):
        want = body(input_ids=torch.tensor([x])).last_hidden_state[0]
        assert torch.allclose(h[k, : len(x)], want, atol=1e-5) and int(mask[k].sum()) == len(x)


def test_dpo_parity_on_remote_code_standin(btlm_scorer: dpo.DpoScorer) -> None:
    """Per-position literal reference within 1e-4: ordinary, repetitive, and past-the-bound inputs."""
    sc = btlm_scorer
    assert sc.use_prefix is False
    rng = random.Random(8)
    prompt = text(rng, 200)
    comps = [text(rng, n) for n in (6, 40, 300, 700)]
    comps += ["the cat sat " * 120, "again " * 400, text(rng, 4000), "short"]
    res = sc.score(ScoreRequest(prompt, comps))
    for c, s, st in zip(comps, res.scores, res.statuses):
        ref = reference_dpo(sc.model, sc.tokenizer, prompt, c)
        assert close(s, ref, 1e-4), (c[:30], s, ref)
        assert st in (Status.OK, Status.TRUNCATED)
    assert res.statuses[-2] == Status.TRUNCATED and res.scores[-1] == -11.0


def _forced_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvcache, "takes_cache_objects", lambda body, vocab: (False, "forced by the test"))


def _step(seed: int, n: int = 5) -> ScoreRequest:
    rng = random.Random(seed)
    return ScoreRequest(text(rng, 300), [text(rng, rng.randint(10, 300)) for _ in range(n)] + [None])


def _same(a: list[float], b: list[float], rel: float = 1e-4) -> None:
    for x, y in zip(a, b):
        assert (math.isnan(x) and math.isnan(y)) or close(x, y, rel), (x, y)


@pytest.mark.parametrize("family", ["dpo", "reciprocate", "dahoas"])
def test_fallback_equals_cache_path(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A native stand-in forced onto full sequences scores as on the shared-prefix cache path."""
    module = {"dpo": dpo, "reciprocate": reciprocate, "dahoas": dahoas}[family]
    make = {"dpo": make_dpo_standin, "reciprocate": make_reciprocate_standin, "dahoas": make_dahoas_standin}[family]
    name = {"dpo": "dpo_reward_model", "reciprocate": "reciprocate_reward_model", "dahoas": "dahoas_reward_model"}[family]
    folder = tmp_path / family
    entry = make(folder)
    options: dict = {"calibration_length": 64}
    if family == "dpo":
        options["tune_logits_chunk"] = False
    fast = module.build(model_config(name, folder, entry, options=dict(options)), make_runtime())
    assert fast.use_prefix is True
    _forced_fallback(monkeypatch)
    slow = module.build(model_config(name, folder, entry, options=dict(options)), make_runtime())
    assert slow.use_prefix is False
    req = _step(3)
    a, b = fast.score(req), slow.score(req)
    _same(a.scores, b.scores)
    assert a.statuses == b.statuses


def test_judge_fallback_generates_what_generate_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cache-free greedy tokens equal `generate`'s on left-padded batches; the judge scores agree."""
    folder = tmp_path / "judge"
    entry = make_judge_standin(folder)
    fast = judge.build(model_config("prompt_reward_model", folder, entry, options={"calibration_length": 64}), make_runtime())
    assert fast.use_cache is True
    rng = random.Random(5)
    ids = [[rng.randrange(100, 20000) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    width = max(len(x) for x in ids)
    batch = torch.full((len(ids), width), fast.pad_id)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for k, x in enumerate(ids):
        batch[k, width - len(x):] = torch.tensor(x)
        mask[k, width - len(x):] = 1
    want = fast.model.generate(input_ids=batch, attention_mask=mask, max_new_tokens=3, do_sample=False,
                               pad_token_id=fast.pad_id)[:, width:]
    got = kvcache.greedy_tokens(fast.model, batch, mask, 3, fast.pad_id)
    assert torch.equal(got, want)
    _forced_fallback(monkeypatch)
    slow = judge.build(model_config("prompt_reward_model", folder, entry, options={"calibration_length": 64}), make_runtime())
    assert slow.use_cache is False
    req = ScoreRequest("Summarize the text about cats.", [text(rng, 200) for _ in range(5)], task="augment")
    assert fast.score(req).scores == slow.score(req).scores


def test_local_folder_remote_code_is_logged(btlm_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="rewardstack.hub"):
        source, how = load_source(_btlm_cfg(btlm_folder), str(btlm_folder))
    assert source == str(btlm_folder) and how == {"trust_remote_code": True}
    assert any("own code from the local folder" in r.getMessage() for r in caplog.records)


def test_make_standins_can_build_the_remote_code_dpo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make-standins --dpo btlm`: the DPO folder is the remote-code checkpoint and the config opts in."""
    import tomllib

    from rewardstack._standins import build as standins
    from rewardstack.config import RULE_MASKS, load_config

    expected = tomllib.loads(standins.offline_config_text())["models"]

    def fake_builder(name: str):  # noqa: ANN202 - the other stand-ins are not what this test is about
        def build(folder: Path) -> dict:
            folder.mkdir(parents=True)
            return {k: expected[name][k] for k in ("path", "paths") if k in expected[name]}
        return build

    monkeypatch.setattr("rewardstack._standins.build.standin_builder", lambda name: None if name in RULE_MASKS else fake_builder(name))
    path = standins.make_standins(tmp_path, dpo="btlm")
    cfg = load_config(path).models["dpo_reward_model"]
    assert cfg.trust_remote_code and (tmp_path / "dpo_reward_model" / "modeling_btlm.py").exists()
    assert not load_config(path).models["reciprocate_reward_model"].trust_remote_code
