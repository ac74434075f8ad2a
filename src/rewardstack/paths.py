"""Where rewardstack keeps files of its own when a command is not told: its home folder."""

from __future__ import annotations

import os
from pathlib import Path


def default_home() -> Path:
    """Where the demo keeps its stand-ins and state: $REWARDSTACK_HOME or ~/.cache/rewardstack."""
    return Path(os.environ.get("REWARDSTACK_HOME", Path.home() / ".cache" / "rewardstack"))
