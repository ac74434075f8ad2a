"""Benchmark of what the same input, the same reward costs: MKL's strict mode and fixed-shape passes against neither.

Run: `.venv/bin/python -m bench.invariance [--rounds 3] [--texts 256]` (`--quick`: a tiny model and a
few texts, to prove the code runs; its figures mean nothing). `--bits`: instead, how many texts keep
their alone bits in company, per head family (`family_model`), dtype and setting; counts, not
timings, valid on any machine (docs/TRAINERS.md's figures). One reward model of realistic
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


FAMILIES = ("deberta", "bert", "gpt2", "llama")
"""Reward-model head families: a pooler over the first token (DeBERTa-v2, BERT), a score over the last (GPT-2, Llama)."""


def family_model(folder: Path, family: str, *, hidden: int = 256, intermediate: int = 1024, layers: int = 2,
                 max_length: int = 256, seed: int = 5) -> Path:
    """A sequence-classification reward model (num_labels=1) of `family`, random weights, the stand-ins'
    BERT tokenizer, saved in `folder`; widths of realistic matrix products by default (the bits
    that move with a pass's rows need them: a 64-wide model hides what a 256-wide one shows)."""
    import transformers as tf

    from rewardstack._standins.tokenizer import BERT_INPUTS, DECODER_INPUTS, save_random, save_tokenizer

    encoder = family in ("deberta", "bert")
    tok = save_tokenizer(folder, max_length, input_names=BERT_INPUTS if encoder else DECODER_INPUTS)
    common: dict[str, Any] = dict(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id)
    heads = max(2, hidden // 64)
    if family == "deberta":
        config: Any = tf.DebertaV2Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                         num_attention_heads=heads, max_position_embeddings=max_length,
                                         relative_attention=True, position_buckets=64, pos_att_type=["p2c", "c2p"],
                                         type_vocab_size=0, **common)
        cls: Any = tf.DebertaV2ForSequenceClassification
    elif family == "bert":
        config = tf.BertConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                               num_attention_heads=heads, max_position_embeddings=max_length, **common)
        cls = tf.BertForSequenceClassification
    elif family == "gpt2":
        config = tf.GPT2Config(n_embd=hidden, n_inner=intermediate, n_layer=layers, n_head=heads,
                               n_positions=max_length, **common)
        cls = tf.GPT2ForSequenceClassification
    elif family == "llama":
        config = tf.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                                max_position_embeddings=max_length, **common)
        cls = tf.LlamaForSequenceClassification
    else:
        raise ValueError(f"family {family!r}: one of {FAMILIES}")
    save_random(folder, cls, config, seed)
    return folder


def _chat_texts(n: int, seed: int = 0, *, words: tuple[int, int] = (75, 355)) -> list[str]:
    """`n` chat-shaped prompt+response texts of `words` words (the family models' bit counts)."""
    from bench import realtexts

    rng = random.Random(seed)
    vocab = sorted({w for p in realtexts.passages() for w in p.split()})
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
        from bench import realistic

        model = realistic.build_model(root / "model", shape=realistic.TINY if quick else None)
        texts = realistic.chat_texts(n_texts)
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


def _kept_here(folder: Path, dtype: str, fixed: str, n_texts: int) -> dict[str, dict[str, Any]]:
    """In this process: each family's texts scored alone, then in requests of 1 to 17 (every text
    twice, shuffled) and in one request of all, batched as the service's lane batches them; how
    many kept their alone bits, and what the start-up check found."""
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack
    from rewardstack._service.batching import prepare_job, score_now

    config = folder / f"bits-{dtype}-{fixed}.toml"
    config.write_text(f'device = "cpu"\nstate_dir = "{folder / "state"}"\n' + "".join(
        f'\n[rewards.{f}]\npath = "{folder / f}"\ndtype = "{dtype}"\nfixed_shapes = "{fixed}"\n' for f in FAMILIES))
    stack = RewardStack(load_config(config), load_state=False)
    names = [f"rewards.{f}" for f in FAMILIES]
    texts = _chat_texts(n_texts, seed=53, words=(5, 150))

    def score(*groups: list[str]) -> list[dict[str, list[float]]]:
        jobs = [prepare_job(stack, g, [f"query[{i}]" for i in range(len(g))], names, time.monotonic() + 600)
                for g in groups]
        score_now(stack, jobs)
        return [j.future.result(timeout=0).scores for j in jobs]

    alone = [score([t])[0] for t in texts]
    rng = random.Random(53)
    requests: list[list[int]] = []
    for _ in range(2):
        order = rng.sample(range(n_texts), n_texts)
        while order:
            k = rng.randint(1, 17)
            requests, order = requests + [order[:k]], order[k:]
    answers = score(*[[texts[i] for i in req] for req in requests])
    one = score(texts)[0]
    out = {}
    for f, name in zip(FAMILIES, names):
        company = sum(got[name][k] == alone[i][name][0] for req, got in zip(requests, answers) for k, i in enumerate(req))
        check = stack.scorers[name].invariance
        out[f] = {"company": company, "of": 2 * n_texts, "one": sum(one[name][i] == alone[i][name][0] for i in range(n_texts)),
                  "fixed_shapes": check.fixed_shapes, "strict_blas": check.strict_blas}
    return out


def kept_bits(n_texts: int = 48, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> list[str]:
    """Bit-identical counts per head family, dtype and setting (a process each: MKL reads its mode once)."""
    import json
    import subprocess
    import sys

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-bits-") as tmp, own_home(Path(tmp) / "home"):
        root = Path(tmp)
        for f in FAMILIES:
            family_model(root / f, f)
        for name, (env, fixed) in SETTINGS.items():
            for dtype in dtypes:
                clean = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "REWARDSTACK_MKL_STRICT")}
                done = subprocess.run([sys.executable, "-m", "bench.invariance", "--bits-worker", str(root), dtype, fixed,
                                       str(n_texts)], env=clean | env, capture_output=True, text=True, check=True)
                rows.append((name, dtype, json.loads(done.stdout.strip().splitlines()[-1])))
    lines = [f"the same input, the same reward: bits kept per head family ({n_texts} chat texts, 2 layers x 256 wide), "
             "in requests of 1-17 (every text twice) / in one request"]
    lines.append(f"{'setting':<14}{'dtype':<10}" + "".join(f"{f:>22}" for f in FAMILIES))
    for name, dtype, got in rows:
        cells = [f"{g['company']}/{g['of']} {g['one']}/{n_texts}{' F' if g['fixed_shapes'] else ''}" for g in (got[f] for f in FAMILIES)]
        lines.append(f"{name:<14}{dtype:<10}" + "".join(f"{c:>22}" for c in cells))
    lines.append("F: fixed shapes on in that process (the start-up check's, or the setting's)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.invariance", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--texts", type=int, default=256, help="texts every shape sends")
    ap.add_argument("--quick", action="store_true", help="a tiny model and few texts: proves the code runs")
    ap.add_argument("--bits", action="store_true", help="instead: bits kept per head family, dtype and setting")
    ap.add_argument("--bits-worker", nargs=4, metavar=("FOLDER", "DTYPE", "FIXED", "TEXTS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.bits_worker:
        import json

        folder, dtype, fixed, n = args.bits_worker
        print(json.dumps(_kept_here(Path(folder), dtype, fixed, int(n))))
        return 0
    lines = kept_bits(12 if args.quick else 48, ("float32",) if args.quick else ("float32", "bfloat16")) if args.bits \
        else measure(args.rounds, args.texts, quick=args.quick)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
