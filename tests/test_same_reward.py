"""The same input, the same reward, for every reward-model head family (docs/TRAINERS.md, "The same input, the same score").

Through `rewardstack serve` (a subprocess, started without MKL_CBWR: rewardstack sets it itself):
four reward models built from configs with `save_pretrained` (`bench.invariance.family_model`:
DeBERTa-v2 and BERT, a pooler over
the first token; GPT-2 and Llama, a score over the last token), of realistic matrix widths (hidden
256, intermediate 1024), each text scored alone and in requests of 1 to 17 texts from concurrent
clients, bit for bit; a burst of 4,096 one-sample requests. In process: MKL's strict mode in force
where rewardstack is imported, the start-up check turning fixed shapes on where a test double's
kernel choice moves the bits, a row that fills the cap width computed once, the OOM split keeping
the shapes, the planner counting filler rows.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from rewardstack.config import load_config
from rewardstack._memory.costmodel import CostModel, plan_batches
from rewardstack._memory.guard import InjectedOOM
from rewardstack._scorers.hfreward import pad_width, width_ladder
from rewardstack._service.batching import prepare_job, score_now
from service_fixtures import Server
from bench.invariance import FAMILIES, family_model
from trainer_fixtures import make_tiny_llama_rm, reference_scores, rewards_config, texts

MKL = torch.backends.mkl.is_available()


def _config(folder: Path, models: dict[str, Path]) -> Path:
    path = folder / "rewards.toml"
    path.write_text(f'device = "cpu"\nstate_dir = "{folder / "state"}"\n'
                    + "".join(f'\n[rewards.{name}]\npath = "{model}"\n' for name, model in models.items()))
    return path


def _serve(config: Path) -> Server:
    server = Server(config)
    server.env.pop("MKL_CBWR", None)  # this test process imported rewardstack, which set it: the server must itself
    return server.start()


def _rewards(url: str, batch: list[str], models: tuple[str, ...]) -> dict[str, list[float]]:
    r = httpx.post(url + "/get_reward", json={"query": batch}, timeout=600)
    assert r.status_code == 200, r.text
    return {m: r.json()["extra_logs"][m] for m in models}


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("families")
    server = _serve(_config(root, {f: family_model(root / f, f) for f in FAMILIES}))
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_each_text_keeps_its_alone_bits_in_any_company_through_the_service(families: Server) -> None:
    corpus = texts(48, seed=53, answer_words=110)  # 20 to 200 tokens: widths 24 to 256
    alone = [_rewards(families.url, [t], FAMILIES) for t in corpus]
    rng = random.Random(53)
    requests: list[list[int]] = []
    for _ in range(2):  # every text twice, in other company each time
        order = rng.sample(range(len(corpus)), len(corpus))
        while order:
            n = rng.randint(1, 17)
            requests.append(order[:n])
            order = order[n:]
    clients = [requests[c::12] for c in range(12)]

    def client(mine: list[list[int]]) -> list[tuple[list[int], dict[str, list[float]]]]:
        return [(req, _rewards(families.url, [corpus[i] for i in req], FAMILIES)) for req in mine]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        answers = [a for got in pool.map(client, clients) for a in got]
    answers.append((list(range(len(corpus))), _rewards(families.url, corpus, FAMILIES)))  # one request of all 48
    kept = {f: 0 for f in FAMILIES}
    seen = {f: 0 for f in FAMILIES}
    for req, got in answers:
        for f in FAMILIES:
            for k, i in enumerate(req):
                seen[f] += 1
                kept[f] += got[f][k] == alone[i][f][0]  # bit for bit: JSON carries a float's every digit
    assert kept == seen, f"scores that kept their alone bits, per family: {kept} of {seen}"


def test_the_service_says_strict_mode_and_what_its_check_found(families: Server) -> None:
    health = httpx.get(families.url + "/health", timeout=30)
    assert health.status_code == 200
    checked = health.json()["same_input_same_score"]
    assert set(checked) == set(FAMILIES)
    listed = {m["id"]: m["same_input_same_score"] for m in httpx.get(families.url + "/v1/models", timeout=30).json()["data"]}
    assert listed == checked
    for family, c in checked.items():
        assert c["same_bits"], (family, c)
        assert c["strict_blas"] == ("on" if MKL else "unavailable"), (family, c)  # set in the server's own process
        assert c["fixed_shapes"] == bool(c["rows"]), (family, c)
    log = families.log.read_text()
    assert all(f"rewards.{f}: the same input, the same score" in log for f in FAMILIES)


@pytest.mark.slow
def test_a_burst_of_one_sample_requests_answers_each_text_as_alone(tmp_path: Path) -> None:
    model = family_model(tmp_path / "deberta", "deberta", hidden=64, intermediate=256, layers=1, max_length=128)
    server = _serve(_config(tmp_path, {"deberta": model}))
    try:
        server.wait_ready()
        corpus = texts(256, seed=7, answer_words=60)
        alone = [_rewards(server.url, [t], ("deberta",))["deberta"][0] for t in corpus]
        burst = random.Random(7).sample(list(range(len(corpus))) * 16, 16 * len(corpus))  # 4,096 requests
        with httpx.Client(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=64)) as http:
            def one(i: int) -> float:
                r = http.post("/get_reward", json={"query": [corpus[i]]})
                assert r.status_code == 200, r.text
                return r.json()["rewards"][0]

            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                got = list(pool.map(one, burst))
    finally:
        server.stop()
    differ = sum(g != alone[i] for g, i in zip(got, burst))
    assert differ == 0, f"{differ} of {len(burst)} answers differ from their text scored alone"


# -- strict mode in the processes that score -------------------------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "REWARDSTACK_MKL_STRICT")}
    return subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=300)


STATE = ("import os, torch; torch.ones(8, 8) @ torch.ones(8, 8); from rewardstack._reproducible import strict_state; "
         "print(os.environ.get('MKL_CBWR'), strict_state())")


@pytest.mark.skipif(not MKL, reason="this torch has no MKL")
def test_importing_rewardstack_puts_mkl_in_strict_mode_unless_the_operator_says_otherwise() -> None:
    assert _python("import rewardstack; " + STATE).stdout.split() == ["AUTO,STRICT", "on"]
    assert _python("import rewardstack; " + STATE, MKL_CBWR="AUTO").stdout.split() == ["AUTO", "off"]
    assert _python("import rewardstack; " + STATE, REWARDSTACK_MKL_STRICT="0").stdout.split() == ["None", "off"]
    late = _python("import torch; torch.ones(8, 8) @ torch.ones(8, 8); import rewardstack; " + STATE)
    assert late.stdout.split() == ["AUTO,STRICT", "off"]  # MKL fixed its mode at its first product
    assert "MKL ran before rewardstack was imported" in late.stderr


# -- in process: the check, the cap width, the OOM split -------------------------------------------
@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rewardstack.stack import RewardStack

    folder = tmp_path_factory.mktemp("tiny")
    return RewardStack(load_config(rewards_config(folder, make_tiny_llama_rm(folder / "rm"))), load_state=False)


@pytest.fixture()
def scorer(tiny_stack: Any) -> Iterator[Any]:
    """The tiny stack's scorer, its model, passes and check restored after the test."""
    s = tiny_stack.scorers["rewards.tiny"]
    saved = (s.model, s.fixed_rows, s.mask_slot, s.max_tokens, s.invariance, s.cfg.options.fixed_shapes)
    try:
        yield s
    finally:
        s.model, s.fixed_rows, s.mask_slot, s.max_tokens, s.invariance, s.cfg.options.fixed_shapes = saved
        tiny_stack.memory.injector = None


