"""Start-up time with and without saved cost models: the calibration cache's benchmark.

Builds the offline stand-in stack twice from a config file in a fresh folder: the first start
profiles every model and saves the fits in the config's home (`$REWARDSTACK_HOME/stack-<hash>/calibration/`); the second
reads them and profiles nothing. Each start runs in a fresh process (a restart) and times the
stack's construction inside it. Prints both times, the time spent profiling, and their ratio.

    .venv/bin/python bench/startup.py [--standins DIR] [--quick]

`--quick`: only the OpenAssistant stand-in (masks off), to check that the script runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


_START = """
import json, sys, time
sys.path.insert(0, %r)
from rewardstack import RewardStack
t = time.perf_counter()
stack = RewardStack.from_config(sys.argv[1], load_state=False)
mm = stack.memory
print(json.dumps({"seconds": time.perf_counter() - t, "profiling": mm.calibration_seconds,
                  "profiled": len(mm.profiled), "hits": mm.calibration.hits}))
""" % str(Path(__file__).resolve().parents[1] / "src")


def _config(standins: Path, folder: Path, quick: bool) -> Path:
    """The stand-in config rewritten with absolute model paths into `folder` (cache lands there)."""
    import tomllib

    data = tomllib.loads((standins / "stack.toml").read_text())
    lines = ['device = "cpu"', 'state_dir = "state"']
    for name, entry in data["models"].items():
        lines.append(f"\n[models.{name}]")
        for key, value in entry.items():
            if key == "path":
                value = str((standins / value).resolve())
            elif key == "paths":
                value = [str((standins / v).resolve()) for v in value]
            if quick and key == "weight":
                value = 1.0 if name == "rlhf_reward_model" else 0.0
            if quick and key == "enabled" and name not in ("blacklist_filter", "task_validator_filter"):
                value = False
            lines.append(f"{key} = {_toml(value)}")
    path = folder / "stack.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standins", help="stand-in folder (built in a temp folder when omitted)")
    p.add_argument("--quick", action="store_true", help="one small model: check that the script runs")
    args = p.parse_args()
    from rewardstack._standins import make_standins

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.standins) if args.standins else Path(tmp) / "standins"
        if not (root / "stack.toml").exists():
            make_standins(root)
        folder = Path(tmp) / "run"
        folder.mkdir()
        path = _config(root, folder, args.quick)
        rows = []
        for label in ("profiles (no saved fits)", "reads saved cost models"):
            # Each start is a fresh process, as a restart is; the stack build is timed inside it.
            out = subprocess.run([sys.executable, "-c", _START, str(path)], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append((label, got["seconds"], got["profiling"], got["profiled"], got["hits"]))
        print(f"{'start':<28} {'seconds':>8} {'profiling s':>12} {'profiled':>9} {'cached':>7}")
        for label, elapsed, prof, n, hits in rows:
            print(f"{label:<28} {elapsed:8.2f} {prof:12.2f} {n:9d} {hits:7d}")
        print(f"second start / first: {rows[1][1] / rows[0][1]:.2f}")


if __name__ == "__main__":
    main()
