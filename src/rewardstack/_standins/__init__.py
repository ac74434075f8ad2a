"""The stand-ins: small random models of every production family, for tests, benchmarks and `make-standins`.

Nothing here scores; the scorers (`rewardstack._scorers`) never import it. `families` writes each
family's checkpoint (DPO's GPT-2-style LM or the BTLM-like remote-code checkpoint whose code is
`rewardstack._planning.btlm`, the classifiers, Reciprocate, Dahoas, the judge, the MiniLM encoders),
all with the one tokenizer helper (`tokenizer.save_tokenizer`: the packaged MiniLM's BERT tokenizer).
`build.make_standins` writes them all and the config that loads them (the soak's tiny stack,
`tests/soak/tiny.py`, shrinks them through its `shrink` hook).
"""

from __future__ import annotations

from rewardstack._standins.build import make_standins
from rewardstack._standins.families import (make_btlm_checkpoint, make_btlm_standin, make_dahoas_standin,
                                            make_diversity_standin, make_dpo_standin, make_judge_standin,
                                            make_nsfw_standin, make_openassistant_standin,
                                            make_reciprocate_standin, make_relevance_standin)
from rewardstack._standins.tokenizer import save_tokenizer

__all__ = [
    "make_standins", "save_tokenizer", "make_dpo_standin", "make_btlm_checkpoint",
    "make_btlm_standin", "make_reciprocate_standin", "make_dahoas_standin", "make_judge_standin",
    "make_openassistant_standin", "make_nsfw_standin", "make_relevance_standin", "make_diversity_standin",
]
