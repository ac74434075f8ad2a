"""Start-up floor probe: the least work before a first score, in a fresh process.

`python -m bench.floor_start CONFIG NAME...` imports torch and transformers, loads every named
model of the stack config with its plain `from_pretrained` (tokenizer and weights, the class its
scorer uses), runs one short forward pass through each, and prints `FIRST_SCORE <seconds since the
interpreter started>`. No planning, no cost models, no state: what any program scoring with these
checkpoints must pay before its first score. `python -m bench` sets rewardstack's warm start-up
against it.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.first_score import process_started  # stdlib only: the probe imports nothing it does not need

# The auto class each scorer loads its checkpoint(s) with.
CLASSES = {
    "dpo_reward_model": "AutoModelForCausalLM",
    "rlhf_reward_model": "AutoModelForSequenceClassification",
    "reciprocate_reward_model": "AutoModelForSequenceClassification",
    "nsfw_filter": "AutoModelForSequenceClassification",
    "relevance_filter": "AutoModel",
    "diversity_reward_model": "AutoModel",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("names", nargs="+", help="the stack's model-backed scorers")
    args = ap.parse_args()
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from rewardstack.config import load_config

    cfg = load_config(args.config)
    seen: set[str] = set()  # diversity shares relevance's second checkpoint: loaded once
    for name in args.names:
        mc = cfg.models[name]
        for path in mc.paths or [mc.path]:
            if path in seen:
                continue
            seen.add(path)
            tok = transformers.AutoTokenizer.from_pretrained(path)
            model = getattr(transformers, CLASSES[name]).from_pretrained(path, dtype=torch.float32).eval()
            with torch.inference_mode():
                model(**tok(["a first input"], return_tensors="pt"))
    print(f"FIRST_SCORE {time.time() - process_started():.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
