"""Benchmark of the trainer routes: cross-request batching, a mixed load, and what telemetry costs.

Run: `.venv/bin/python -m bench.trainers [--clients 64] [--requests 6] [--steps 12] [--repeats 3]`.
Builds the offline stand-ins in a temporary folder and serves the OpenAssistant stand-in (a
DeBERTa-v2 sequence classifier) as a user-named reward model, `[rewards.oa]`. Rows, all in this run:

- batched / one at a time: `--clients` concurrent OpenRLHF-style clients, each sending one-sample
  `POST /get_reward` requests back to back, against the server as configured and against the same
  server with `service.slice_tokens = 1` (each input its own slice); requests/s and
  latency p50/p99 (goal: batched >= 3x the throughput);
- mixed: one validator sending `--steps` numbered steps of the stand-in stack alone, then while
  the trainer clients send; the validator's step latency p50/p99 (every step applied once, in order);
- telemetry: what `--run-dir` costs the batched load, two ways. In one process: the server's scoring
  path (batches of `--clients` one-sample jobs) with the run directory's telemetry subscribed and
  not, batch by batch, 80 x `--repeats` batches each, with an A/A pair; the median of the paired
  CPU-time ratios is judged (goal: on within 1% of off), the best of each printed beside it.
  Over HTTP: servers with `--run-dir` on and off (four times `--requests`), interleaved, `--repeats`
  times each, best of each, with the server's CPU time, and a second server off in every round (an
  A/A pair: how far two identical servers differ, what this protocol can resolve).

The servers share a `REWARDSTACK_HOME` of their own for the run: the pass size is tuned on this
machine as the first server loads, not read from a calibration cache tuned elsewhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import own_home
from bench.service import ServerProcess, _pct


def _queries(n: int) -> list[str]:
    words = "the model reads a prompt and its response then scores how helpful the answer was".split()
    return [f"<|user|> question {i}: " + " ".join(words[(i + k) % len(words)] for k in range(8 + i % 40))
            + f"\n<|assistant|> answer {i}" for i in range(n)]


def trainer_load(url: str, clients: int, requests: int, *, stop: threading.Event | None = None) -> dict[str, Any]:
    """`clients` threads, each sending `requests` one-sample /get_reward requests back to back."""
    import httpx

    queries = _queries(clients * max(1, requests))
    latencies: list[float] = []
    failures: list[str] = []
    gate = threading.Barrier(clients + 1)
    lock = threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            gate.wait()
            for k in range(requests if stop is None else 10**9):
                if stop is not None and stop.is_set():
                    return
                t = time.perf_counter()
                r = c.post("/get_reward", json={"query": [queries[(i * max(1, requests) + k) % len(queries)]]})
                with lock:
                    latencies.append(time.perf_counter() - t)
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    gate.wait()
    t0 = time.perf_counter()
    if stop is not None:
        return {"threads": threads, "latencies": latencies, "failures": failures, "t0": t0}
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    assert not failures, failures[:3]
    return {"rps": len(latencies) / wall, "p50": _pct(latencies, 50), "p99": _pct(latencies, 99), "wall": wall}


def validator_load(url: str, steps: int, tag: str) -> dict[str, Any]:
    """One validator's numbered steps, one after another; each must be applied once, in order."""
    from rewardstack.client import Client

    latencies = []
    with Client(url, namespace=tag, timeout=600) as c:
        for k in range(steps):
            step = {"name": "augment" if k % 2 == 0 else "answer0", "prompt": f"{tag} prompt {k}?",
                    "completions": [f"{tag} completion {k}-{j} " + "word " * (5 + j) for j in range(8)]}
            t = time.perf_counter()
            answer = c.score(step, sequence=k + 1)
            latencies.append(time.perf_counter() - t)
            assert answer["sequence"] == k + 1, answer
    return {"p50": _pct(latencies, 50), "p99": _pct(latencies, 99), "max": max(latencies)}


