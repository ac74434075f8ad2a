"""`rewardstack plan` prints no deprecation warnings (issue 34 #8).

Simulating DPO runs BTLM's remote code as published (rewardstack's transcription, 4.x style), which
reads `config.use_return_dict` and builds its output with `past_key_values=`: transformers 5 maps
both and logs "`use_return_dict` is deprecated" and "`past_key_values`/`cache_params` are
deprecated" once per process. An operator cannot act on either (the code is the hub's), and
rewardstack reads the outputs under both names, so they are silenced where they are logged.
"""

from __future__ import annotations

import logging

import pytest
import transformers.utils.logging  # noqa: F401 - gives logging.Logger its `warning_once`

from rewardstack._planning import simulate as S
from rewardstack.config import default_config
from rewardstack._quiet import silence_moot_warnings


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_simulating_btlm_logs_no_deprecation(monkeypatch: pytest.MonkeyPatch) -> None:
    # `warning_once` remembers what it said: forget, so an earlier test's warning cannot hide this one's.
    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]
    seen = _Records()
    library = logging.getLogger("transformers")  # its modules' records propagate here, after their filters
    library.addHandler(seen)
    monkeypatch.setattr(S, "_CACHE", {})
    monkeypatch.setattr(S, "_DISK", None)
    try:
        silence_moot_warnings()  # what every command does first (rewardstack.cli.main)
        S.simulate_peak("dpo_reward_model", 1, 24, config=default_config(), exact=False)
    finally:
        library.removeHandler(seen)
    assert not [m for m in seen.messages if "deprecated" in m], seen.messages
