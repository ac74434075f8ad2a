"""`python -m tests.soak --service`: the scoring service under kills, driven through its public HTTP API.

1. `rewardstack serve` starts as a subprocess on 127.0.0.1 (a free port), its namespaces in
   `D/service/state`.
2. `--clients` client threads each own a namespace (`soak-0`, `soak-1`, ...) and send its
   `--steps` numbered steps in order (`sequence` 1, 2, ...). A timeout, a dropped connection, 429,
   503 or 504 is retried with the **same** sequence number until it is answered; after an answer,
   some steps are resent once on purpose (a client that never saw the answer) and must come back
   from the store (`X-Rewardstack-Scored: false`) with the same body.
3. A supervisor SIGKILLs the server `--kills` times at random moments (after a random number of
   answers, plus a random fraction of a request's time, so mid-request too) and restarts it on the
   same state folder; the clients keep retrying through the outage.
4. The same steps are scored by the library (one `RewardStack`, one `RewardState` per namespace,
   the stateless and stateful halves the service uses), and compared: every sequence answered,
   each answer's values within 1e-6 of the library's, every retry answered with the stored body,
   and each namespace's final state (sequence, normalizer statistics) equal to the library's:
   nothing lost, nothing applied twice.

Bounded: the whole soak stops by itself after a deadline (`--timeout` x steps, at least ten
minutes), and a client gives up a request after 50 tries; both fail the verdict.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rewardstack.config import MASKS, REWARD_MODELS, load_config
from rewardstack._fileio import event_line
from rewardstack.stack import RewardStack, Step
from rewardstack._state import RewardState, StateStore

from tests.soak.comparison import same
from tests.soak.supervisor import Pace, finish, new_run_dir, popen
from tests.soak.workload import soak_steps

RETRY_STATUSES = frozenset({429, 503, 504})
RESEND_EVERY = 5
"""Every fifth answered step is sent again once (the retry of a client that lost the answer)."""
MAX_TRIES = 50
READY_TIMEOUT_S = 300.0


class Server:
    """`rewardstack serve` as a subprocess on loopback; killed and restarted on the same state."""

    def __init__(self, config: str, state_dir: Path, log_dir: Path) -> None:
        self.config, self.state_dir, self.log_dir = config, state_dir, log_dir
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # free on loopback now; the server binds it soon
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.proc: subprocess.Popen
        self.starts = 0

    def start(self) -> None:
        """Start the server (a fresh process) and wait until /readyz answers 200."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.proc = popen([sys.executable, "-m", "rewardstack.cli", "serve", "--config", self.config, "--host",
                           "127.0.0.1", "--port", str(self.port), "--state-dir", str(self.state_dir)],
                          self.log_dir / f"server-{self.starts}.log")
        self.starts += 1
        deadline = time.time() + READY_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting "
                                   f"(see {self.log_dir}/server-{self.starts - 1}.log)")
            status, _, _ = request(self.port, "GET", "/readyz", None, timeout=2.0)
            if status == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready within {READY_TIMEOUT_S:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server: no drain, no last commit."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int:
        """SIGTERM and wait for the drain (returns the exit code; send_signal skips an exited process)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def request(port: int, method: str, path: str, body: dict[str, Any] | None, *, timeout: float) -> tuple[int | None, dict[str, str], bytes]:
    """One HTTP request on loopback: (status or None for a transport error, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8") if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    except (OSError, http.client.HTTPException):
        return None, {}, b""
    finally:
        conn.close()


class Client(threading.Thread):
    """One namespace's steps in order, each retried with its sequence number until answered."""

    def __init__(self, port: int, namespace: str, steps: list[dict[str, Any]], *, timeout: float, deadline: float,
                 seed: int) -> None:
        super().__init__(daemon=True, name=f"soak-client-{namespace}")
        self.port, self.namespace, self.steps = port, namespace, steps
        self.timeout, self.deadline = timeout, deadline
        self.rng = random.Random(seed)
        self.answers: dict[int, dict[str, Any]] = {}
        self.stats: Counter[str] = Counter()
        self.bad: list[str] = []

    def send(self, sequence: int) -> tuple[int | None, dict[str, str], bytes]:
        """Send step `sequence` until it gets an answer that is not a retryable error."""
        body = {**self.steps[sequence - 1], "namespace": self.namespace, "sequence": sequence}
        for attempt in range(MAX_TRIES):
            if time.time() > self.deadline:
                break
            self.stats["sent"] += 1
            if attempt:
                self.stats["retried"] += 1
            status, headers, data = request(self.port, "POST", "/v1/score", body, timeout=self.timeout)
            if status is not None and status not in RETRY_STATUSES:
                return status, headers, data
            self.stats["transport_errors" if status is None else f"http_{status}"] += 1
            time.sleep(min(2.0, 0.05 * 2 ** min(attempt, 5)) * (0.5 + self.rng.random()))
        return None, {}, b""

    def run(self) -> None:
        for seq in range(1, len(self.steps) + 1):
            status, headers, data = self.send(seq)
            if status != 200:
                self.bad.append(f"{self.namespace} sequence {seq}: {status} {data[:200]!r}")
                return  # a later step would be a gap: stop this namespace here
            answer = json.loads(data)
            if answer.get("sequence") != seq:
                self.bad.append(f"{self.namespace} sequence {seq}: answered as {answer.get('sequence')}")
            self.answers[seq] = answer
            if headers.get("x-rewardstack-scored") == "false":
                self.stats["answered_from_store"] += 1  # a retry whose first try had been applied
            else:
                self.stats["scored"] += 1
            if seq % RESEND_EVERY == 0:  # the client that lost the answer: the stored body, nothing scored
                self.stats["resent"] += 1
                status, headers, again = self.send(seq)
                if status != 200 or headers.get("x-rewardstack-scored") != "false" or again != data:
                    self.bad.append(f"{self.namespace} sequence {seq}: a resend got {status}, scored "
                                    f"{headers.get('x-rewardstack-scored')}, same body {again == data}")
                else:
                    self.stats["resend_from_store"] += 1


def library_run(config: str, per_namespace: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The same steps through the library: one stack (stateless half), one RewardState per namespace."""
    cfg = load_config(config)
    with tempfile.TemporaryDirectory(prefix="rewardstack-soak-library-") as tmp:
        cfg.state_dir = tmp
        stack = RewardStack(cfg, load_state=False)
        events: dict[str, list[dict[str, Any]]] = {}
        states: dict[str, Any] = {}
        for ns, steps in per_namespace.items():
            state = RewardState(cfg)
            events[ns] = [json.loads(event_line(state.apply(stack.forward(Step.from_dict(s))).event)) for s in steps]
            states[ns] = state
    return events, states


def _differences(ns: str, seq: int, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    numeric = [*REWARD_MODELS, *MASKS]
    numeric += [m + "_normalized" for m in numeric] + ["rewards"]
    out = []
    for key in numeric + ["statuses", "model_statuses", "best"]:
        a, b = got.get(key), want.get(key)
        if a != b and not (key in numeric and a is not None and b is not None and len(a) == len(b)
                           and all(same(x, y) for x, y in zip(a, b))):
            out.append(f"{ns} sequence {seq}: {key} differs")
    return out


def _judge_namespace(c: Client, st: Any, lib_events: list[dict[str, Any]], lib_state: Any, active: list[str],
                     steps: int, failures: list[str]) -> dict[str, Any]:
    """One namespace against the library: its answers, the steps never answered, and its saved state.

    `st` is the namespace's state as the server saved it, `lib_state` the library's after the same
    steps; what differs is appended to `failures`.
    """
    diffs = [d for seq, answer in c.answers.items()
             for d in _differences(c.namespace, seq, answer, lib_events[seq - 1])]
    lost = [seq for seq in range(1, steps + 1) if seq not in c.answers]
    want = lib_state.normalizers
    norm_ok = all(st.normalizers[m].count == want[m].count and same(st.normalizers[m].mean, want[m].mean)
                  and same(st.normalizers[m].var, want[m].var) for m in active)
    extra = {m: st.normalizers[m].count - want[m].count for m in active}
    failures += diffs[:5]
    if lost:
        failures.append(f"{c.namespace}: {len(lost)} steps never answered (first {lost[0]})")
    if st.sequence != steps:
        failures.append(f"{c.namespace}: the state's sequence is {st.sequence} for {steps} steps")
    if not norm_ok:
        failures.append(f"{c.namespace}: normalizer statistics differ from the library's (count excess {extra})")
    return {"answered": len(c.answers), "lost": len(lost), "differing": len(diffs),
            "sequence": st.sequence, "normalizers_equal": norm_ok, "count_excess": extra}


def cmd_service_soak(args: argparse.Namespace) -> int:
    """`python -m tests.soak --service`."""
    cfg = load_config(args.config)
    run_dir = new_run_dir(args, "service-soak")
    started = time.time()
    per_ns = {f"soak-{k}": [s.to_dict() for s in soak_steps(args.steps, args.completions, seed=args.seed + k,
                                                             long_every=0)]
              for k in range(args.clients)}
    print(f"service soak: {args.clients} clients x {args.steps} steps x {args.completions} completions, "
          f"{args.kills} server kills, in {run_dir}", file=sys.stderr)
    server = Server(args.config, run_dir / "service" / "state", run_dir / "service")
    server.start()
    # Each namespace's client sends its steps while the server is SIGKILLed and restarted `--kills` times.
    deadline = time.time() + max(600.0, args.timeout * args.steps)
    clients = [Client(server.port, ns, steps, timeout=args.timeout, deadline=deadline, seed=args.seed + 100 + k)
               for k, (ns, steps) in enumerate(per_ns.items())]
    pace = Pace(lambda: sum(len(c.answers) for c in clients), args.seed + 7)
    kill_points: list[dict[str, Any]] = []
    for c in clients:
        c.start()
    for target in pace.targets(args.kills, args.clients * args.steps - args.clients):
        # A random moment of the requests in flight: the clients' answers come `clients` at a time.
        delay = pace.wait(target, lambda: any(c.is_alive() for c in clients) and time.time() < deadline,
                          scale=args.clients)
        if delay is None:
            break
        server.kill()
        kill_points.append({"after_answers": pace.progress(), "delay_s": round(delay, 3)})
        server.start()
        pace.restarted()
    for c in clients:
        c.join(timeout=max(0.0, deadline - time.time()) + 1)
    stopped_rc = server.stop()
    scoring_seconds = time.time() - started

    # Each namespace's answers and final state against the library's.
    lib_events, lib_states = library_run(args.config, per_ns)
    active = [m for m in REWARD_MODELS if cfg.models[m].active]
    failures: list[str] = []
    stats: Counter[str] = Counter()
    per_namespace: dict[str, Any] = {}
    for c in clients:
        stats.update(c.stats)
        failures += c.bad[:5]
        if c.is_alive():
            failures.append(f"{c.namespace}: the client was still running at the deadline")
        state = RewardState(cfg)
        state.load_state_dict(StateStore(run_dir / "service" / "state" / "namespaces" / c.namespace).load())
        per_namespace[c.namespace] = _judge_namespace(c, state, lib_events[c.namespace], lib_states[c.namespace],
                                                      active, args.steps, failures)
    applied_twice = sum(max(0, ns["sequence"] - args.steps) for ns in per_namespace.values()) + sum(
        1 for ns in per_namespace.values() if any(v > 0 for v in ns["count_excess"].values()))
    if len(kill_points) < args.kills:
        failures.append(f"only {len(kill_points)} of {args.kills} kills landed (the clients finished first)")
    if stopped_rc != 0:
        failures.append(f"the server's drain at the end exited {stopped_rc}")
    verdict = {
        "passed": not failures, "failures": failures, "clients": args.clients, "steps_per_client": args.steps,
        "completions_per_step": args.completions, "requests": dict(stats),
        "lost": sum(ns["lost"] for ns in per_namespace.values()),
        "applied_twice": applied_twice, "kills": len(kill_points), "server_starts": server.starts,
        "kill_points": kill_points, "namespaces": per_namespace, "seconds": round(time.time() - started, 1),
        "serving_seconds": round(scoring_seconds, 1),
    }
    return 0 if finish(run_dir, "service_soak", verdict, format_service_verdict(verdict))["passed"] else 1


def format_service_verdict(v: dict[str, Any]) -> str:
    """The service soak's verdict for a person."""
    r = v["requests"]
    rows = [
        f"service soak verdict: {'PASS' if v['passed'] else 'FAIL'}",
        f"  {v['clients']} clients x {v['steps_per_client']} steps x {v['completions_per_step']} completions",
        f"  requests sent {r.get('sent', 0)}, retried {r.get('retried', 0)} (transport errors {r.get('transport_errors', 0)}, "
        + ", ".join(f"{k} {n}" for k, n in sorted(r.items()) if k.startswith("http_")) + ")",
        f"  scored {r.get('scored', 0)}, retries answered from the store {r.get('answered_from_store', 0)}, "
        f"deliberate resends {r.get('resent', 0)} (from the store, same body: {r.get('resend_from_store', 0)})",
        f"  lost {v['lost']}, applied twice {v['applied_twice']}",
        f"  server kills {v['kills']}, starts {v['server_starts']}",
        "  namespaces: " + "; ".join(f"{ns} seq {d['sequence']} answered {d['answered']} differing {d['differing']} "
                                     f"normalizers equal {d['normalizers_equal']}" for ns, d in v["namespaces"].items()),
        f"  {v['seconds']} s",
    ]
    rows += [f"  FAILED: {f}" for f in v["failures"]]
    return "\n".join(rows)

