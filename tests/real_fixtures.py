"""Shared helpers of the real-checkpoint tier (tests/test_real_*.py, marker `real`).

`real_models()` finds the checkpoints `scripts/fetch-real-models.sh` put in the cache. Where they are
missing, CI (`CI` set to true, as CI services do) fails with the reason; elsewhere the tests skip
with it, so a developer without the 1 GB of downloads still runs the rest of the suite.
"""

from __future__ import annotations

import os

import pytest

from bench import realmodels


def in_ci() -> bool:
    """Whether this run is CI's (the real tier must run there, never skip)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def real_models() -> realmodels.RealModels:
    """The fetched checkpoints; fails in CI and skips elsewhere when they are missing."""
    try:
        return realmodels.locate()
    except realmodels.RealModelsError as e:
        if in_ci():
            pytest.fail(f"real tier in CI: {e}", pytrace=False)
        pytest.skip(str(e))
