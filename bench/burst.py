"""Benchmark: a trainer's burst, thousands of one-sample `/get_reward` requests sent at once.

Run: `.venv/bin/python -m bench.burst [--requests 4096] [--model DIR] [--rows serve,ray-1,ray-2,serve_rm]`.
What OpenRLHF's rollout does when a generation batch ends: `_fetch_rewards_via_http` with one URL
per sample opens one aiohttp session per request, all at once, from one process, and resends each
failed request up to 5 times a second apart (the loop here is that one, counting what each try
got). Rows, on the same model and the same texts, one server at a time:

- `serve`: `rewardstack serve --reward-model DIR` (one process, its trainer lane);
- `ray-1`, `ray-2`: `rewardstack ray-serve --reward-model DIR --replicas N` (a local Ray started by
  the command; Serve's proxy in front);
- `serve_rm`: OpenRLHF's own `serve_rm.py` (`bench.peer`, vendored) on the same folder.

Per row: seconds from the first request sent to the last answer (drain), the server's peak RSS
during the burst (the server's process and every process under it: for Ray, the GCS, raylet,
controller, proxy and replicas), requests refused (HTTP answers other than 200, each try counted),
connection errors, requests lost (no answer after the 5 tries) and the largest difference of a
reward from the `serve` row's for the same text. The model (default: `bench.realistic`'s Llama
reward model, built in a temporary folder) must be a sequence-classification folder serve_rm.py loads.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import MiB, own_home

ROWS = ("serve", "ray-1", "ray-2", "serve_rm")
TRIES = 5
"""OpenRLHF's `_post_request(..., try_max_times=5)`, a second apart, each try with `ClientTimeout(total=180)`."""


def queries(n: int) -> list[str]:
    """`n` distinct chat-shaped prompt+response texts of varied lengths."""
    words = "the model reads a prompt and its response then scores how helpful and honest the answer was".split()
    return [f"<|user|> question {i}: " + " ".join(words[(i * 7 + k) % len(words)] for k in range(6 + i % 29))
            + f"\n<|assistant|> answer {i}: " + " ".join(words[(i + k) % len(words)] for k in range(4 + i % 53))
            for i in range(n)]


async def burst(url: str, texts: list[str], timeout_s: float = 180.0) -> dict[str, Any]:
    """Every text in its own request, all at once: rewards (None: lost) and what each try got."""
    import aiohttp

    got: collections.Counter[str] = collections.Counter()

    async def one(text: str) -> float | None:
        for _ in range(TRIES):
            try:
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
                    async with session.post(url + "/get_reward", json={"query": [text], "prompts": [text],
                                                                       "labels": [None]}) as r:
                        got[str(r.status)] += 1
                        if r.status == 200:
                            return float((await r.json())["rewards"][0])
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                got[type(e).__name__] += 1
            await asyncio.sleep(1)
        return None

    t0 = time.perf_counter()
    rewards = await asyncio.gather(*(one(t) for t in texts))
    return {"drain_s": time.perf_counter() - t0, "rewards": rewards, "tries": got}


