"""Benchmark of the scoring service against the library, on loopback, bounded in requests and time.

Run: `.venv/bin/python -m bench.service [--config C] [--clients 1,4,16] [--steps 48] [--quick]`.
Starts `rewardstack serve` on 127.0.0.1 (a subprocess), then for 1, 4 and 16 concurrent clients
(each its own namespace, numbering its steps, sending one after another) sends the same workload and
measures requests/s, completions/s, latency p50/p95/p99 and the server's peak resident memory
(VmHWM, reset per row where Linux allows). The same work then runs through the library directly in
this process: one `RewardState` per client, `forward` + `apply` + an atomic save per step, steps
interleaved the way the service received them. Every request must come back 200 and every
namespace must end at the number of steps sent (no request lost, none applied twice). A last row
runs 4 clients against a second server with `--batch-requests 1` (no packing) to measure what
taking several queued requests together buys. Target: the service within 1.15x of the library's
throughput at 4 clients. Without `--config` it builds the offline stand-ins in a temporary folder.

The fairness row (`--fairness-only` runs it alone) measures what one namespace's largest admitted
requests do to another's small one: `--fair-large` senders in one namespace keep requests of
`--fair-work` characters of work (a `--max-chars` prompt, short completions: the shape of issue 33's
stall) queued back to back, while another namespace sends small steps one after another; the row
gives the small steps' latency p50/p99/max and how many missed their deadline (504). The server
runs with `--max-work-chars` set to that work, so the large requests are the largest it admits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vmhwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak(pid: int) -> None:
    try:  # "5" resets the peak resident size (Linux >= 4.0); best effort elsewhere
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class ServerProcess:
    """`rewardstack serve` on a loopback port."""

    def __init__(self, config: Path, log: Path, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")
        env = {k: v for k, v in os.environ.items() if k != "REWARDSTACK_TOKEN"}
        self.proc = subprocess.Popen([sys.executable, "-m", "rewardstack.cli", "serve", "--config", str(config),
                                      "--host", "127.0.0.1", "--port", str(self.port), *extra],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError("server not ready")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def run_service(url: str, pid: int, steps: list[dict], clients: int, tag: str, time_limit: float) -> dict[str, Any]:
    """`clients` threads, each sending its share of `steps` in order; stops starting new ones at the limit."""
    from rewardstack.client import Client

    shares = [steps[i::clients] for i in range(clients)]
    latencies: list[float] = []
    sent: list[int] = [0] * clients
    order: list[tuple[int, dict]] = []  # (client, step) in the order answers came back
    failures: list[str] = []
    lock = threading.Lock()
    start_gate = threading.Barrier(clients + 1)
    deadline = [0.0]

    def client(i: int) -> None:
        with Client(url, namespace=f"{tag}-{i}", timeout=600) as c:
            c.next_sequence()  # outside the timed part
            start_gate.wait()
            for step in shares[i]:
                if time.monotonic() > deadline[0]:
                    break
                t = time.perf_counter()
                try:
                    event = c.score(step)
                except Exception as e:  # noqa: BLE001 - counted as lost below
                    with lock:
                        failures.append(f"{type(e).__name__}: {e}")
                    break
                dt = time.perf_counter() - t
                with lock:
                    latencies.append(dt)
                    order.append((i, step))
                    sent[i] = event["sequence"]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    _reset_peak(pid)
    deadline[0] = time.monotonic() + time_limit
    t0 = time.perf_counter()
    start_gate.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    import httpx

    lost = len(failures)
    for i in range(clients):  # every namespace holds exactly the steps answered 200
        seq = httpx.get(f"{url}/v1/namespaces/{tag}-{i}", timeout=60).json()["sequence"]
        lost += abs(seq - sum(1 for j, _ in order if j == i))
    n = len(latencies)
    comps = sum(len(s["completions"]) for _, s in order)
    return {"mode": "service", "clients": clients, "requests": n, "wall": wall, "rps": n / wall, "cps": comps / wall,
            "p50": _pct(latencies, 50), "p95": _pct(latencies, 95), "p99": _pct(latencies, 99),
            "peak": _vmhwm(pid), "lost": lost, "order": order, "failures": failures[:3]}


def run_library(stack: Any, order: list[tuple[int, dict]], clients: int, state_root: Path) -> dict[str, Any]:
    """The same steps through the library: per client a RewardState, forward + apply + save per step."""
    from rewardstack._state import StateStore

    states = [stack.new_state() for _ in range(clients)]
    stores = [StateStore(state_root / f"lib-{clients}-{i}") for i in range(clients)]
    latencies = []
    _reset_peak(os.getpid())
    t0 = time.perf_counter()
    for i, step in order:
        t = time.perf_counter()
        states[i].apply(stack.forward(step))
        stores[i].save(states[i].state_dict())
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    comps = sum(len(s["completions"]) for _, s in order)
    n = len(order)
    return {"mode": "library", "clients": clients, "requests": n, "wall": wall, "rps": n / wall if wall else 0.0,
            "cps": comps / wall if wall else 0.0, "p50": _pct(latencies, 50), "p95": _pct(latencies, 95),
            "p99": _pct(latencies, 99), "peak": _vmhwm(os.getpid()), "lost": 0}


def run_fairness(url: str, *, work: int, max_chars: int, large_senders: int, smalls: int) -> dict[str, Any]:
    """Small steps of one namespace while `large_senders` threads keep large steps of another queued."""
    import httpx

    n_large = max(1, work // (max_chars + 100))
    large = {"name": "augment", "prompt": ("a long prompt " * (max_chars // 14 + 1))[:max_chars],
             "completions": [f"short answer {j}" for j in range(n_large)], "namespace": "fair-large"}
    stop = threading.Event()
    large_done: list[float] = []
    codes: list[int] = []

    def send_large() -> None:
        with httpx.Client(base_url=url, timeout=900) as c:
            while not stop.is_set():
                t = time.perf_counter()
                r = c.post("/v1/score", json=large)
                codes.append(r.status_code)
                if r.status_code == 200:
                    large_done.append(time.perf_counter() - t)

    small = {"name": "augment", "prompt": "small?", "namespace": "fair-small",
             "completions": ["a short answer", "another short answer"]}
    with httpx.Client(base_url=url, timeout=900) as c:  # unmeasured: first shapes profiled, both namespaces made
        c.post("/v1/score", json=large)
        c.post("/v1/score", json=small)
    threads = [threading.Thread(target=send_large, daemon=True) for _ in range(large_senders)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # one running, the others queued behind it
    latencies: list[float] = []
    missed = 0
    with httpx.Client(base_url=url, timeout=900) as c:
        for k in range(smalls):
            t = time.perf_counter()
            r = c.post("/v1/score", json={**small, "prompt": f"small {k}?"})
            latencies.append(time.perf_counter() - t)
            missed += r.status_code == 504
    stop.set()
    for t in threads:
        t.join()
    return {"work": n_large * (max_chars + len(large["completions"][0])), "large_s": statistics.median(large_done) if large_done else float("nan"),
            "p50": _pct(latencies, 50), "p99": _pct(latencies, 99), "max": max(latencies), "missed": missed,
            "smalls": smalls, "large_codes": sorted(set(codes))}


def _fair_flags(args: argparse.Namespace) -> list[str]:
    """The fairness row's server flags: the large requests are the largest the server admits."""
    cap = [] if args.no_work_cap else ["--max-work-chars", str(args.fair_work)]
    return cap + ["--max-chars", str(args.fair_chars)]


