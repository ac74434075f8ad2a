# From https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
# file openrlhf/utils/__init__.py (git blob 5ffc14f59ec53ac5c704210a3ea41d48d0d0bf72), CHANGED: the
# import of .math_utils (answer grading for math rewards; it needs sympy and pylatexenc, and
# serve_rm.py never calls it) is left out. The diff: bench/peer_openrlhf/CHANGES.diff.
# ---
from .utils import get_strategy, get_tokenizer

__all__ = [
    "get_strategy",
    "get_tokenizer",
]
