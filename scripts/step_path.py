"""The path of one service step through the package: the files it runs code in, and how often
the service goes down into the stack (issue 40's measure of how much a reader must hold).

    python scripts/step_path.py [--all]     # one reward model (default) or the whole stand-in stack

Builds the tiny stand-ins in a temporary folder, starts the real app in this process (Starlette's
TestClient, the worker in its thread), scores one step to warm up, then records every Python call
made in `src/rewardstack` by any thread while a second step is posted and answered. A descent is
a call into `rewardstack/stack.py` from a function outside it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tempfile
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[1] / "src" / "rewardstack") + "/"
STACK = PACKAGE + "stack.py"


class Recorder:
    """A profile function for every thread: the package files called, and the calls into stack.py."""

    def __init__(self) -> None:
        self.on = False
        self.files: Counter[str] = Counter()
        self.descents: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGE):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        with self.lock:
            self.files[callee[len(PACKAGE):]] += 1
            if callee == STACK and caller != STACK and caller.startswith(PACKAGE):
                self.descents[f"{caller[len(PACKAGE):]} -> {frame.f_code.co_name}"] += 1


def _one_model(config: Any) -> None:
    """Every model but the RLHF reward model off (as the service tests' one-model stack)."""
    for name, mc in config.models.items():
        if name != "rlhf_reward_model":
            mc.enabled = False
            mc.weight = 0.0


def main(argv: list[str]) -> int:
    """Print the files one step runs code in and the calls down into the stack."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="the whole stand-in stack, not one reward model")
    args = ap.parse_args(argv)
    from starlette.testclient import TestClient

    from rewardstack._service.app import create_app
    from rewardstack._service.access import Access
    from rewardstack.config import load_config

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: the tests' tiny stack
    from tests.soak.tiny import make_tiny_standins

    rec = Recorder()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["REWARDSTACK_HOME"] = tmp  # its calibration cache, not the user's
        config = load_config(str(make_tiny_standins(Path(tmp) / "standins")))
        config.state_dir = str(Path(tmp) / "state")
        if not args.all:
            _one_model(config)
        step = {"name": "augment", "prompt": "What is a reward model?", "completions": ["A model that scores.", "No."]}
        sys.setprofile(rec)
        threading.setprofile(rec)  # threads started from here on: the app's loop and the worker
        app = create_app(config, config.service, Access({}))
        with TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50000)) as client:  # loopback: no token
            while (ready := client.get("/readyz")).status_code != 200:  # the models load in the worker's thread
                if ready.status_code != 503 or "failed" in ready.text:
                    raise SystemExit(f"/readyz: {ready.status_code} {ready.text}")
                time.sleep(0.2)
            warm = client.post("/v1/score", json={**step, "namespace": "path", "sequence": 1})
            assert warm.status_code == 200, warm.text
            rec.on = True
            r = client.post("/v1/score", json={**step, "namespace": "path", "sequence": 2})
            rec.on = False
            assert r.status_code == 200, r.text
    sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    what = "the whole stand-in stack" if args.all else "one reward model"
    print(f"one service step ({what}): {len(rec.files)} files of src/rewardstack, "
          f"{len(rec.descents)} distinct calls down into stack.py ({sum(rec.descents.values())} in all)")
    for descent, n in sorted(rec.descents.items()):
        print(f"  descent  {descent}  x{n}")
    for name, n in sorted(rec.files.items()):
        print(f"  {n:7d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
