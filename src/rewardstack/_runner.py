"""Exactly-once scoring of a step file into an event file: the loop behind `rewardstack score`.

The output file is the record of what is done. Each event line carries `step_hash`, a hash of the
step it was scored from, and a step's event and its state change commit together:

1. the step is scored in memory (`RewardStack.score_step(save=False)`);
2. the state is saved atomically *with a journal* naming the output file, the number of events it
   holds once this commit is written, and the commit's event lines (`StateStore` section `journal`);
3. the lines are appended to the output and fsynced.

A kill between 2 and 3 leaves a state one commit ahead of its output; the next run finds the
journal and writes the missing lines (redo), so the event is neither lost nor scored twice. A kill
during 3 leaves a torn last line, which is dropped before the redo. On restart with the same
arguments the existing output's complete lines are checked against the input (count and each
step's hash, in order) and scoring resumes after the last committed step. One state directory
serves many input files over time: the resume point belongs to the output, never to a counter in
the state. `StateLock` keeps a second process out of the state directory meanwhile.

`--save-every N` groups N steps per commit (one state save, N lines): fewer saves, same guarantee.
Writing to stdout (`--output -`) cannot be resumed: the state is then saved every N steps without
a journal, as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

from rewardstack.errors import InputError, RewardStackError
from rewardstack.stack import RewardStack, Step, StepResult
from rewardstack._wire import check_completions

log = logging.getLogger("rewardstack.runner")

JOURNAL = "journal"
HASH_FIELD = "step_hash"


class OutputMismatchError(RewardStackError):
    """An existing output file was not written from this input (or not by this state directory)."""


def step_hash(step: Step) -> str:
    """A stable hash of everything that determines a step's event (16 hex digits of sha256).

    The hash is of `json.dumps(step.to_dict(), sort_keys=True, ensure_ascii=False,
    separators=(",", ":"))` in UTF-8 (surrogates passed), fed in pieces (`_fileio.canonical_chunks`)
    so that a 50 MB completion is not serialized and encoded whole, twice, beside the step.
    """
    from rewardstack._fileio import canonical_chunks

    h = hashlib.sha256()
    for piece in canonical_chunks(step.to_dict()):
        h.update(piece)
    return h.hexdigest()[:16]


@dataclass
class ScoreReport:
    """What one `score_file` call did."""

    scored: int = 0
    """Steps scored by this call."""
    resumed: int = 0
    """Steps already in the output when this call started (skipped after their hash matched)."""
    redone: int = 0
    """Event lines written from the state's journal (the state was ahead of the output)."""
    torn: bool = False
    """Whether a torn last line was dropped from the output."""
    errors: list[str] = field(default_factory=list)
    """One message per bad input line (line number and field)."""


def iter_steps(lines: Iterable[str | bytes], limits: Any = None) -> Iterator[tuple[int, Step | InputError]]:
    """(line number, Step or the InputError saying what is wrong) for each non-blank line.

    `limits` (an `InputSettings`) refuses a step with more completions than it allows.
    """
    from rewardstack._fileio import read_steps

    for number, obj in read_steps(lines):
        if isinstance(obj, InputError):
            yield number, obj
            continue
        try:
            step = Step.from_dict(obj, line=number)
            if limits is not None:
                check_completions(step, limits.max_completions, line=number)
            yield number, step
        except InputError as e:
            yield number, e


# -- the output file ------------------------------------------------------------------------------

def _read_lines(path: Path) -> tuple[list[str], int, bool]:
    """Complete lines of `path`, the byte offset after the last one, and whether a torn tail follows."""
    if not path.exists():
        return [], 0, False
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    # Split on "\n" only: an event may hold U+0085 or U+2028 raw, which str.splitlines would split.
    lines = [x + "\n" for x in data[:end].decode("utf-8").split("\n")[:-1]] if end else []
    return lines, end, end < len(data)


def _append(path: Path, lines: list[str]) -> None:
    """Append lines and make them durable before returning."""
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def _hash_of(line: str, where: str) -> str:
    try:
        event = json.loads(line)
    except json.JSONDecodeError as e:
        raise OutputMismatchError(f"{where}: not a JSON event ({e.msg}); the file was not written by `score`") from None
    h = event.get(HASH_FIELD) if isinstance(event, dict) else None
    if not isinstance(h, str):
        raise OutputMismatchError(
            f"{where}: an event without '{HASH_FIELD}' (written by an older rewardstack or another tool): "
            "it cannot be checked against the input; move the file away or choose another --output"
        )
    return h


