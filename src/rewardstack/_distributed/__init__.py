"""Beyond one GPU on Ray: re-score archives of runs on an actor pool, serve many validators.

- `rewardstack rescore` (`rescore.rescore`, `rescore.RescorePool`): one run = one unit of work,
  scored in order from fresh state by one worker actor; one parquet table per run.
- The Ray Serve deployment of the scoring service (`serve`): stateless replicas run the forward
  passes; each namespace's state lives in one named single-threaded actor that commits to shared
  storage.

Ray is an optional extra (`pip install 'rewardstack[ray]'`); importing this package does not import
it, and nothing outside this package imports Ray.
"""

from typing import TYPE_CHECKING

from rewardstack._lazy import lazy_names

if TYPE_CHECKING:  # pragma: no cover
    from rewardstack._distributed.runs import Run, discover_runs, read_run

__all__ = ["Run", "discover_runs", "read_run"]
# Loaded on first use: the command line imports `distributed.commands` for its parsers only.
__getattr__, __dir__ = lazy_names(__name__, {n: "rewardstack._distributed.runs" for n in __all__})
