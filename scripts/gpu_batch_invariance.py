"""What "the same input, the same score" holds to on a device: the trainer lane's scores of each input
alone against the same inputs batched with others, per dtype, through the stack's own scoring path.

docs/TRAINERS.md promises bit identity on CPU in float32 (tests/test_trainer_models.py pins it) and
says what to expect on a GPU; this measures it. Two HF sequence-classification reward models built
from configs with random weights and saved with `save_pretrained` (a Llama with a last-token head,
the shape OpenRLHF and verl train, and a DeBERTa-v2 with a pooler, the reward-bench case), each in
float32, float16 and bfloat16; 64 chat-shaped texts scored (a) one per pass, (b) all in one request,
(c) in 8 requests of 8 batched together in a shuffled order. Prints a table; `--deterministic` also
sets `torch.use_deterministic_algorithms(True)` (CUBLAS_WORKSPACE_CONFIG set before CUDA starts).

    python scripts/gpu_batch_invariance.py --device cuda [--deterministic]

Runs from the working tree (PYTHONPATH=src and tests/ for the small tokenizer), with the packages of
the card's image and the carried wheels (docs/GPU.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def build(kind: str, folder: Path, *, tiny: bool = False) -> Path:
    """A reward model of `kind` (llama or deberta) with random weights, saved in `folder` (`tiny`: a
    llama of 2 layers of 64, for the CPU rehearsal of scripts/gpu_card.py)."""
    import torch
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification, LlamaConfig, \
        LlamaForSequenceClassification

    from small_models import save_small_tokenizer

    save_small_tokenizer(folder, 512, token_types=False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(5)
    if kind == "llama":
        dims = ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2} if tiny else
                {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
                 "num_key_value_heads": 8})
        cfg = LlamaConfig(vocab_size=len(tok), **dims, max_position_embeddings=512,
                          pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                          num_labels=1)
        model = LlamaForSequenceClassification(cfg)
    else:
        cfg = DebertaV2Config(vocab_size=len(tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, max_position_embeddings=512, relative_attention=True,
                              position_buckets=256, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                              type_vocab_size=0, norm_rel_ebd="layer_norm", share_att_key=True,
                              max_relative_positions=-1, pad_token_id=tok.pad_token_id, num_labels=1)
        model = DebertaV2ForSequenceClassification(cfg)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def texts(n: int, seed: int) -> list[str]:
    """`n` chat-shaped texts of 5 to 300 words."""
    rng = random.Random(seed)
    words = ("the model reads a prompt and its response then scores how helpful honest and harmless "
             "the answer was given what the user asked for in this conversation").split()
    return [f"user: {' '.join(rng.choices(words, k=rng.randint(2, 20)))}\nassistant: "
            f"{' '.join(rng.choices(words, k=rng.randint(3, 280)))}\n" for _ in range(n)]


def measure(kind: str, model: Path, dtype: str, device: str, work: Path,
            options: dict[str, Any] | None = None) -> dict[str, float]:
    """Each input alone against in one request and in shuffled company: the largest difference.
    `options`: the `[rewards.rm.options]` table (scripts/gpu_card.py sets the fixed pass shapes)."""
    from rewardstack.config import load_config
    from rewardstack.stack import RewardStack

    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (options or {}).items())
    cfg = work / f"{kind}-{dtype}{'-' + '-'.join(map(str, options.values())) if options else ''}.toml"
    cfg.write_text(f'device = "{device}"\nstate_dir = "{work / "state"}"\n\n[rewards.rm]\npath = "{model}"\n'
                   f'dtype = "{dtype}"\nmax_length = 512\n' + (f"\n[rewards.rm.options]\n{table}" if table else ""),
                   encoding="utf-8")
    stack = RewardStack(load_config(cfg), load_state=False)
    scorer = stack.scorers["rewards.rm"]
    items = texts(64, seed=2)

    def score(groups: list[list[int]]) -> dict[int, float]:
        answers = scorer.score_groups([[(items[i], f"query[{k}]") for k, i in enumerate(g)] for g in groups])
        return {i: float(r.outcome.value) for g, reads in zip(groups, answers) for i, r in zip(g, reads)}

    t0 = time.perf_counter()
    alone = {i: score([[i]])[i] for i in range(len(items))}
    one = score([list(range(len(items)))])
    order = list(range(len(items)))
    random.Random(9).shuffle(order)
    mixed = score([order[k:k + 8] for k in range(0, len(order), 8)])
    seconds = time.perf_counter() - t0
    scale = max(abs(v) for v in alone.values()) or 1.0
    worst = lambda other: max(abs(other[i] - alone[i]) for i in alone)  # noqa: E731
    same = sum(one[i] == alone[i] and mixed[i] == alone[i] for i in alone)
    del stack
    return {"one": worst(one), "mixed": worst(mixed), "scale": scale, "identical": same, "n": len(items),
            "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    ap.add_argument("--kinds", default="llama,deberta")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    a = ap.parse_args()
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if a.deterministic:
        torch.use_deterministic_algorithms(True)
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"batch invariance on {where}, torch {torch.__version__}, deterministic algorithms {a.deterministic}")
    print(f"{'model':8} {'dtype':9} {'identical':>10} {'max |one request - alone|':>27} {'max |shuffled - alone|':>23} "
          f"{'relative':>9} {'s':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for kind in a.kinds.split(","):
            folder = build(kind, work / kind)
            for dtype in a.dtypes.split(","):
                r = measure(kind, folder, dtype, a.device, work)
                rel = max(r["one"], r["mixed"]) / r["scale"]
                print(f"{kind:8} {dtype:9} {r['identical']:>4}/{r['n']:<5} {r['one']:>27.3g} {r['mixed']:>23.3g} "
                      f"{rel:>9.2g} {r['seconds']:>6.1f}", flush=True)
    print("identical: inputs whose score equals, bit for bit, their score alone in both batchings; "
          "relative: the largest difference over the largest |score| alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
