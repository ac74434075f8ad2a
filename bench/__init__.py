"""rewardstack's benchmarks: `python -m bench` runs them all and writes bench/RESULTS.md.

Each module is also runnable alone (`python -m bench.encoders`, `bench.causal`, `bench.memory`, ...).
The literal per-completion references live with the tests (`tests/*_fixtures.py`), so the tests
and the benchmarks compare against the same transcriptions; this package puts tests/ on the path.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