def _config(standins: Path, root: Path, tag: str, *, validators: bool, service: str = "", device: str = "cpu") -> Path:
    """The stand-in stack (with `validators`) or nothing but `[rewards.oa]`, with a [service] table."""
    base = (standins / "stack.toml").read_text() if validators else ""
    text = base.replace('state_dir = "state"', "") if validators else ""
    text = f'state_dir = "{root / tag / "state"}"\n' + text
    if device != "cpu":
        text = f'device = "{device}"\n' + text
    text += f'\n[rewards.oa]\npath = "{standins / "rlhf_reward_model"}"\n'
    if service:
        text += f"\n[service]\n{service}\n"
    path = standins / f"bench-trainers-{tag}.toml"  # beside the stand-ins: their relative paths resolve
    path.write_text(text)
    return path


def _serve(config: Path, root: Path, *extra: str) -> ServerProcess:
    log = root / (config.stem + ".log")
    server = ServerProcess(config, log, *extra)
    try:
        server.wait_ready(600)
    except (RuntimeError, TimeoutError):
        server.stop()
        print(log.read_text()[-3000:])  # why it did not start: the log goes with the temporary folder
        raise
    return server


TABLES = ("batching", "mixed", "telemetry")


def _batching(standins: Path, root: Path, clients: int, requests: int, device: str) -> list[str]:
    rows: dict[str, dict[str, Any]] = {}
    for tag, service in (("batched", ""), ("one at a time", "slice_tokens = 1")):
        config = _config(standins, root, tag.replace(" ", "-"), validators=False, service=service, device=device)
        server = _serve(config, root)
        try:
            trainer_load(server.url, clients, 1)  # warm-up: first calls, connections
            rows[tag] = trainer_load(server.url, clients, requests)
        finally:
            server.stop()
    lines = [f"trainer load: {clients} concurrent one-sample /get_reward clients, {requests} requests "
             f"each, OpenAssistant stand-in (DeBERTa-v2) as [rewards.oa], {device}",
             "| server | requests/s | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    for tag, r in rows.items():
        lines.append(f"| {tag} | {r['rps']:.1f} | {r['p50'] * 1e3:.0f} | {r['p99'] * 1e3:.0f} |")
    ratio = rows["batched"]["rps"] / rows["one at a time"]["rps"]
    lines.append(f"TARGET batched / one at a time >= 3x throughput: {ratio:.2f}x {'met' if ratio >= 3 else 'NOT met'}")
    return lines


def _mixed(standins: Path, root: Path, clients: int, steps: int, device: str) -> list[str]:
    server = _serve(_config(standins, root, "mixed", validators=True, device=device), root)
    try:
        validator_load(server.url, 2, "warm")
        alone = validator_load(server.url, steps, "alone")
        stop = threading.Event()
        running = trainer_load(server.url, clients, 0, stop=stop)
        time.sleep(1.0)
        mixed = validator_load(server.url, steps, "mixed")
        stop.set()
        for th in running["threads"]:
            th.join()
        assert not running["failures"], running["failures"][:3]
        trainer_rps = len(running["latencies"]) / (time.perf_counter() - running["t0"])
    finally:
        server.stop()
    lines = [f"mixed load: one validator's {steps} steps (8 completions, stand-in stack) alone and while "
             f"{clients} trainer clients send ({trainer_rps:.1f} trainer requests/s meanwhile)",
             "| validator | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|"]
    for tag, r in (("alone", alone), ("with trainers", mixed)):
        lines.append(f"| {tag} | {r['p50'] * 1e3:.0f} | {r['p99'] * 1e3:.0f} | {r['max'] * 1e3:.0f} |")
    return lines


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (Linux /proc), in seconds; NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _telemetry_http(standins: Path, root: Path, clients: int, requests: int, repeats: int, device: str) -> list[str]:
    """End to end over HTTP: servers with --run-dir on and off, interleaved, best of each;
    a second "off" server in every round (an A/A pair) shows what the protocol can resolve."""
    tags = ("off", "on", "off again")
    walls: dict[str, list[float]] = {t: [] for t in tags}
    cpus: dict[str, list[float]] = {t: [] for t in tags}
    config = _config(standins, root, "telemetry", validators=False, device=device)
    for k in range(repeats):
        for tag in tags[k % 3:] + tags[:k % 3]:  # each takes each place in a round (the first ran slower)
            extra = ("--run-dir", str(root / f"run-{k}")) if tag == "on" else ()
            server = _serve(config, root, *extra)
            try:
                trainer_load(server.url, clients, 1)
                cpu = _cpu_seconds(server.proc.pid)
                walls[tag].append(trainer_load(server.url, clients, requests)["wall"])
                cpus[tag].append(_cpu_seconds(server.proc.pid) - cpu)
            finally:
                server.stop()
    best = {t: min(w) for t, w in walls.items()}
    cpu = {t: statistics.median(c) for t, c in cpus.items()}
    return [f"over HTTP: the batched trainer load ({clients} clients x {requests} requests) against a server with "
            f"--run-dir on and off, interleaved (the order rotating), best of {repeats}; a second server off in each "
            "round (A/A)",
            "| server | best s | median s | server CPU s, median |", "|---|---:|---:|---:|",
            *(f"| {t} | {best[t]:.2f} | {statistics.median(walls[t]):.2f} | {cpu[t]:.2f} |" for t in tags),
            f"on against off {100 * (best['on'] / best['off'] - 1):+.1f}%; off again against off (no difference "
            f"but the server process) {100 * (best['off again'] / best['off'] - 1):+.1f}%"]


def _telemetry_inprocess(standins: Path, root: Path, clients: int, rounds: int, device: str) -> tuple[list[str], float]:
    """The same scoring path in one process, nothing else differing: one loaded stack scores
    batches of `clients` one-sample trainer jobs (the worker's `score_now`, as the batched server
    forms them) with a run directory's telemetry (`Telemetry`, as `serve --run-dir` opens it)
    subscribed to the memory layer for the "on" batches only. Off, on and off again take turns
    batch by batch, `rounds` batches each, the order rotating. Returns the lines and the cost
    judged: the median over rounds of on / off CPU time, less 1."""
    from rewardstack._service.batching import prepare_job, score_now
    from rewardstack._telemetry.session import Telemetry
    from rewardstack.stack import RewardStack

    stack = RewardStack.from_config(str(_config(standins, root, "telemetry-inprocess", validators=False,
                                                device=device)), load_state=False)
    queries = _queries(8 * clients)

    def batch(k: int) -> None:
        jobs = [prepare_job(stack, [q], ["query[0]"], ["rewards.oa"], time.monotonic() + 600)
                for q in queries[(k % 8) * clients:(k % 8 + 1) * clients]]
        score_now(stack, jobs)
        for job in jobs:
            job.future.result()

    for k in range(8):  # warm-up
        batch(k)
    telemetry = Telemetry(stack, run_dir=root / "run-inprocess", metrics_port=None)
    monitor = telemetry.monitor
    stack.memory.unsubscribe(monitor)  # the trainer routes' calls reach telemetry through this hook only
    tags = ("off", "on", "off again")
    walls: dict[str, list[float]] = {t: [] for t in tags}
    cpus: dict[str, list[float]] = {t: [] for t in tags}
    for k in range(rounds):
        for tag in tags[k % 3:] + tags[:k % 3]:
            if tag == "on":
                stack.memory.subscribe(monitor)
            t, c = time.perf_counter(), time.process_time()
            batch(k)
            walls[tag].append(time.perf_counter() - t)
            cpus[tag].append(time.process_time() - c)
            if tag == "on":
                stack.memory.unsubscribe(monitor)
    telemetry.close()
    written = sum(1 for _ in (root / "run-inprocess" / "timeline.jsonl").open())

    def paired(values: dict[str, list[float]], tag: str) -> float:
        return statistics.median(a / b for a, b in zip(values[tag], values["off"])) - 1

    lines = [f"in one process: batches of {clients} one-sample trainer jobs through the server's scoring path, "
             f"telemetry with a run directory subscribed for the \"on\" batches only; off, on and off again "
             f"batch by batch, {rounds} batches each ({written} timeline records written)",
             "| telemetry | best s | CPU s, best | wall: median of paired ratios to off | CPU: median of paired ratios |",
             "|---|---:|---:|---:|---:|"]
    for t in tags:
        lines.append(f"| {t} | {min(walls[t]):.4f} | {min(cpus[t]):.4f} | {100 * paired(walls, t):+.2f}% "
                     f"| {100 * paired(cpus, t):+.2f}% |")
    return lines, paired(cpus, "on")


def _telemetry(standins: Path, root: Path, clients: int, requests: int, repeats: int, device: str) -> list[str]:
    """What telemetry costs: in one process (the figure the goal is judged on), then over HTTP (best
    of several servers each, with its A/A pair). Judged on the median of paired CPU-time ratios
    because on this machine the best of each side moves by about 1% between two identical sides
    (the A/A rows print how far), which a paired median does not."""
    lines, cost = _telemetry_inprocess(standins, root, clients, 80 * repeats, device)
    lines += [f"TARGET telemetry costs <= 1% (in one process, CPU time, median of paired ratios): {100 * cost:+.2f}% "
              f"{'met' if cost <= 0.01 else 'NOT met'}", ""]
    return ["telemetry: what --run-dir costs the batched trainer load", *lines,
            *_telemetry_http(standins, root, clients, requests, repeats, device)]


def measure(clients: int, requests: int, steps: int, repeats: int, standins: Path | None = None, *,
            device: str = "cpu", tables: tuple[str, ...] = TABLES) -> list[str]:
    """The three tables (batched against one at a time, the mixed load, telemetry on and off), as
    printed lines; `standins`: a folder of built stand-ins (default: built in a temporary folder;
    the batching and telemetry tables need only its `rlhf_reward_model`); `device`: where the
    server runs the models; `tables`: which of the three to measure."""
    from rewardstack._standins import make_standins

    parts = []
    with tempfile.TemporaryDirectory(prefix="bench-trainers-") as tmp, own_home(Path(tmp) / "home"):
        root = Path(tmp)  # the first server tunes the pass size in that home, the rest read it
        standins = standins.resolve() if standins is not None else Path(make_standins(root / "standins")).parent
        if "batching" in tables:
            parts.append(_batching(standins, root, clients, requests, device))
        if "mixed" in tables:
            parts.append(_mixed(standins, root, clients, steps, device))
        if "telemetry" in tables:
            # Four times the batching rows' load: a 1% difference is lost in a run of under a second.
            parts.append(_telemetry(standins, root, clients, 4 * requests, repeats, device))
    return [line for k, part in enumerate(parts) for line in ([""] if k else []) + part]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainers", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=6, help="requests per client per row")
    ap.add_argument("--steps", type=int, default=12, help="validator steps per mixed row")
    ap.add_argument("--repeats", type=int, default=3, help="telemetry on/off servers each (in one process: 80 times as many batches each)")
    ap.add_argument("--standins", help="a folder of already built stand-ins (default: built in a temporary folder)")
    ap.add_argument("--device", default="cpu", help="where the server runs the models (`cuda` on a card)")
    ap.add_argument("--tables", default=",".join(TABLES), help="which tables, comma-separated: " + ", ".join(TABLES))
    ap.add_argument("--build-standin", metavar="DIR", help="only build the stand-in the batching and telemetry "
                    "tables score with into DIR (for a machine that cannot build it: scripts/gpu-trainers.sh)")
    args = ap.parse_args(argv)
    if args.build_standin:
        import shutil

        from rewardstack._standins import make_standins

        with tempfile.TemporaryDirectory() as tmp:
            built = Path(make_standins(Path(tmp) / "standins")).parent / "rlhf_reward_model"
            shutil.copytree(built, Path(args.build_standin) / "rlhf_reward_model", dirs_exist_ok=True)
        print(Path(args.build_standin) / "rlhf_reward_model")
        return 0
    tables = tuple(t for t in args.tables.split(",") if t)
    if set(tables) - set(TABLES):
        ap.error(f"--tables: unknown {sorted(set(tables) - set(TABLES))}; choose from {', '.join(TABLES)}")
    lines = measure(args.clients, args.requests, args.steps, args.repeats,
                    Path(args.standins) if args.standins else None, device=args.device, tables=tables)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
