"""Benchmark of what the same input, the same reward costs: MKL's strict mode and fixed-shape passes against neither.

Run: `.venv/bin/python -m bench.invariance [--rounds 3] [--texts 256]` (`--quick`: a tiny model and a
few texts, to prove the code runs; its figures mean nothing). One reward model of realistic
proportions (LlamaForSequenceClassification, 6 layers, hidden 384, intermediate 1536, 6 heads,
float32, the stand-ins' real BERT tokenizer) served by `rewardstack serve` four ways, all up at once:

- neither: `REWARDSTACK_MKL_STRICT=0` (MKL's default kernels) and `fixed_shapes = "off"`;
- strict mode: MKL_CBWR=AUTO,STRICT, `fixed_shapes = "off"`;
- fixed shapes: MKL's default kernels, `fixed_shapes = "on"` (rows per width measured at load);
- default: what an operator gets (strict mode, `fixed_shapes = "auto"`: on where the start-up check
  finds the bits move).

The same chat texts (100 to 500 tokens) in three trainer shapes: 64 concurrent one-sample clients,
4 clients of 64 samples, one client of 256. Rounds are interleaved (every server, every shape, the
order rotated each round); samples/s as the median and the best of the rounds, and each setting
against neither (goal: the default at most 5% slower).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from bench.common import own_home
from bench.service import ServerProcess

SETTINGS = {  # name -> (environment, fixed_shapes)
    "neither": ({"REWARDSTACK_MKL_STRICT": "0"}, "off"),
    "strict mode": ({"MKL_CBWR": "AUTO,STRICT"}, "off"),
    "fixed shapes": ({"REWARDSTACK_MKL_STRICT": "0"}, "on"),
    "default": ({}, "auto"),
}
SHAPES = {"64 x 1 sample": (64, 1), "4 x 64 samples": (4, 64), "1 x 256 samples": (1, 256)}
"""Trainer shapes: (concurrent clients, samples per request); every shape sends the same texts."""


def _build_model(folder: Path, seed: int = 0, *, layers: int = 6, hidden: int = 384, intermediate: int = 1536,
                 heads: int = 6) -> Path:
    """The realistic reward model, built from a config and saved with `save_pretrained`."""
    # TODO(merge): use bench.realistic.build_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rewardstack._standins.tokenizer import DECODER_INPUTS, save_random, save_tokenizer

    tok = save_tokenizer(folder, 512, input_names=DECODER_INPUTS)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=512, pad_token_id=tok.pad_token_id, num_labels=1)
    save_random(folder, LlamaForSequenceClassification, config, seed)
    return folder


def _chat_texts(n: int, seed: int = 0, *, words: tuple[int, int] = (80, 400)) -> list[str]:
    """`n` chat-shaped prompt+response texts of 100 to 500 BERT tokens."""
    # TODO(merge): use bench.realistic.chat_texts
    from rewardstack._replay.synthetic import _WORDS

    rng = random.Random(seed)
    vocab = list(_WORDS)
    out = []
    for _ in range(n):
        k = rng.randint(*words)
        q = " ".join(rng.choice(vocab) for _ in range(max(4, k // 5)))
        a = " ".join(rng.choice(vocab) for _ in range(k - k // 5))
        out.append(f"<|user|> {q}\n<|assistant|> {a}")
    return out


def _send(url: str, texts: list[str], clients: int, per_request: int) -> float:
    """Seconds for `clients` threads to score `texts` in requests of `per_request` samples."""
    import httpx

    requests = [texts[k:k + per_request] for k in range(0, len(texts), per_request)]

    def client(mine: list[list[str]]) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            for batch in mine:
                r = c.post("/get_reward", json={"query": batch})
                assert r.status_code == 200, r.text[:300]

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, [requests[c::clients] for c in range(clients)]))
    return time.perf_counter() - t


def _serve(root: Path, model: Path, name: str, env: dict[str, str], fixed: str) -> ServerProcess:
    tag = name.replace(" ", "-")
    config = root / f"{tag}.toml"
    config.write_text(f'device = "cpu"\nstate_dir = "{root / tag}"\n\n[rewards.rm]\npath = "{model}"\nfixed_shapes = "{fixed}"\n')
    with mock.patch.dict(os.environ):  # the server's own environment: the bench's import set MKL_CBWR here
        os.environ.pop("MKL_CBWR", None)
        os.environ.update(env)
        server = ServerProcess(config, root / f"{tag}.log")
    try:
        server.wait_ready(1200)
    except (RuntimeError, TimeoutError):
        server.stop()
        print((root / f"{tag}.log").read_text()[-3000:])
        raise
    return server


def measure(rounds: int = 3, n_texts: int = 256, *, quick: bool = False) -> list[str]:
    """The table, as printed lines."""
    import httpx

    shapes = {k: (min(c, n_texts), min(s, n_texts)) for k, (c, s) in SHAPES.items()}
    seconds: dict[tuple[str, str], list[float]] = {(s, h): [] for s in SETTINGS for h in shapes}
    with tempfile.TemporaryDirectory(prefix="bench-invariance-") as tmp, own_home(Path(tmp) / "home"):
        root = Path(tmp)
        sizes = dict(layers=1, hidden=64, intermediate=256, heads=2) if quick else {}
        model = _build_model(root / "model", **sizes)
        texts = _chat_texts(n_texts, words=(20, 60) if quick else (80, 400))
        servers: dict[str, ServerProcess] = {}
        try:
            for name, (env, fixed) in SETTINGS.items():  # the first tunes the pass size in the home, the rest read it
                servers[name] = _serve(root, model, name, env, fixed)
            checks = {name: httpx.get(s.url + "/health", timeout=30).json().get("same_input_same_score", {}).get("rm", {})
                      for name, s in servers.items()}
            for s in servers.values():  # warm-up: first calls, connections
                _send(s.url, texts[:8], 4, 2)
            order = list(SETTINGS)
            for r in range(rounds):
                for shape, (clients, per) in shapes.items():
                    for name in order[r % len(order):] + order[:r % len(order)]:
                        seconds[(name, shape)].append(_send(servers[name].url, texts, clients, per))
        finally:
            for s in servers.values():
                s.stop()
    return _table(seconds, shapes, checks, rounds, n_texts, quick)


def _table(seconds: dict[tuple[str, str], list[float]], shapes: dict[str, Any], checks: dict[str, Any],
           rounds: int, n_texts: int, quick: bool) -> list[str]:
    model = "tiny Llama (--quick: figures mean nothing)" if quick else "Llama 6 x 384, float32"
    lines = [f"the same input, the same reward: {model}, {n_texts} chat texts, {rounds} interleaved rounds; "
             "samples/s median (best), and against neither (median)"]
    lines.append(f"{'setting':<14}" + "".join(f"{h:>30}" for h in shapes))
    for name in SETTINGS:
        cells = []
        for shape in shapes:
            mine, base = seconds[(name, shape)], seconds[("neither", shape)]
            rate = n_texts / statistics.median(mine)
            cells.append(f"{rate:.1f} ({n_texts / min(mine):.1f}) {statistics.median(base) / statistics.median(mine):.2f}x")
        lines.append(f"{name:<14}" + "".join(f"{c:>30}" for c in cells))
    for name, c in checks.items():
        lines.append(f"  {name}: MKL strict mode {c.get('strict_blas')}, fixed shapes {c.get('fixed_shapes')}, "
                     f"rows per width {c.get('rows')}; check: {c.get('found')}")
    worst = min(statistics.median(seconds[("neither", h)]) / statistics.median(seconds[("default", h)]) for h in shapes)
    lines.append(f"TARGET default within 5% of neither on every shape: {worst:.2f}x {'met' if worst >= 0.95 else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=256, help="texts every shape sends")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few texts: proves the code runs")
    args = ap.parse_args(argv)
    print("\n".join(measure(args.rounds, args.texts, quick=args.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
