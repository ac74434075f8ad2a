"""Two limits tested at their edges, where a wrong comparison or constant shows (issue 31, item 10).

Tests that only ever met inputs far from a limit stayed green when the limit was broken on purpose:
a padded rectangle allowed 175% of its real tokens instead of 125% (`(1.0 + slack)` to
`(1.5 + slack)` in the planner), and a text of exactly `[input] max_chars` characters counted as
cut (`>` to `>=` in `stack._cut`). Each test here goes red under its break.
"""

from __future__ import annotations

import random
from pathlib import Path

from rewardstack.config import from_dict
from rewardstack._memory.costmodel import PADDING_SLACK, CostModel, padding_groups, plan_batches
from rewardstack.stack import RewardStack


def _waste_ok(group: list[int], lengths: list[int]) -> bool:
    """Whether the group's padded rectangle is at most (1 + PADDING_SLACK) x its real tokens."""
    real = [max(1, lengths[i]) for i in group]
    return len(real) * max(real) <= (1 + PADDING_SLACK) * sum(real)


def test_padding_groups_allow_exactly_a_quarter_of_padding() -> None:
    assert PADDING_SLACK == 0.25
    # 2 x 100 = 200 positions for 160 real tokens (200 = 1.25 x 160): at the limit, one group;
    # with 159 real tokens the rectangle passes it and the group splits.
    assert padding_groups([100, 60]) == [[1, 0]]
    assert padding_groups([100, 59]) == [[1], [0]]
    # Four inputs: 4 x 100 = 400 = 1.25 x 320 at the limit; one token fewer splits off the longest.
    assert padding_groups([100, 80, 70, 70]) == [[2, 3, 1, 0]]
    assert padding_groups([100, 80, 70, 69]) == [[3, 2, 1], [0]]


def test_planned_batches_never_pad_past_the_slack_and_close_no_earlier() -> None:
    rng = random.Random(31)
    cost = CostModel(b=1.0)  # never profiled: every shape admitted; the budget below never binds
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 40), rng.randint(1, 4000)]) for _ in range(rng.randint(1, 24))]
        for groups in (padding_groups(lengths),
                       plan_batches(lengths, cost, 1e18, slack=PADDING_SLACK)):
            assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
            assert all(_waste_ok(g, lengths) for g in groups), (lengths, groups)
            # Greedy: each group closed only because the next input would have passed the slack.
            for g, nxt in zip(groups, groups[1:]):
                assert not _waste_ok(g + nxt[:1], lengths), (lengths, groups)


def test_a_text_of_exactly_max_chars_is_read_whole(tmp_path: Path, fake_registry) -> None:  # noqa: ANN001
    cfg = from_dict({"device": "cpu", "state_dir": str(tmp_path / "state"), "input": {"max_chars": 1000}})
    stack = RewardStack(cfg, load_state=False)
    at, past = "a" * 999 + ".", "b" * 1000 + "."  # 1,000 and 1,001 characters
    result = stack.score_step({"name": "augment", "prompt": "p", "completions": [at, past]}, save=False)
    assert result.statuses == ["ok", "cut"]
    assert result.event["completions"] == [at, past[:1000]]
    # The prompt and the base prompt at the limit are read whole too.
    result = stack.score_step({"name": "augment", "prompt": "q" * 1000, "base_prompt": "r" * 1000,
                               "completions": ["x y", "z w"]}, save=False)
    assert result.statuses == ["ok", "ok"]
    result = stack.score_step({"name": "augment", "prompt": "q" * 1000, "base_prompt": "r" * 1001,
                               "completions": ["x y", "z w"]}, save=False)
    assert result.statuses == ["cut", "cut"]  # the masks read a cut base prompt