class Kernels(torch.nn.Module):
    """A test double of the BLAS's kernel choice around a real model: it records every pass's ids, and
    rounds a score's last bits otherwise (a factor 1 + 2^-20) in passes of 4 rows or more
    (`by_rows`, as MKL's products did between 3 and 4 rows on an AMD EPYC) or at odd positions
    (`by_position`, as its one-column product did for the second of two rows)."""

    def __init__(self, model: torch.nn.Module, *, by_rows: bool = False, by_position: bool = False) -> None:
        super().__init__()
        self.inner, self.config, self.by_rows, self.by_position = model, model.config, by_rows, by_position
        self.passes: list[torch.Tensor] = []

    def forward(self, **batch: torch.Tensor) -> Any:
        out = self.inner(**batch)
        self.passes.append(batch["input_ids"].clone())
        rows = batch["input_ids"].shape[0]
        other = torch.zeros(rows, 1, dtype=torch.bool)
        other |= self.by_rows and rows >= 4
        if self.by_position and rows > 1:
            other[1::2] = True
        out.logits = torch.where(other, out.logits * (1 + 2**-20), out.logits)
        return out


def _score(stack: Any, *groups: list[str]) -> list[Any]:
    jobs = [prepare_job(stack, g, [f"query[{i}]" for i in range(len(g))], ["rewards.tiny"], time.monotonic() + 60)
            for g in groups]
    score_now(stack, jobs)
    return [j.future.result(timeout=0) for j in jobs]


