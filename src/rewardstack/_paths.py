"""Where rewardstack keeps files of its own when a command is not told: one home folder.

Every default location derives from `home()` ($REWARDSTACK_HOME, else ~/.cache/rewardstack), so an
operator finds everything rewardstack wrote in one place and moves all of it with one variable:

    $REWARDSTACK_HOME/
      standins/                    `demo`'s stand-in models
      real/                        `bench/realmodels.py`'s checkpoints ($REWARDSTACK_REAL_CACHE overrides)
      plan-cache/                  `plan`'s simulated peaks, shared by every config (one file per shape)
      calibration/cache.json       fitted cost models keyed by checkpoint content, shared by every
                                   config, unless a config sets `[memory] calibration_file`
      <stem>-<hash>/               one folder per config file (`config_home`)
        state/                     the scoring state, unless the config states `state_dir`
        runs/                      run folders a command makes when not given --run-dir (soak, ...)

`<stem>-<hash>` is the config file's name without `.toml` and 8 hex digits of a digest of its
absolute path, so two `stack.toml` in different folders never share state, and moving a config
starts a fresh home (as its state belongs to the file, not to its name). A config built in code
(no file) uses `default/`. Each location is still overridable where it is used: `state_dir`
/ `--state-dir`, `[memory] calibration_file`, `--run-dir` / `[telemetry] run_dir`, `plan --no-cache`.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

HOME_ENV = "REWARDSTACK_HOME"


def home() -> Path:
    """$REWARDSTACK_HOME, else ~/.cache/rewardstack: the root of every default location."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rewardstack"


def config_home(config_source: str | os.PathLike[str] | None) -> Path:
    """`home()/<stem>-<8 hex of the absolute path>/` for a config file; `home()/default` for none."""
    if config_source is None:
        return home() / "default"
    p = Path(config_source).expanduser().resolve()
    digest = hashlib.sha256(str(p).encode("utf-8")).hexdigest()[:8]
    return home() / f"{p.stem}-{digest}"


def state_dir(config_source: str | os.PathLike[str] | None) -> Path:
    """The default scoring state folder of a config (used when the config states no `state_dir`)."""
    return config_home(config_source) / "state"


def calibration_file() -> Path:
    """The default calibration cache (fitted cost models), one for every config: its entries are
    keyed by what was measured (memory/calibration.py), not by the config."""
    return home() / "calibration" / "cache.json"


def new_run_dir(config_source: str | os.PathLike[str] | None, kind: str) -> Path:
    """A fresh `config_home(config)/runs/<kind>-<YYYYmmdd-HHMMSS>` path (not created): where a command
    makes its run folder when not given one."""
    return config_home(config_source) / "runs" / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


BARE_RUN_DIR = ""
"""What a bare `--run-dir` (no folder given) parses to: "make a new run folder in the home"."""


def run_dir_for(given: str | None, config_source: str | os.PathLike[str] | None, kind: str) -> str | None:
    """A command's run folder: `given` if named, a new folder under `config_home(config)/runs` for a bare
    `--run-dir` (BARE_RUN_DIR), None (no run folder) if the flag was not given."""
    if given is None:
        return None
    return str(new_run_dir(config_source, kind)) if given == BARE_RUN_DIR else given


def plan_cache() -> Path:
    """`plan`'s cache of simulated peaks: shared by every config (it is keyed by shape, not config)."""
    return home() / "plan-cache"


def standins() -> Path:
    """Where `demo` builds its stand-in models."""
    return home() / "standins"