class PeakRSS:
    """The largest summed RSS of a process and every process under it, sampled every 0.1 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> "PeakRSS":
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(row: str, model: Path, port: int, log: Path, device: str) -> subprocess.Popen:
    """The row's server on 127.0.0.1:`port`, its output in `log`."""
    env = {k: v for k, v in os.environ.items() if k != "REWARDSTACK_TOKEN"}
    out = open(log, "ab")
    if row == "serve_rm":
        from bench.peer import start_serve_rm

        out.close()
        return start_serve_rm(model, port)
    cli = [sys.executable, "-m", "rewardstack.cli"]
    flags = ["--reward-model", str(model), "--device", device, "--host", "127.0.0.1", "--port", str(port)]
    if row == "serve":
        return subprocess.Popen([*cli, "serve", *flags], stdout=out, stderr=subprocess.STDOUT, env=env)
    replicas = int(row.split("-")[1])
    env.setdefault("RAY_raylet_start_wait_time_s", "120")  # a busy machine starts Ray's raylet slowly
    gpus = 1.0 / replicas if device.startswith("cuda") else 0.0  # the replicas share one card
    return subprocess.Popen([*cli, "ray-serve", *flags, "--replicas", str(replicas), "--gpus-per-replica", str(gpus),
                             "--cpus-per-replica", str(max(1, (os.cpu_count() or 2) // replicas))],
                            stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen, probe: str, timeout: float = 900.0) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + probe, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready at {url} after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # ray-serve deletes its application and stops its Ray
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_row(row: str, model: Path, texts: list[str], folder: Path, device: str) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = folder / f"{row}.log"
    proc = start(row, model, port, log, device)
    try:
        try:
            wait_ready(url, proc, "/openapi.json" if row == "serve_rm" else "/health")
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{row}: {e}; its log ends:\n{log.read_text()[-3000:] if log.exists() else ''}") from e
        with PeakRSS(proc.pid) as rss:
            result = asyncio.run(burst(url, texts))
        result["peak_rss"] = rss.peak
    finally:
        stop(proc)
    return result


def table(results: dict[str, dict[str, Any]], n: int) -> list[str]:
    """The rows as printed lines."""
    ref = results.get("serve", {}).get("rewards")
    lines = [f"burst of {n:,} simultaneous one-sample /get_reward requests (OpenRLHF's request loop, one process, "
             f"{TRIES} tries a second apart):",
             f"{'server':<10}{'drain s':>9}{'req/s':>9}{'peak RSS MiB':>14}{'refused':>9}{'conn err':>10}"
             f"{'lost':>6}{'max |diff| vs serve':>21}"]
    for row, r in results.items():
        if "skipped" in r:
            lines.append(f"{row:<10}  not run: {r['skipped']}")
            continue
        refused = sum(v for k, v in r["tries"].items() if k.isdigit() and k != "200")
        errors = sum(v for k, v in r["tries"].items() if not k.isdigit())
        lost = sum(x is None for x in r["rewards"])
        diffs = [abs(a - b) for a, b in zip(r["rewards"], ref or []) if a is not None and b is not None]
        lines.append(f"{row:<10}{r['drain_s']:>9.1f}{n / r['drain_s']:>9.0f}{r['peak_rss'] / MiB:>14.0f}{refused:>9}"
                     f"{errors:>10}{lost:>6}{(f'{max(diffs):.1e}' if diffs else '-'):>21}")
    return lines


def default_model(folder: Path) -> Path:
    """The realistic reward model of the trainer-floor bench (bench/realistic.py)."""
    from bench.realistic import build_model

    return build_model(folder / "model")


def measure(n: int = 4096, model: Path | None = None, rows: tuple[str, ...] = ROWS, *, device: str = "cpu") -> list[str]:
    """Every row's burst, one server at a time, as printed lines."""
    texts = queries(n)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-burst-") as tmp, own_home(Path(tmp) / "home"):
        folder = Path(tmp)
        try:
            model = model.resolve() if model is not None else default_model(folder)
        except ImportError as e:
            return [f"burst: not run: no --model given and {e.name} is not here to build one"]
        for row in rows:
            print(f"burst: {row} ...", file=sys.stderr, flush=True)
            try:
                results[row] = run_row(row, model, texts, folder, device)
            except ImportError as e:
                results[row] = {"skipped": f"{e.name} is not here"}
    return table(results, n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4096, help="requests in the burst, one sample each")
    ap.add_argument("--model", type=Path, help="a sequence-classification reward model folder (default: "
                    "bench.realistic's Llama reward model)")
    ap.add_argument("--rows", default=",".join(ROWS), help="which servers, comma-separated: " + ", ".join(ROWS))
    ap.add_argument("--device", default="cpu", help="where the servers run the model (`cuda` on a card)")
    args = ap.parse_args(argv)
    for line in measure(args.requests, args.model, tuple(args.rows.split(",")), device=args.device):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
