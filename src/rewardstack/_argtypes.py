"""Argument types the command-line parsers share (`type=` of `argparse.add_argument`)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0 (GPUs or CPUs per worker)."""
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