def _fair_row(r: dict[str, Any]) -> str:
    return (f"small request while large ones ({r['work']:,} chars of work, {r['large_s']:.1f} s each) queue from "
            f"another namespace: p50 {r['p50'] * 1000:.0f} ms, p99 {r['p99'] * 1000:.0f} ms, max {r['max'] * 1000:.0f} ms, "
            f"missed deadline {r['missed']}/{r['smalls']}")


def _row(r: dict[str, Any]) -> str:
    peak = f"{r['peak'] / MiB:8.0f}" if r.get("peak") else "       -"
    return (f"{r['clients']:>7} {r['mode']:<18} {r['requests']:>8} {r['rps']:>8.2f} {r['cps']:>11.1f} "
            f"{r['p50'] * 1000:>8.0f} {r['p95'] * 1000:>8.0f} {r['p99'] * 1000:>8.0f} {peak} {r['lost']:>5}")


def _fairness(config: Any, tmp: Path, args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    """The fairness row on a server of its own (`_fair_flags`); its figures and the server's exit code."""
    server = ServerProcess(config, tmp / "server-fair.log", *_fair_flags(args))
    try:
        server.wait_ready(1800)
        fair = run_fairness(server.url, work=args.fair_work, max_chars=args.fair_chars,
                            large_senders=args.fair_large, smalls=args.fair_smalls)
    finally:
        rc = server.stop()
    return fair, rc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="stack config (default: the offline stand-ins, built in a temporary folder)")
    p.add_argument("--clients", default="1,4,16", help="concurrent client counts")
    p.add_argument("--steps", type=int, default=48, help="steps per client count (shared among the clients)")
    p.add_argument("--completions", type=int, default=16, help="completions per step")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per row after which no new request starts")
    p.add_argument("--no-packing-row", action="store_true", help="skip the 4-client row without packing")
    p.add_argument("--quick", action="store_true", help="tiny run: 8 steps of 4 short completions, 1 and 4 clients")
    p.add_argument("--fairness-only", action="store_true", help="run only the fairness row")
    p.add_argument("--fair-work", type=int, default=1_048_576, help="characters of work of each large request")
    p.add_argument("--fair-chars", type=int, default=65_536, help="prompt characters of each large request")
    p.add_argument("--fair-large", type=int, default=4, help="threads keeping large requests queued")
    p.add_argument("--fair-smalls", type=int, default=12, help="small requests measured")
    p.add_argument("--no-work-cap", action="store_true",
                   help="start the fairness row's server without --max-work-chars (to time a version without it)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.completions, args.clients, args.time_limit = 8, 4, "1,4", min(args.time_limit, 120.0)
    counts = [int(x) for x in args.clients.split(",")]

    import logging

    from transformers.utils import logging as hf_logging

    logging.basicConfig(level=logging.WARNING)
    hf_logging.disable_progress_bar()
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack
    from tests.soak.synthetic import heavy_tailed_steps

    tmp = Path(tempfile.mkdtemp(prefix="rewardstack-bench-service-"))
    if args.config:
        source = Path(args.config).resolve()
    else:
        from rewardstack._standins import make_standins

        source = Path(make_standins(tmp / "standins"))
    # Same models, a state folder of this run's own (beside the source so relative paths resolve).
    config = source.parent / f".bench-service-{os.getpid()}.toml"
    text = source.read_text()
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("state_dir")]
    config.write_text(f'state_dir = "{tmp / "state"}"\n' + "\n".join(lines) + "\n")
    try:
        steps = [s.to_dict() for s in heavy_tailed_steps(args.steps, args.completions, seed=1, long_chars=0,
                                                          prompt_chars=200 if args.quick else 400)]
        if args.quick:
            for s in steps:
                s["completions"] = [c[:120] for c in s["completions"]]
        queue = str(max(64, 2 * max(counts)))
        if args.fairness_only:
            fair, rc = _fairness(config, tmp, args)
            print(_fair_row(fair))
            print(json.dumps({"fairness": fair}), file=sys.stderr)
            return 0 if rc == 0 else 1
        server = ServerProcess(config, tmp / "server.log", "--queue-size", queue)
        t_load = time.perf_counter()
        stack = RewardStack(load_config(config), load_state=False)
        stack.forward(steps[0])  # warm, as the server's startup pass
        server.wait_ready(1800)
        print(f"# models loaded (server ready after {time.perf_counter() - t_load:.0f}s); "
              f"{len(steps)} steps x {args.completions} completions per row; state in {tmp}", file=sys.stderr)
        rows: list[dict[str, Any]] = []
        try:
            for c in counts:
                svc = run_service(server.url, server.proc.pid, steps, c, f"c{c}", args.time_limit)
                lib = run_library(stack, svc["order"], c, tmp / "lib")
                rows += [svc, lib]
                print(_row(svc), file=sys.stderr)
        finally:
            rc = server.stop()
        fair, _ = _fairness(config, tmp, args)
        if not args.no_packing_row and 4 in counts:
            plain = ServerProcess(config, tmp / "server-nopack.log", "--queue-size", queue, "--batch-requests", "1")
            try:
                plain.wait_ready(1800)
                r = run_service(plain.url, plain.proc.pid, steps, 4, "nopack", args.time_limit)
                r["mode"] = "service, no packing"
                rows.append(r)
            finally:
                plain.stop()
    finally:
        config.unlink(missing_ok=True)
    print("\nscoring service vs the library (loopback; same steps, same order per client)")
    print(f"{'clients':>7} {'mode':<18} {'requests':>8} {'req/s':>8} {'compl/s':>11} {'p50 ms':>8} {'p95 ms':>8} "
          f"{'p99 ms':>8} {'peak MiB':>8} {'lost':>5}")
    for r in rows:
        print(_row(r))
    by = {(r["clients"], r["mode"]): r for r in rows}
    if (4, "service") in by and (4, "library") in by:
        ratio = by[(4, "library")]["rps"] / by[(4, "service")]["rps"]
        print(f"\nlibrary/service throughput at 4 clients: {ratio:.2f}x (target <= 1.15x): {'met' if ratio <= 1.15 else 'NOT met'}")
    if (4, "service, no packing") in by and (4, "service") in by:
        gain = by[(4, "service")]["rps"] / by[(4, "service, no packing")]["rps"]
        print(f"packing queued requests (batch_requests 16 vs 1) at 4 clients: {gain:.2f}x throughput")
    print(_fair_row(fair))
    lost = sum(r["lost"] for r in rows)
    print(f"requests lost or applied twice: {lost}; server exit status {rc}")
    print(json.dumps({"rows": [{k: v for k, v in r.items() if k not in ("order",)} for r in rows]}), file=sys.stderr)
    return 0 if lost == 0 and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
