"""A validator process on the drop-in: run in the validator's environment (validator_env.py) by the tests.

    python validator_driver.py URL NAMESPACE OUT.json [--real SRC] [--concurrent 2] [--rounds 2]

openvalidators' forward passes (ov_validator.py: its real forward.py from SRC, else the
transcription) over `OpenValidatorsStack.remote(Client(URL))`, `--concurrent` of them gathered
per round as `run.py` does. Each step body is announced on stderr (`sending N`) before it goes, for
a test that kills the service mid-step. OUT gets the bodies sent, in order, the wandb rows and
the warnings the validator logged. Imports neither rewardstack nor anything torch and httpx do not.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from rewardstack_client import Client, RetryPolicy
from rewardstack_client.openvalidators import OpenValidatorsStack

import ov_validator as ov

TEXTS = [". ".join(f"Sentence {i} of text {t} about topic {t * 3 + i}" for i in range(40)) + "." for t in range(8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("namespace")
    ap.add_argument("out", type=Path)
    ap.add_argument("--real", type=Path, default=None)
    ap.add_argument("--concurrent", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--step-pause", type=float, default=0.0, help="seconds to wait before sending each step")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")

    client = Client(args.url, namespace=args.namespace, retry=RetryPolicy(deadline_s=args.deadline, max_backoff_s=1.0))
    # The validator's own weights (openvalidators' --reward.*_weight flags), checked against the service.
    rs = OpenValidatorsStack.remote(client, weights=[0.0, 1.0, 0.0, 0.0, 0.0])
    sent: list[dict[str, Any]] = []
    score = rs._session.score

    def announce(body: dict[str, Any]) -> dict[str, Any]:
        time.sleep(args.step_pause)
        print(f"sending {len(sent) + 1}", file=sys.stderr, flush=True)
        event = score(body)
        sent.append({**body, "sequence": event["sequence"]})
        return event

    rs._session.score = announce
    module = ov.real_forward_module(args.real) if args.real else ov.transcription
    neuron = ov.FakeNeuron(rs, passes_data=TEXTS)
    ov.run_forwards(module, neuron, concurrent=args.concurrent, rounds=args.rounds)
    args.out.write_text(json.dumps({"sent": sent, "rows": ov.events_of(neuron), "warnings": ov.WARNINGS.lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
