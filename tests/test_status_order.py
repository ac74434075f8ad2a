"""One order of statuses, docs/SEMANTICS.md's: `Status.worst` against the order the document states.

The stack summarizes a completion over every scorer with it, and the scorers a value over its
windows or encoders (classifier, embedding); the order is read from the document, so a change to
either the code or the document without the other shows here.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from rewardstack._scorers.base import Status

SEMANTICS = Path(__file__).resolve().parents[1] / "docs" / "SEMANTICS.md"


def documented_order() -> list[str]:
    """Most severe first, as the Statuses section writes it (`failed` > `oom` > ...)."""
    text = " ".join(SEMANTICS.read_text().split())
    m = re.search(r"most severe over every active model \(([^)]*)\)", text)
    assert m, "docs/SEMANTICS.md no longer states the order of statuses"
    return re.findall(r"`(\w+)`", m.group(1))


def test_the_document_names_every_status_once() -> None:
    order = documented_order()
    statuses = {v for k, v in vars(Status).items() if k.isupper() and isinstance(v, str)}
    assert sorted(order) == sorted(statuses) and len(order) == len(set(order))


def test_worst_follows_the_documented_order_for_every_pair_and_set() -> None:
    order = documented_order()
    for a, b in itertools.combinations(order, 2):  # a is documented as more severe than b
        assert Status.worst([a, b]) == a and Status.worst([b, a]) == a, (a, b)
    for k in range(1, len(order) + 1):
        for subset in itertools.combinations(order, k):
            assert Status.worst(list(subset)) == min(subset, key=order.index), subset
    assert Status.worst([]) == Status.OK  # nothing to summarize: no scorer objected
