"""Trainer routes on a realistic reward model: rewardstack against OpenRLHF's serve_rm.py and the floor.

Run: `python -m bench.trainer_floor [--texts 512] [--rounds 3] [--flood-clients 32] [--steps 20]`
(`python -m bench --trainer-floor-only` runs it and writes its section of bench/RESULTS.md).

The model is `bench.realistic`'s (Llama, 6 layers, width 384, float32, a real WordPiece tokenizer
acting as Llama-3's) and the workload its `chat_texts` (chat-templated, BOS written in, 100-500
tokens, about 15% past the 512-token bound). Three contestants, each one process with one torch
thread (`OMP_NUM_THREADS=1`):

- rewardstack: `rewardstack serve` with the model as `[rewards.rm]` (float32, `max_length` 512,
  right truncation), in a `REWARDSTACK_HOME` of the run's own (calibrated on this machine now);
- the peer: OpenRLHF's `serve_rm.py` (`bench.peer`: its source at 3c3be623, only the model loader
  replaced, float32, `--data.max_len 512`);
- the floor: the same model's plain forward in this process over the same texts, tokenized as the
  peer does (no special tokens added: the text carries its BOS), cut at 512 tokens, sorted by
  length into static batches of 8 and of 16 rows (`bench.floors.static_batches`; the faster of
  the two in each round, measured once a round for the shapes that share texts); tokenization
  outside the timed part.

Shapes, each over `POST /get_reward` with `{"query": [...]}` as OpenRLHF's executor sends it:
`--clients` (64) concurrent clients sending one-sample requests back to back over all the texts;
4 clients sending 64-sample requests over all the texts; one client sending the last 256 texts
in one request. Every round runs every shape on rewardstack, the peer and the floor, the order
rotating from round to round; samples/s per round, median and best over `--rounds`. Targets
(judged on the medians): rewardstack >= 0.9x the floor on every shape, ahead of the peer on every
shape, >= 1.5x the peer on the two multi-sample shapes.

Sanity: on the first round's one-client shape every text's reward from rewardstack and from the
floor is compared with the peer's (within 1e-4: the same model, the same convention).

Mixed: a `rewardstack serve` with the stand-in validator stack and `[rewards.rm]`; one validator
sends `--steps` numbered steps alone, then while `--flood-clients` trainer clients send
`--flood-size`-sample requests of the realistic texts back to back; its step p99 under the flood
must be within 2x its p99 alone.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from bench import peer, realistic
from bench.common import own_home
from bench.service import ServerProcess
from bench.trainers import validator_load

SERVERS = ("rewardstack", "peer", "floor")
FLOOR_BATCHES = (8, 16)
TARGET_FLOOR, TARGET_PEER, TARGET_PEER_MULTI, TARGET_VALIDATOR = 0.9, 1.0, 1.5, 2.0


@dataclass(frozen=True)
class Shape:
    """A load: `clients` concurrent clients sending `per_request`-sample requests over `texts`
    (indices into the run's texts)."""

    name: str
    clients: int
    per_request: int
    texts: range
    multi: bool


def shapes(n_texts: int, clients: int = 64, multi_clients: int = 4, multi_size: int = 64, big: int = 256) -> list[Shape]:
    """The three shapes over `n_texts` texts (the big request takes the last `big` of them)."""
    big = min(big, n_texts)
    return [Shape(f"{clients} clients x 1 sample", clients, 1, range(n_texts), False),
            Shape(f"{multi_clients} clients x {multi_size} samples", multi_clients, multi_size, range(n_texts), True),
            Shape(f"1 client x {big} samples", 1, big, range(n_texts - big, n_texts), True)]


def drive(url: str, requests: list[list[str]], clients: int, *, stop: threading.Event | None = None) -> dict[str, Any]:
    """`clients` threads taking `requests` in turn and posting each to `/get_reward` (until `stop` is
    set, cycling, when given). Returns wall seconds, samples/s and each request's rewards."""
    import httpx

    order = itertools.cycle(range(len(requests))) if stop is not None else iter(range(len(requests)))
    rewards: dict[int, list[float]] = {}
    failures: list[str] = []
    lock = threading.Lock()
    gate = threading.Barrier(clients + 1)
    done = [0]

    def client() -> None:
        with httpx.Client(base_url=url, timeout=900) as c:
            gate.wait()
            while stop is None or not stop.is_set():
                with lock:
                    k = next(order, None)
                if k is None:
                    return
                r = c.post("/get_reward", json={"query": requests[k]})
                with lock:
                    done[0] += len(requests[k])
                    if r.status_code == 200:
                        rewards[k] = [float(x) for x in r.json()["rewards"]]
                    else:
                        failures.append(f"{r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for th in threads:
        th.start()
    gate.wait()
    t0 = time.perf_counter()
    if stop is not None:
        return {"threads": threads, "failures": failures, "t0": t0, "done": done}
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if failures:
        raise RuntimeError(f"{url}: {len(failures)} requests failed, e.g. {failures[0]}")
    return {"wall": wall, "sps": done[0] / wall, "rewards": [x for k in range(len(requests)) for x in rewards[k]]}


def _requests(texts: list[str], shape: Shape) -> list[list[str]]:
    picked = [texts[i] for i in shape.texts]
    return [picked[k:k + shape.per_request] for k in range(0, len(picked), shape.per_request)]


class Floor:
    """The realistic model loaded in this process, one torch thread, for `floors.static_batches`."""

    def __init__(self, model_dir: Path, texts: list[str]) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                        attn_implementation="sdpa").eval()
        self.pad_id = tok.pad_token_id
        self.rows = tok(texts, add_special_tokens=False, truncation=True, max_length=realistic.MAX_LENGTH)["input_ids"]

    def run(self, shape: Shape) -> dict[str, Any]:
        """The faster static batch size over the shape's texts: samples/s, the batch, the rewards."""
        from bench.floors import static_batches

        rows = [self.rows[i] for i in shape.texts]
        best: dict[str, Any] = {"sps": 0.0}
        for batch in FLOOR_BATCHES:
            seconds, scores = static_batches(self.model, rows, self.pad_id, batch)
            if len(rows) / seconds > best["sps"]:
                best = {"sps": len(rows) / seconds, "batch": batch, "rewards": scores}
        return best


def _config(root: Path, model_dir: Path, tag: str, standins: Path | None = None) -> Path:
    """`[rewards.rm]` on the realistic model; with `standins`, beside the stand-in validator stack."""
    table = (f'\n[rewards.rm]\npath = "{model_dir}"\ndtype = "float32"\nmax_length = {realistic.MAX_LENGTH}\n'
             'truncation_side = "right"\n')
    base = (standins / "stack.toml").read_text().replace('state_dir = "state"', "") if standins else ""
    folder = standins or root
    path = folder / f"bench-trainer-floor-{tag}.toml"  # beside the stand-ins: their relative paths resolve
    path.write_text(f'state_dir = "{root / tag / "state"}"\n' + base + table)
    return path


def _serve(config: Path, root: Path, then: Any = None) -> ServerProcess:
    """`rewardstack serve` on `config`, ready; `then()` runs while it loads (another server's start)."""
    server = ServerProcess(config, root / (config.stem + ".log"))
    try:
        if then is not None:
            then()
        server.wait_ready(1800)
    except BaseException:
        server.stop()
        print((root / (config.stem + ".log")).read_text()[-3000:])
        raise
    return server


def _rounds(urls: dict[str, str], floor: Floor, texts: list[str], loads: list[Shape], rounds: int
            ) -> tuple[dict[tuple[str, str], list[float]], dict[str, list[float]], dict[int, int]]:
    """Samples/s per (shape, server) over the interleaved rounds; the first round's rewards on the
    last shape (one request of many lengths) per server; how often each floor batch size won."""
    sps: dict[tuple[str, str], list[float]] = {}
    rewards: dict[str, list[float]] = {}
    won: dict[int, int] = {}
    for r in range(rounds):
        floors: dict[range, dict[str, Any]] = {}  # shapes over the same texts share a round's floor
        for shape in loads:
            for who in SERVERS[r % 3:] + SERVERS[:r % 3]:
                if who == "floor":
                    if shape.texts not in floors:
                        floors[shape.texts] = out = floor.run(shape)
                        won[out["batch"]] = won.get(out["batch"], 0) + 1
                    out = floors[shape.texts]
                else:
                    out = drive(urls[who], _requests(texts, shape), shape.clients)
                sps.setdefault((shape.name, who), []).append(out["sps"])
                if r == 0 and shape is loads[-1]:  # one request of many lengths: padded batches
                    rewards[who] = out["rewards"]
    return sps, rewards, won


def _throughput(root: Path, model_dir: Path, texts: list[str], loads: list[Shape], rounds: int) -> list[str]:
    port = peer.free_port()
    urls = {"peer": f"http://127.0.0.1:{port}"}
    log = open(root / "serve_rm.log", "wb")
    procs = []
    try:
        server = _serve(_config(root, model_dir, "alone"), root,
                        then=lambda: procs.append(peer.start_serve_rm(model_dir, port, log=log)))
        urls["rewardstack"] = server.url
        try:
            peer.wait_ready(urls["peer"], procs[0], 600)
            floor = Floor(model_dir, texts)
            for url in urls.values():  # warm-up: first calls, connections, first shapes
                drive(url, [[t] for t in texts[:2 * loads[0].clients]], loads[0].clients)
                drive(url, [texts[:loads[1].per_request]], 1)
            floor.run(loads[0])
            sps, rewards, won = _rounds(urls, floor, texts, loads, rounds)
        finally:
            server.stop()
    finally:
        for proc in procs:
            peer.stop(proc)
        log.close()
    return table(sps, rewards, won, loads, rounds)


def table(sps: dict[tuple[str, str], list[float]], rewards: dict[str, list[float]], won: dict[int, int],
          loads: list[Shape], rounds: int) -> list[str]:
    """The throughput table, each target marked met or not (on the medians), and the sanity lines:
    `sps[(shape name, server)]` samples/s per round, `rewards[server]` on the same texts."""
    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = ["| shape | rewardstack median (best) | serve_rm median (best) | floor median (best) | rs / floor | rs / serve_rm |",
             "|---|---:|---:|---:|---:|---:|"]
    targets = []
    for shape in loads:
        med = {w: statistics.median(sps[(shape.name, w)]) for w in SERVERS}
        best = {w: max(sps[(shape.name, w)]) for w in SERVERS}
        vs_floor, vs_peer = med["rewardstack"] / med["floor"], med["rewardstack"] / med["peer"]
        lines.append(f"| {shape.name} | " + " | ".join(f"{med[w]:.1f} ({best[w]:.1f})" for w in SERVERS)
                     + f" | {vs_floor:.2f}x | {vs_peer:.2f}x |")
        targets.append(f"TARGET rewardstack >= {TARGET_FLOOR}x floor, {shape.name}: {vs_floor:.2f}x {met(vs_floor >= TARGET_FLOOR)}")
        goal = TARGET_PEER_MULTI if shape.multi else TARGET_PEER
        ok = vs_peer >= goal if shape.multi else vs_peer > goal
        targets.append(f"TARGET rewardstack {'>= ' + str(goal) + 'x' if shape.multi else 'ahead of'} serve_rm, "
                       f"{shape.name}: {vs_peer:.2f}x {met(ok)}")
    lines += targets
    lines.append(f"samples/s over {rounds} interleaved rounds (median, best in brackets; ratios of medians); "
                 "floor batch size that won: " + ", ".join(f"{b} rows {n}x" for b, n in sorted(won.items())))
    ref = rewards["peer"]
    for who in ("rewardstack", "floor"):
        diff = max(abs(a - b) for a, b in zip(rewards[who], ref))
        lines.append(f"SANITY {who} rewards against serve_rm's on the same {len(ref)} texts: max |diff| {diff:.2e} "
                     f"(within 1e-4: {met(diff <= 1e-4)})")
    return lines


def _mixed(root: Path, model_dir: Path, standins: Path, texts: list[str], clients: int, size: int,
           steps: int) -> list[str]:
    """A validator's step latency alone and under a trainer flood of realistic requests."""
    server = _serve(_config(root, model_dir, "mixed", standins), root)
    requests = [texts[k:k + size] for k in range(0, len(texts) - size + 1, size)] or [texts[:size]]
    try:
        validator_load(server.url, 2, "warm")
        alone = validator_load(server.url, steps, "alone")
        stop = threading.Event()
        flood = drive(server.url, requests, clients, stop=stop)
        time.sleep(1.0)
        mixed = validator_load(server.url, steps, "flood")
        stop.set()
        for th in flood["threads"]:
            th.join()
        trainer_sps = flood["done"][0] / (time.perf_counter() - flood["t0"])
    finally:
        server.stop()
    if flood["failures"]:
        raise RuntimeError(f"trainer flood: {len(flood['failures'])} requests failed, e.g. {flood['failures'][0]}")
    ratio = mixed["p99"] / alone["p99"]
    return [f"validator under a trainer flood: one validator's {steps} steps (8 completions, stand-in stack) alone, "
            f"then while {clients} trainer clients send {size}-sample requests of the chat texts "
            f"({trainer_sps:.1f} trainer samples/s meanwhile), same server",
            "| validator | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|",
            *(f"| {tag} | {r['p50'] * 1e3:.0f} | {r['p99'] * 1e3:.0f} | {r['max'] * 1e3:.0f} |"
              for tag, r in (("alone", alone), ("under the flood", mixed))),
            f"TARGET validator p99 under the flood <= {TARGET_VALIDATOR}x alone: {ratio:.2f}x "
            f"{'met' if ratio <= TARGET_VALIDATOR else 'NOT met'}"]


def measure(n_texts: int = 512, rounds: int = 3, *, clients: int = 64, multi_clients: int = 4, multi_size: int = 64,
            big: int = 256, flood_clients: int = 32, flood_size: int = 8, steps: int = 20,
            standins: Path | None = None, tiny: bool = False) -> list[str]:
    """The section's lines: the throughput table with its targets and sanity lines, then the mixed
    table. `standins`: a folder of built stand-ins for the validator (default: built in a temporary
    folder); `tiny`: a tiny model of the same kind and the tiny stand-ins (smoke runs)."""
    import torch

    cached = realistic.cached_model(shape=realistic.TINY if tiny else None)
    described = _describe(cached)
    texts = realistic.chat_texts(n_texts)
    lengths = [len(ids) for ids in realistic.tokenizer()(texts, add_special_tokens=False)["input_ids"]]
    loads = shapes(n_texts, clients, multi_clients, multi_size, big)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the floor's process: one thread, as the servers have
    try:
        with tempfile.TemporaryDirectory() as tmp, own_home(Path(tmp) / "home"), \
                mock.patch.dict(os.environ, peer.thread_env(1)):
            root = Path(tmp)
            model_dir = Path(shutil.copytree(cached, root / "rm"))  # the run's own copy: a cleared cache cannot end it
            if standins is None:
                from rewardstack._standins import make_standins
                from tests.soak.tiny import make_tiny_standins

                standins = Path((make_tiny_standins if tiny else make_standins)(root / "standins")).parent
            lines = _throughput(root, model_dir, texts, loads, rounds)
            lines += [""] + _mixed(root, model_dir, standins.resolve(), texts, flood_clients, flood_size, steps)
    finally:
        torch.set_num_threads(threads)
    head = [f"trainer routes on a realistic reward model ({described}): rewardstack serve against "
            f"OpenRLHF's serve_rm.py ({peer.SOURCE_COMMIT[:9]}, model loader replaced) and the floor; one torch "
            f"thread per process; {n_texts} chat texts, median {statistics.median(lengths):.0f} tokens, "
            f"{sum(n > realistic.MAX_LENGTH for n in lengths) / len(lengths):.0%} past {realistic.MAX_LENGTH}"]
    return head + lines


def _describe(model_dir: Path) -> str:
    import json

    c = json.loads((model_dir / "config.json").read_text())
    return (f"Llama, {c['num_hidden_layers']} layers, width {c['hidden_size']}, {c['num_attention_heads']} heads / "
            f"{c['num_key_value_heads']} kv, float32")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=512, help="chat texts (the big request takes the last 256)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--clients", type=int, default=64, help="one-sample clients")
    ap.add_argument("--multi", default="4x64", help="CLIENTSxSAMPLES of the multi-sample shape")
    ap.add_argument("--big", type=int, default=256, help="samples of the one-client request")
    ap.add_argument("--flood-clients", type=int, default=32)
    ap.add_argument("--flood-size", type=int, default=8, help="samples per flood request")
    ap.add_argument("--steps", type=int, default=20, help="validator steps, alone and under the flood")
    ap.add_argument("--standins", help="a folder of built stand-ins for the validator (default: built in a temporary folder)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model of the same kind and the tiny stand-ins (smoke runs)")
    args = ap.parse_args(argv)
    mc, ms = (int(x) for x in args.multi.split("x"))
    lines = measure(args.texts, args.rounds, clients=args.clients, multi_clients=mc, multi_size=ms, big=args.big,
                    flood_clients=args.flood_clients, flood_size=args.flood_size, steps=args.steps,
                    standins=Path(args.standins) if args.standins else None,
                    tiny=args.tiny)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
