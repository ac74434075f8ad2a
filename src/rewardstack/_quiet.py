"""Third-party warnings that rewardstack makes moot, silenced where they are logged.

Each entry is a warning a library prints although rewardstack has already dealt with its cause:

- transformers' "Token indices sequence length is longer than the specified maximum": the
  scorers tokenize whole texts on purpose and cut them to the model's bound themselves (a
  completion so cut is marked `truncated`), so no over-long sequence ever reaches a model;
- transformers' "... has generative capabilities, as `prepare_inputs_for_generation` is explicitly
  defined" (BTLM's remote code, once per class check: `plan` printed it five times): rewardstack
  never calls `generate`;
- transformers' "`use_return_dict` is deprecated" and "`past_key_values`/`cache_params` are
  deprecated": BTLM's remote code as published (and its stand-in, `_planning.btlm`) uses the 4.x
  names, which transformers 5 still maps; the operator cannot change the hub's code, and
  rewardstack reads the outputs under either name (`plan` printed both).

Only these exact messages are dropped; everything else a library logs still shows (and `-q`
quiets the rest: `quiet_libraries`).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator

MOOT: dict[str, tuple[str, ...]] = {
    "transformers.tokenization_utils_base": ("Token indices sequence length is longer than the specified maximum",),
    "transformers.modeling_utils": ("has generative capabilities, as `prepare_inputs_for_generation` is explicitly",),
    "transformers.configuration_utils": ("`use_return_dict` is deprecated",),
    "transformers.utils.generic": ("`past_key_values`/`cache_params` are deprecated",),
}
"""Logger name -> message fragments whose records are dropped."""


def _moot(record: logging.LogRecord) -> bool:
    """Whether a record may show: False for one whose message holds a fragment `MOOT` names for its logger."""
    return not any(f in record.getMessage() for f in MOOT.get(record.name, ()))


def silence_moot_warnings() -> None:
    """Install the filter on the loggers of `MOOT` (idempotent; costs no import of transformers)."""
    for name in MOOT:
        logger = logging.getLogger(name)
        if _moot not in logger.filters:
            logger.addFilter(_moot)


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' per-checkpoint "Loading weights" bars off inside (the stack loads as quietly
    from Python as from the CLI, which turns them off for good), the caller's setting after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def quiet_libraries() -> None:
    """`-q`: other libraries' warnings off (their errors stay), Python's `warnings` too."""
    logging.getLogger().setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # transformers logs through its own handler, not the root's
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    warnings.filterwarnings("ignore", module=r"(?!rewardstack)")