def reconcile_output(path: Path, journal: dict[str, Any] | None, report: ScoreReport) -> list[str]:
    """Make `path` hold exactly the committed events and return their step hashes, in order.

    Drops a torn last line; when the state's journal names this file and the file lacks the
    journal's last commit (the state is one commit ahead), writes that commit's lines. Raises
    OutputMismatchError when file and journal cannot both be right.
    """
    lines, end, torn = _read_lines(path)
    if torn:
        log.warning("%s: dropping a torn last line (a run was killed while writing it)", path)
        with path.open("r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
        report.torn = True
    if journal and journal.get("output") == str(path.resolve()):
        committed = int(journal["committed"])
        pending = [str(x) for x in journal.get("pending", [])]
        first = committed - len(pending)  # events in the file before the journal's commit
        have = len(lines)
        if have > committed:
            raise OutputMismatchError(
                f"{path} holds {have} events but its state journal records {committed}: the state directory "
                "was replaced or restored from an older copy; use the state that wrote this file"
            )
        if have < first:
            raise OutputMismatchError(
                f"{path} holds {have} events but its state had committed {committed}: lines were removed "
                "from the file after they were written"
            )
        written = lines[first:]
        if written != pending[: len(written)]:
            raise OutputMismatchError(f"{path}: its last events differ from the ones the state committed")
        missing = pending[len(written):]
        if missing:
            log.warning("%s: the state is %d event(s) ahead of the file; writing them from its journal", path, len(missing))
            _append(path, missing)
            lines += missing
            report.redone += len(missing)
    return [_hash_of(line, f"{path}: line {i + 1}") for i, line in enumerate(lines)]


def settle_journal(journal: dict[str, Any] | None, out_path: Path | None, report: ScoreReport) -> None:
    """Before any other input is scored: deliver the last commit's lines to the output it names.

    The state's journal names the output of its last commit. When that is another file than
    `out_path` (None: stdout) and the file lacks the commit (a kill between the state save and
    the line), the lines are written there now, exactly as a resume of that output would; without
    this, a later resume of that output would score its step again into a state that already
    counts it. When the commit cannot be delivered (the file is gone or disagrees), this raises
    OutputMismatchError naming the output that must be resumed first.
    """
    if not journal or not journal.get("output"):
        return
    named = Path(str(journal["output"]))
    if out_path is not None and str(out_path.resolve()) == str(named):
        return  # our own output: reconcile_output handles it
    committed = int(journal.get("committed", 0))
    pending = list(journal.get("pending", []))
    lines, _, _ = _read_lines(named)
    if len(lines) >= committed:
        return  # the commit reached its output (a torn tail there is that output's own resume's business)
    first = committed - len(pending)
    if not named.exists() and first > 0:
        raise OutputMismatchError(
            f"the state's last commit ({len(pending)} event(s)) belongs to {named}, which no longer exists; "
            f"restore {named} and resume it (rewardstack score with --output {named}) before scoring another input"
        )
    try:
        reconcile_output(named, journal, report)
    except OutputMismatchError as e:
        raise OutputMismatchError(
            f"the state's last commit belongs to {named} and is not in it: resume that output first "
            f"(rewardstack score with --output {named}); {e}"
        ) from None
    log.warning("%s: wrote the state's last commit to it before scoring %s", named, out_path or "stdout")


# -- the loop -------------------------------------------------------------------------------------

def commit(stack: RewardStack, out_path: Path, committed: int, lines: list[str]) -> int:
    """Save the state with `lines` as its journal, then append them to the output. Returns the new count."""
    sections = stack.state.state_dict()
    sections[JOURNAL] = {"output": str(out_path.resolve()), "committed": committed + len(lines), "pending": lines}
    stack.store.save(sections)  # the commit point: the state and the events it covers, together
    _append(out_path, lines)
    return committed + len(lines)


def score_file(
    stack: RewardStack,
    in_path: str | Path,
    output: str | Path,
    *,
    save_every: int = 1,
    err: TextIO | None = None,
    on_result: Callable[[Step, StepResult], None] | None = None,
    progress: bool = True,
) -> ScoreReport:
    """Score every step of `in_path` not yet in `output`, exactly once, committing as described above.

    The caller holds the state directory's `StateLock`. `on_result` sees each newly scored step
    and its result (the event gets its `step_hash` before this call).
    """
    from rewardstack._fileio import event_line, is_blank, progress as _progress

    err = err if err is not None else sys.stderr
    in_path = Path(in_path)
    report = ScoreReport()
    to_stdout = str(output) == "-"
    out_path = Path(output)
    done: list[str] = []
    journal = stack.store.load().get(JOURNAL)  # as stored on disk: the stack keeps no journal in memory
    settle_journal(journal, None if to_stdout else out_path, report)
    if not to_stdout:
        done = reconcile_output(out_path, journal, report)
    # Binary: each line is decoded on its own, so bytes that are not UTF-8 are that line's error.
    with in_path.open("rb") as f:
        total = sum(1 for line in f if not is_blank(line))
    position = 0  # index of the next good step
    committed = len(done)
    pending: list[str] = []
    with in_path.open("rb") as f, _progress(total if progress else 0, "scoring") as bar:
        for number, step in iter_steps(f, stack.config.input):
            bar.update(1)
            if isinstance(step, InputError):
                report.errors.append(str(step))
                print(f"{in_path}: {step}", file=err)
                continue
            h = step_hash(step)
            if position < len(done):
                if done[position] != h:
                    raise OutputMismatchError(
                        f"{out_path}: event {position + 1} was scored from another step than {in_path} line "
                        f"{number}; this output belongs to another input: choose another --output"
                    )
                position += 1
                report.resumed += 1
                continue
            result = stack.score_step(step, save=False)
            result.event[HASH_FIELD] = h
            if on_result is not None:
                on_result(step, result)
            line = event_line(result.event)
            position += 1
            report.scored += 1
            if to_stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if report.scored % save_every == 0:
                    stack.save_state()
                continue
            pending.append(line)
            if len(pending) >= save_every:
                committed = commit(stack, out_path, committed, pending)
                pending = []
    if pending:
        committed = commit(stack, out_path, committed, pending)
    if to_stdout and report.scored % save_every:
        stack.save_state()
    if position < len(done):
        raise OutputMismatchError(
            f"{out_path} holds {len(done)} events but {in_path} has only {position} valid steps: "
            "this output belongs to another input"
        )
    if not to_stdout and not out_path.exists():
        out_path.touch()  # an input without valid steps still leaves its (empty) record
    return report


def run_score(args: Any) -> int:
    """`rewardstack score` (its parsed flags): lock the state directory, build the stack with its
    telemetry, score, report. Returns the exit code.

    `--device-memory` overrides `[memory] device_memory`; `--recalibrate` profiles every model again;
    `--max-chars` and `--max-completions` override the `[input]` limits.
    """
    from rewardstack.config import load_config
    from rewardstack._memory.manager import check_device
    from rewardstack._state import StateLock
    from rewardstack._telemetry import open_telemetry

    cfg = load_config(args.config)
    if args.device_memory is not None:
        cfg.memory.device_memory = args.device_memory
    if args.max_chars is not None:
        cfg.input.max_chars = args.max_chars
    if args.max_completions is not None:
        cfg.input.max_completions = args.max_completions
    check_device(cfg.device)  # before the state folder and its lock are made for a stack that cannot run
    with StateLock(cfg.state_dir):
        stack = RewardStack(cfg, recalibrate=args.recalibrate)
        closer = open_telemetry(stack, run_dir=args.run_dir, metrics_port=args.metrics_port)  # None: off
        try:
            report = score_file(stack, args.input, args.output, save_every=args.save_every)
        finally:
            if closer is not None:
                closer.close()
    parts = [f"scored {report.scored} steps", f"{len(report.errors)} bad lines"]
    if report.resumed:
        parts.append(f"{report.resumed} already in {args.output} (resumed after them: not scored again)")
    if report.redone:
        parts.append(f"{report.redone} written from the state's journal")
    print(", ".join(parts), file=sys.stderr)
    return 2 if report.errors else 0  # 2: some input lines were bad (the good ones are scored)
