"""MKL's strict reproducibility mode, asked for before torch's first matrix product in every process that scores.

torch's x86 wheels run float32 matrix products in MKL, which picks its kernel (and so the order of
its sums) by the product's shape: the rows a pass holds change a row's low bits. MKL's conditional
numerical reproducibility in strict mode (`MKL_CBWR=AUTO,STRICT`) is documented to fix the kernel
whatever the shape; MKL reads the variable at its first call and never again, so rewardstack sets it
when the package is imported (`rewardstack/__init__.py` calls `request_strict`), before any torch
work: the CLI, the service, a library user's `RewardStack`, and Ray workers (which import the
package to unpickle their actor class) all get it without the operator knowing.

- An operator's own `MKL_CBWR` is kept as it is.
- `REWARDSTACK_MKL_STRICT=0` leaves `MKL_CBWR` unset (MKL's default: each shape its fastest kernel).
- `mkl_mode()` reads the mode MKL is in (torch's MKL exports `mkl_serv_cbwr_get`); None where torch
  has no MKL (ARM, another BLAS). A process that ran a matrix product before importing rewardstack
  keeps MKL's default: `request_strict` then warns, and the scorers' start-up check
  (`_scorers/invariance.py`) finds what that costs in bits.

Strict mode is not enough on every CPU: on an AMD EPYC (AVX-512, torch 2.13, MKL 2024.2) a product's
first row still changes between 3 and 4 rows with it on, so the scorers' self-check decides whether
fixed-shape passes are needed (docs/TRAINERS.md has the figures).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import MutableMapping

log = logging.getLogger("rewardstack.reproducible")

ENV = "MKL_CBWR"
STRICT = "AUTO,STRICT"
SWITCH = "REWARDSTACK_MKL_STRICT"
"""Set to 0 (or false, off, no) to leave MKL_CBWR unset."""
_STRICT_BIT = 0x10000  # MKL_CBWR_STRICT in mkl_cbwr.h
_ALL = -1  # MKL_CBWR_ALL: the whole mode, branch and strict bit


def request_strict(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Put `MKL_CBWR=AUTO,STRICT` in the environment unless the operator set MKL_CBWR or turned it
    off (`REWARDSTACK_MKL_STRICT=0`); return the value in the environment now (None: unset).

    Warns when torch already ran MKL in this process: the mode is fixed at MKL's first call."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        return env[ENV]
    if env.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    env[ENV] = STRICT
    if environ is None and "torch" in sys.modules:  # the host imported torch first: it may have used MKL
        mode = mkl_mode()
        if mode is not None and not mode & _STRICT_BIT:
            log.warning("MKL ran before rewardstack was imported, so its strict reproducibility mode is off in "
                        "this process; import rewardstack before any torch work (or set MKL_CBWR=%s)", STRICT)
    return STRICT


def mkl_mode() -> int | None:
    """MKL's reproducibility mode in this process (`mkl_cbwr_get(MKL_CBWR_ALL)`; reading it fixes it
    from the environment if MKL has not run yet), or None where torch has no MKL."""
    import ctypes

    import torch

    if not torch.backends.mkl.is_available():
        return None
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        get = ctypes.CDLL(lib).mkl_serv_cbwr_get
    except (OSError, AttributeError):  # another platform's library name, or MKL linked without the symbol
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return int(get(_ALL))


def strict_state() -> str:
    """"on" (MKL runs in strict mode), "off", or "unavailable" (no MKL, or its mode cannot be read)."""
    mode = mkl_mode()
    if mode is None:
        return "unavailable"
    return "on" if mode & _STRICT_BIT else "off"
