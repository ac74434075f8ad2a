"""Dahoas scorer: parity with the literal padded two-pass reference; real weights are loaded."""

from __future__ import annotations

import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from causal_fixtures import close, make_runtime, model_config, reference_dahoas
from rewardstack._scorers import dahoas
from rewardstack._scorers.base import ScoreRequest, Status
from rewardstack._standins import make_dahoas_standin
from tests.soak.synthetic import text


@pytest.fixture(scope="session")
def dah_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("standins") / "dahoas"
    return folder, make_dahoas_standin(folder)


@pytest.fixture(scope="session")
def scorer(dah_folder: tuple[Path, dict]) -> dahoas.DahoasScorer:
    folder, entry = dah_folder
    return dahoas.build(model_config("dahoas_reward_model", folder, entry), make_runtime())


def _request(seed: int) -> ScoreRequest:
    rng = random.Random(seed)
    prompt = text(rng, 400)
    comps: list[str | None] = [text(rng, rng.choice([0, 10, 80, 400, 1200])) for _ in range(16)]
    comps += ["", None, "ü 🙂", "ends early<|endoftext|> and more text after"]
    return ScoreRequest(prompt, comps, "answer0")


def test_parity_with_reference(scorer: dahoas.DahoasScorer) -> None:
    req = _request(1)
    res = scorer.score(req)
    for c, s, st in zip(req.completions, res.scores, res.statuses):
        if c is None:
            assert st == Status.FAILED and math.isnan(s)
            continue
        ref = reference_dahoas(scorer.body, scorer.head, scorer.tokenizer, req.prompt, c)
        assert close(s, ref, 1e-4), (c[:30], s, ref)


def test_head_weights_are_used(dah_folder: tuple[Path, dict], tmp_path: Path, scorer: dahoas.DahoasScorer) -> None:
    folder, entry = dah_folder
    copy = tmp_path / "dahoas_other_head"
    shutil.copytree(folder, copy)
    head = load_file(str(folder / "v_head.safetensors"))["v_head.weight"]
    save_file({"v_head.weight": -2.0 * head}, str(copy / "v_head.safetensors"))
    other = dahoas.build(model_config("dahoas_reward_model", copy, {**entry, "path": copy.name}), make_runtime())
    req = _request(2)
    a, b = scorer.score(req).scores, other.score(req).scores
    for x, y in zip(a, b):
        if not math.isnan(x):
            assert close(y, -2.0 * x, 1e-4)


def test_published_pt_layout_loads_safely(dah_folder: tuple[Path, dict], tmp_path: Path, scorer: dahoas.DahoasScorer) -> None:
    """The Dahoas/gptj-rm-static layout: one `hf_ckpt.pt` state dict, body config from elsewhere."""
    folder, entry = dah_folder
    state = {f"transformer.{k}": v.clone() for k, v in scorer.body.state_dict().items()}
    state["v_head.weight"] = scorer.head.weight.detach().clone()
    state["lm_head.weight"] = torch.zeros(3, 3)  # the published file has an LM head too: ignored
    ckpt = tmp_path / "gptj_rm"
    ckpt.mkdir()
    torch.save(state, str(ckpt / "hf_ckpt.pt"))
    cfg = model_config("dahoas_reward_model", ckpt, {"path": ckpt.name, "dtype": "float32"},
                       options={"base_config": str(folder)})
    other = dahoas.build(cfg, make_runtime())
    req = _request(3)
    for x, y in zip(scorer.score(req).scores, other.score(req).scores):
        assert (math.isnan(x) and math.isnan(y)) or close(x, y, 1e-5)


def test_read_position() -> None:
    assert dahoas.read_position([1, 2, 3, 9, 4], 9) == 2
    assert dahoas.read_position([1, 2, 3], 9) == 2
    assert dahoas.read_position([9, 2], 9) == 0
