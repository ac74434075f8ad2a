"""`rewardstack score` exactly once across kills: the output is the record, state and event commit together."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rewardstack import _runner as runner
from rewardstack.cli import main
from rewardstack.errors import StateError
from rewardstack._state import FORMAT_VERSION, StateLock, StateLockedError, StateStore

TESTS = Path(__file__).parent


def _config(tmp_path: Path, state: str = "state") -> Path:
    p = tmp_path / "stack.toml"
    p.write_text(f'device = "cpu"\nstate_dir = "{state}"\n')
    return p


def _steps(path: Path, n: int = 24, seed: int = 0) -> Path:
    rng = random.Random(seed)
    names = ["augment", "followup0", "answer0", "followup1", "answer1"]
    lines = []
    for i in range(n):
        comps = [f"completion {i}.{j} {rng.random():.6f}" for j in range(6)]
        if i % 5 == 2:
            comps[1] = comps[0]  # a repeat within the step
        lines.append(json.dumps({"name": names[i % len(names)], "prompt": f"prompt {i}", "completions": comps}))
        if i == 7:
            lines.append("{broken line")  # a bad line is reported on every run, never scored
    path.write_text("\n".join(lines) + "\n")
    return path


def _events(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        e.pop("step_length")
        out.append(e)
    return out


def _state(state_dir: Path) -> dict:
    sections = StateStore(state_dir).load()
    journal = sections.pop("journal")
    sections["committed"] = journal["committed"]
    return sections


def _clean_run(tmp_path: Path, steps: Path) -> tuple[list[dict], dict]:
    clean = tmp_path / "clean"
    clean.mkdir()
    assert main(["score", "--config", str(_config(clean)), "--input", str(steps), "--output", str(clean / "ev.jsonl")]) == 2
    return _events(clean / "ev.jsonl"), _state(clean / "state")


def test_crash_between_state_and_output_is_redone_from_the_journal(tmp_path: Path, fake_registry, monkeypatch) -> None:  # noqa: ANN001
    steps = _steps(tmp_path / "steps.jsonl", 12)
    want_events, want_state = _clean_run(tmp_path, steps)
    cfg, out = _config(tmp_path), tmp_path / "ev.jsonl"
    real_append = runner._append
    calls = {"n": 0}

    def dies_after_state_save(path: Path, lines: list[str]) -> None:
        calls["n"] += 1
        if calls["n"] == 6:
            # The state holding step 6 is saved; the process dies before its event reaches the file,
            # after writing half of the line.
            with path.open("a") as f:
                f.write(lines[0][: len(lines[0]) // 2])
            raise KeyboardInterrupt
        real_append(path, lines)

    monkeypatch.setattr(runner, "_append", dies_after_state_save)
    # the command line reports the interrupt in one line and exits 130 (rewardstack._cli_errors)
    assert main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)]) == 130
    monkeypatch.setattr(runner, "_append", real_append)
    assert len(out.read_text().splitlines()) == 6 and not out.read_text().endswith("\n")  # 5 + a torn line
    assert StateStore(tmp_path / "state").load()["stack"]["steps_scored"] == 6  # one step ahead of the file
    assert main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)]) == 2
    assert _events(out) == want_events
    assert _state(tmp_path / "state") == want_state


def test_rerun_of_a_finished_output_scores_nothing(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    steps = _steps(tmp_path / "steps.jsonl", 5)
    cfg, out = _config(tmp_path), tmp_path / "ev.jsonl"
    main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)])
    before = (out.read_text(), _state(tmp_path / "state"))
    capsys.readouterr()
    main(["score", "--config", str(cfg), "--input", str(steps), "--output", str(out)])
    assert "scored 0 steps" in capsys.readouterr().err
    assert (out.read_text(), _state(tmp_path / "state")) == before
    # The same state directory then serves another input: its resume point is its own output's.
    other = _steps(tmp_path / "other.jsonl", 3, seed=1)
    main(["score", "--config", str(cfg), "--input", str(other), "--output", str(tmp_path / "other.jsonl.out")])
    assert StateStore(tmp_path / "state").load()["stack"]["steps_scored"] == 8


def test_an_output_of_another_input_is_refused(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    cfg, out = _config(tmp_path), tmp_path / "ev.jsonl"
    main(["score", "--config", str(cfg), "--input", str(_steps(tmp_path / "a.jsonl", 3)), "--output", str(out)])
    capsys.readouterr()
    rc = main(["score", "--config", str(cfg), "--input", str(_steps(tmp_path / "b.jsonl", 3, seed=9)), "--output", str(out)])
    assert rc == 1 and "belongs to another input" in capsys.readouterr().err


_WORKER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import fakes
    import dataclasses
    from rewardstack import config as config_mod, _models as models

    class Slow(fakes.FakeReward):
        def score(self, request):
            time.sleep(0.01)  # long enough for a kill to land mid-step
            return super().score(request)

    def build(cfg, runtime):
        return Slow(cfg.name) if cfg.is_reward else fakes.FakeMask(cfg.name)

    fakes.build_slow = build
    for name in config_mod.ALL_MODELS:
        if name not in config_mod.RULE_MASKS:
            models.BY_NAME[name] = dataclasses.replace(models.BY_NAME[name], builder="fakes:build_slow", standin=None)
    from rewardstack.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "TQDM_DISABLE": "1"}
    return subprocess.Popen([sys.executable, "-c", _WORKER, str(TESTS), *args], stderr=subprocess.PIPE, env=env)


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_score_killed_three_times_equals_one_uninterrupted_run(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    steps = _steps(tmp_path / "steps.jsonl", 30)
    want_events, want_state = _clean_run(tmp_path, steps)
    args = ["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(tmp_path / "ev.jsonl")]
    out = tmp_path / "ev.jsonl"
    rng = random.Random(3)
    kills = 0
    for target in (4, 12, 21):
        proc = _spawn(args)
        deadline = time.time() + 120
        while _lines(out) < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))  # a random moment inside a later step
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills == 3, "the run finished before it could be killed three times"
    assert _lines(out) < 30
    # The fourth run (in this process, same arguments) finishes the job.
    assert main(args) == 2
    assert _events(out) == want_events
    assert _state(tmp_path / "state") == want_state


def test_second_process_on_the_same_state_dir_is_refused(tmp_path: Path, fake_registry, capsys) -> None:  # noqa: ANN001
    state = tmp_path / "state"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom rewardstack._state import StateLock\n"
         "held = StateLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)", str(state)],
        stdout=subprocess.PIPE, text=True,
    )  # `held`: a lock object that is collected releases its lock
    try:
        assert holder.stdout.readline().strip() == "locked"
        steps = _steps(tmp_path / "steps.jsonl", 2)
        rc = main(["score", "--config", str(_config(tmp_path)), "--input", str(steps), "--output", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 1 and f"in use by process {holder.pid}" in err and "only one process" in err
        assert not (tmp_path / "o").exists() and not (state / "state.safetensors").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder's death releases the lock: nothing stale is left behind.
    with StateLock(state):
        pass


def test_lock_is_exclusive_within_a_process_too(tmp_path: Path) -> None:
    with StateLock(tmp_path):
        with pytest.raises(StateLockedError, match=f"process {os.getpid()}"):
            StateLock(tmp_path).acquire()


def _write_raw_state(path: Path, version: int, sections: dict) -> None:
    from safetensors.torch import save

    meta = {"rewardstack_json": json.dumps({"version": version, "sections": sections})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(save({"diversity_reward_model/history": torch.ones(3, 2)}, metadata=meta))


def test_older_state_is_migrated_and_kept(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    _write_raw_state(store.path, 1, {"normalizers": {"x": {"count": 2, "mean": 0.5, "var": 1.0}}})
    original = store.path.read_bytes()
    sections = store.load()
    assert store.loaded_version == 1 and sections["normalizers"]["x"]["count"] == 2
    assert torch.equal(sections["diversity_reward_model"]["history"], torch.ones(3, 2))
    store.save(sections)
    assert (tmp_path / "state.v1.safetensors").read_bytes() == original
    again = StateStore(tmp_path)
    again.load()
    assert again.loaded_version == FORMAT_VERSION


def test_newer_state_is_refused_and_untouched(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    _write_raw_state(store.path, FORMAT_VERSION + 1, {})
    original = store.path.read_bytes()
    with pytest.raises(StateError, match="newer rewardstack"):
        store.load()
    assert store.path.read_bytes() == original
