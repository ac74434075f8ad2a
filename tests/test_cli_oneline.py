"""An operator's ordinary mistakes end in one line (issue 34 #3, #4).

- A config whose device the installed torch cannot use (the shipped `default.toml` says `cuda:0`;
  a CPU-only torch ended in a 40-line `AssertionError: Torch not compiled with CUDA enabled`) is
  one line naming the device and the torch build, before any model loads.
- A command whose optional extra is missing (`report` without matplotlib was a raw
  `ModuleNotFoundError`; `serve` without FastAPI exited 2, the code of skipped input lines) is one
  line naming the extra to install, with the one exit code every command uses for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rewardstack.cli import main
from rewardstack._cli_errors import EXIT_MISSING_EXTRA
from rewardstack.config import from_dict
from rewardstack.errors import ConfigError
from rewardstack._scorers.loading import ModelCache


@pytest.fixture
def no_model_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every model or tokenizer load is refused and recorded: the device check must come first."""
    loaded: list[str] = []

    def refuse(self, path, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        loaded.append(str(path))
        raise AssertionError(f"{path} loaded before the device was checked")

    monkeypatch.setattr(ModelCache, "pretrained", refuse)
    return loaded


def _steps(tmp_path: Path) -> Path:
    p = tmp_path / "steps.jsonl"
    p.write_text(json.dumps({"name": "augment", "prompt": "p", "completions": ["a fine answer"]}) + "\n")
    return p


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rewardstack: error: "), lines[0]
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the torch here has CUDA")
def test_shipped_default_config_on_cpu_torch_is_one_line(tmp_path: Path, no_model_loads: list[str],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import resources

    # The shipped file, copied: its relative state_dir must not land in the package.
    config = tmp_path / "default.toml"
    config.write_text((resources.files("rewardstack") / "configs" / "default.toml").read_text())
    rc = main(["score", "--config", str(config), "--input", str(_steps(tmp_path)), "--output", str(tmp_path / "e.jsonl")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 1 and no_model_loads == [] and not (tmp_path / "state").exists()  # not even a state folder
    assert "'device'" in line and "cuda:0" in line and torch.__version__ in line and "without CUDA" in line, line


def test_a_cuda_index_the_machine_lacks_is_one_line(tmp_path: Path, no_model_loads: list[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A CUDA build with one card: cuda:3 names a device that is not there (the Python API says so too).
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    from rewardstack.stack import RewardStack

    with pytest.raises(ConfigError) as e:
        RewardStack(from_dict({"device": "cuda:3", "state_dir": str(tmp_path / "s")}))
    assert "cuda:3" in str(e.value) and "1 CUDA device" in str(e.value) and no_model_loads == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the torch here has CUDA")
def test_soak_checks_the_device_before_it_starts_a_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "stack.toml"
    config.write_text(f'device = "cuda:0"\nstate_dir = "{tmp_path / "state"}"\n')
    from tests.soak.soak import main as soak

    rc = soak(["--config", str(config), "--steps", "2", "--run-dir", str(tmp_path / "run")])
    line = _one_line(capsys.readouterr().err)
    assert rc == 1 and "cuda:0" in line and not (tmp_path / "run").exists(), line


def _report_run(tmp_path: Path) -> list[str]:
    run = tmp_path / "run"
    run.mkdir()
    (run / "timeline.jsonl").write_text(json.dumps({"type": "start", "time": 1.0, "device": "cpu"}) + "\n")
    return ["report", str(run)]


def _serve(tmp_path: Path) -> list[str]:
    config = tmp_path / "stack.toml"
    config.write_text(f'device = "cpu"\nstate_dir = "{tmp_path / "state"}"\n')
    return ["serve", "--config", str(config), "--port", "1"]


def _rescore(tmp_path: Path) -> list[str]:
    config = tmp_path / "stack.toml"
    config.write_text(f'device = "cpu"\nstate_dir = "{tmp_path / "state"}"\n')
    return ["rescore", str(_steps(tmp_path)), "--config", str(config), "--output", str(tmp_path / "out")]


def test_a_broken_import_in_serve_is_not_a_missing_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only an extra's own modules are a missing extra; rewardstack's own failing to import is a bug.
    monkeypatch.setitem(sys.modules, "rewardstack._service.app", None)
    with pytest.raises(ModuleNotFoundError):
        main(_serve(tmp_path))


def _importers_of(module: str) -> list[str]:
    """rewardstack's loaded modules that hold a name from `module` (they imported it at the top)."""
    def imported(value: object) -> bool:
        origin = getattr(value, "__module__", None) or getattr(value, "__name__", None)
        return isinstance(origin, str) and (origin == module or origin.startswith(module + "."))

    return [name for name, m in list(sys.modules.items())
            if name.startswith("rewardstack.") and m is not None and any(imported(v) for v in vars(m).values())]


@pytest.mark.parametrize("argv, module, extra", [
    (_report_run, "matplotlib", "report"),
    (_serve, "fastapi", "service"),
    (_rescore, "ray", "ray"),
])
def test_a_missing_extra_is_one_line_and_one_exit_code(argv, module: str, extra: str, tmp_path: Path,  # noqa: ANN001
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import <module>` raises ModuleNotFoundError
    for name in _importers_of(module):  # an earlier test in this process imported them: as a fresh one would
        monkeypatch.delitem(sys.modules, name)
    rc = main(argv(tmp_path))
    line = _one_line(capsys.readouterr().err)
    assert rc == EXIT_MISSING_EXTRA and f"pip install 'rewardstack[{extra}]'" in line and module in line, (rc, line)
