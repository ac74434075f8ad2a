"""`python -m tests.soak`: the soak (tests/soak/soak.py; docs/REPLAY.md)."""

import sys

from tests.soak.soak import main

sys.exit(main())