def _kept(stack: Any, corpus: list[str]) -> int:
    """How many of `corpus` score the same bits alone and all in one request."""
    alone = [_score(stack, [t])[0].scores["rewards.tiny"][0] for t in corpus]
    together = _score(stack, corpus)[0].scores["rewards.tiny"]
    return sum(a == b for a, b in zip(alone, together))


@pytest.mark.parametrize("choice", ["by_rows", "by_position"])
def test_the_check_turns_fixed_shapes_on_where_the_kernel_choice_moves_the_bits(tiny_stack: Any, scorer: Any,
                                                                                choice: str) -> None:
    corpus = texts(24, seed=9)
    scorer.model, scorer.fixed_rows = Kernels(scorer.model, **{choice: True}), None
    scorer.max_tokens = max(scorer.max_tokens, 512)  # passes of several rows at every width
    assert _kept(tiny_stack, corpus) < len(corpus)  # the double moves bits with the company
    found = scorer.check_invariance()
    assert found.fixed_shapes and found.same_bits and "differed" in found.found, found
    if choice == "by_position":  # no row count keeps every position: one row a pass
        assert set(found.rows.values()) == {1}, found.rows
    assert _kept(tiny_stack, corpus) == len(corpus)


def test_with_fixed_shapes_off_the_check_warns_and_changes_nothing(tiny_stack: Any, scorer: Any,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    scorer.model, scorer.fixed_rows = Kernels(scorer.model, by_rows=True), None
    scorer.max_tokens = max(scorer.max_tokens, 512)
    scorer.cfg.options.fixed_shapes = "off"
    with caplog.at_level(logging.WARNING, logger="rewardstack.scorers"):
        found = scorer.check_invariance()
    assert not found.fixed_shapes and not found.same_bits and scorer.fixed_rows is None
    assert "bits differed" in caplog.text
    assert _kept(tiny_stack, texts(24, seed=9)) < 24


def test_a_row_that_fills_the_cap_is_computed_once_and_keeps_its_bits(tiny_stack: Any, scorer: Any,
                                                                       tmp_path: Path) -> None:
    cap = scorer.max_length
    long = [t for t in texts(60, seed=11, answer_words=400) if scorer.encode(t, "q")[1]][:5]  # cut: they fill the cap
    short = texts(4, seed=12)
    assert len(long) == 5
    scorer.model = Kernels(scorer.model)
    for rows in (None, 4):  # one row a pass at the cap (no filler: it always runs alone), and fixed 4-row passes
        scorer.fixed_rows = None if rows is None else {w: rows for w in width_ladder(cap)}
        scorer.max_tokens = cap  # one row a pass at the cap without fixed shapes: where a filler doubled the work
        scorer.model.passes.clear()
        [together] = _score(tiny_stack, long + short)
        at_cap = [p for p in scorer.model.passes if p.shape[1] == cap]
        real = [tuple(r.tolist()) for p in at_cap for r in p if len(r) and (r != scorer.pad_id).all()]
        assert sorted(real) == sorted(tuple(scorer.encode(t, "q")[0]) for t in long)  # each once, nothing doubled
        assert sum(p.shape[0] for p in at_cap) == (5 if rows is None else 8)  # fillers: only to fill 4-row passes
        assert together.truncated["rewards.tiny"] == [True] * 5 + [False] * 4
        alone = [_score(tiny_stack, [t])[0].scores["rewards.tiny"][0] for t in long + short]
        assert together.scores["rewards.tiny"] == alone
        if rows is None:  # alone at the cap is transformers' own call on the cut text: the same bits
            assert alone[:5] == reference_scores(Path(scorer.cfg.path), long, max_length=cap)


def test_an_oom_split_fills_each_half_back_to_its_fixed_rows(tiny_stack: Any, scorer: Any) -> None:
    corpus = [t for t in texts(80, seed=13) if pad_width(len(scorer.encode(t, "q")[0]), scorer.max_length) == 48][:6]
    assert len(corpus) == 6
    scorer.fixed_rows = {w: 8 for w in width_ladder(scorer.max_length)}
    scorer.model = Kernels(scorer.model, by_rows=True)  # a pass of fewer rows would round otherwise
    alone = [_score(tiny_stack, [t])[0].scores["rewards.tiny"][0] for t in corpus]

    class FirstBatchOOM:
        fired = 0

        @contextlib.contextmanager
        def during(self, model: str, batch: list[int]) -> Iterator[None]:
            if len(batch) > 1 and self.fired < 2:  # the batch of 6, then its first half of 3
                self.fired += 1
                raise InjectedOOM(f"injected OOM (batch of {len(batch)})")
            yield

    tiny_stack.memory.injector = FirstBatchOOM()
    scorer.model.passes.clear()
    [together] = _score(tiny_stack, corpus)
    assert tiny_stack.memory.injector.fired == 2
    assert [p.shape[0] for p in scorer.model.passes] == [8, 8, 8]  # halves of 1, 2 and 3 rows, each filled to 8
    assert together.scores["rewards.tiny"] == alone


def test_the_plan_counts_filler_rows() -> None:
    cost = CostModel(b=1.0)  # a pass's peak: one byte a token
    filled = lambda count, longest: max(count, 8)  # noqa: E731 - passes of 8 rows
    assert plan_batches([64, 64, 64], cost, 300 / 0.9, margin=0.9) == [[0, 1, 2]]
    # As 8-row passes not even one input fits 4 rows' budget: each gets a batch of its own (the guard's case).
    assert plan_batches([64, 64, 64], cost, 300 / 0.9, margin=0.9, rows=filled) == [[0], [1], [2]]


def test_rows_per_width_are_the_fewest_within_tolerance_of_the_widest_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardstack._scorers import invariance

    timed: list[int] = []

    def modelled(run: Any, n: int, width: int) -> float:  # a pass: 10 ms fixed, then 0.05 ms a token
        timed.append(width)
        return 0.010 + n * width * 0.00005

    monkeypatch.setattr(invariance, "_timed", modelled)
    widths = [16, 64, 256, 1024, 2048, 4096]
    rows = invariance.choose_rows(lambda n, w: None, widths, lambda w: 8 if w < 1024 else 4)
    # Per row at 16 tokens: 10.8 ms alone, 3.3 ms at 4, 2.05 ms at 8: only 8 is within 10% of 8's.
    # At 256: 22.8, 15.3, 14.05 ms: 4 is. At 2048, one row (112 ms) is within 10% of four (105 ms):
    # one row, and the walk stops there (a wider pass's fixed costs are a smaller share still).
    assert rows == {16: 8, 64: 8, 256: 4, 1024: 4, 2048: 1, 4096: 1}
    assert 4096 not in timed
