"""`rewardstack replay`: score a recorded run from empty state and say what drove each model's peak.

    rewardstack replay LOG... --config C [--budget B] [--run-dir D] [--steps A:B] [--top K]
    rewardstack replay LOG... --config C --init-state

The run's steps (`readers.read_run`) are scored in order by a stack built from C with an empty
state in a temporary folder (the operator's state is never touched), each model's forward passes
measured per step (tracker peak on CPU, allocator peak on CUDA). The report ends with:

- per model, the top inputs behind its peak: the steps where its measured peak was highest, each
  named by its longest input (step position, completion index, length, first characters); ties
  (a bounded model peaks the same on every input past its bound) go to the longer input;
- for each, what the unbounded reference would have asked for (`replay.reference`: the full-size
  simulation of the reference's call at the input's untruncated token count, in the reference's
  dtype) beside what rewardstack used; when it cannot be told the figure is said to be
  unavailable and why, never extrapolated;
- with `--budget` (bytes or sizes such as 40GiB): whether the run fits that card (CPU: the simulated
  device of that size; CUDA: a hard cap through `torch.cuda.set_per_process_memory_fraction`), with
  the OOMs it hit, and each input whose status under the budget differs from the run without one
  (`changed_by_budget`: cut to fit, or lost to an OOM), so it says `fits` only when none did. A
  budget may cut an input further than the model's own bound (`truncated`) or lose it (`oom`);
  either changes its score, so "no OOM" is not "fits". The comparison is made per model and per
  completion against the same stack with its budget lifted, and only for the steps where the
  budgeted run gave some status other than `ok` or `failed` (the stateless forward pass alone: a
  status never depends on the state), so a run the budget did not touch costs nothing extra;
- where the log has the validator's per-model values, agreement: per model, how many raw values
  are within 1e-4 (relative, floor 1), the largest difference and the worst inputs.

A completion the recorded run cut stays `cut`. rewardstack reads each text up to `[input] max_chars`
characters; a completion past it is scored on that head with status `cut`, and its event keeps only
the head. Replayed, that head is no longer than the limit, so the stack would read it whole and call
it `ok` (or `truncated`), though the input it stands for was longer. The values are the same either
way; only the status would be wrong. So the readers keep, per model, the completions whose recorded
status was `cut` (`RunStep.cut`), and replay marks a replayed status that carries a score `cut`
again (`KeepCut`, in the unbudgeted pass of `changed_by_budget` too); a failure, an OOM or an error
on replay is kept, being what happened.

`--init-state` instead rebuilds the normalizer statistics (from the logged raw values where the log
has them, else by scoring), the blacklist (from the logged bests) and the diversity history (by
embedding), and writes them as the state in C's `state_dir`; it refuses to overwrite a state.

Exit codes (the command's, as `rewardstack._cli_errors` numbers them for every command): 0 every
record read and the run fits; 2 some records were skipped (each named), the others replayed; 3 the
run does not fit `--budget` (whatever was skipped); 1 an error, one line saying why: among them a
run of which no step could be read, and a `--steps` that selects none.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, MutableSequence, Sequence

import torch

from rewardstack.config import REWARD_MODELS, load_config
from rewardstack.errors import RewardStackError, StateError
from rewardstack._fileio import merge_json_section
from rewardstack._memory.manager import MemoryObserver
from rewardstack._memory.device import PeakWindow
from rewardstack._replay.readers import RunStep, read_run
from rewardstack._replay.reference import reference_need_of
from rewardstack._models import owner_of, spec
from rewardstack._paths import run_dir_for
from rewardstack._scorers.base import ScoreRequest, ScoreResult, Status
from rewardstack._state import ForwardResult, StateLock, StateStore
from rewardstack._stepobservers import StepObserver
from rewardstack.stack import RewardStack

AGREEMENT_TOL = 1e-4
HEAD_CHARS = 60
# `rewardstack._cli_errors`' codes (that module sits above this layer, so they are repeated here).
EXIT_OK = 0
EXIT_SKIPPED = 2
EXIT_DOES_NOT_FIT = 3


def parse_steps(text: str | None, n: int) -> range:
    """Positions selected by `A:B` (0-based, B excluded, either side may be empty) or `A` alone."""
    if not text:
        return range(n)
    try:
        if ":" in text:
            a, _, b = text.partition(":")
            return range(n)[slice(int(a) if a.strip() else None, int(b) if b.strip() else None)]
        i = int(text)
        return range(n)[i : i + 1]
    except ValueError:
        raise RewardStackError(f"--steps must be A:B, A: or :B with 0-based step positions, got {text!r}") from None


# -- measuring each model's peak per step ---------------------------------------------------------

class PeakProbe(MemoryObserver):
    """Subscribes to the stack's memory manager: the peak of every model run, kept per (step, model)."""

    def __init__(self, stack: Any) -> None:
        self.memory = stack.memory
        self.step = -1
        self.peaks: dict[int, dict[str, int]] = {}
        self.memory.subscribe(self)

    @contextmanager
    def run(self, name: str, lengths: Sequence[int]) -> Iterator[None]:
        owner = owner_of(name)
        tracker = self.memory.tracker
        peak = 0
        if tracker is not None:
            with tracker.window(f"replay:{name}") as w:
                yield
            peak = w.peak_increase
        elif self.memory.device.type == "cuda":  # nestable: the telemetry's per-batch windows keep this one
            with PeakWindow(self.memory.device, None) as pw:
                yield
            peak = pw.peak_increase or 0
        else:
            yield
        by_model = self.peaks.setdefault(self.step, {})
        by_model[owner] = max(by_model.get(owner, 0), int(peak))


def mark_cut(model_statuses: Mapping[str, MutableSequence[str]], cut: Mapping[str, Sequence[int]],
             statuses: MutableSequence[str] | None = None) -> None:
    """Mark `cut` (per model, completion indices) in `model_statuses` in place, and in the step's `statuses`.

    A step's status is the most severe of its models' (`Status.worst`): one still scored becomes
    `cut` when one of its models now says `cut`; a failure, OOM or error outranks it and stays.
    """
    for model, indices in cut.items():
        sts = model_statuses.get(model, [])
        for i in indices:
            if i < len(sts) and sts[i] in Status.SCORED:
                sts[i] = Status.CUT
                if statuses is not None and i < len(statuses) and statuses[i] in Status.SCORED:
                    statuses[i] = Status.CUT


class KeepCut(StepObserver):
    """Marks the current recorded step's cut completions `cut` in each replayed result; it runs
    first among the stack's observers, so the operator's line, the telemetry and the event (which
    holds the same lists) all see the marked statuses."""

    current: RunStep

    def step_scored(self, stack: Any, result: Any) -> None:
        mark_cut(result.model_statuses, self.current.cut, result.statuses)


# -- the report -----------------------------------------------------------------------------------

@dataclass
class TopInput:
    """One input behind a model's peak."""

    model: str
    step: int
    """0-based position of the step in the replayed run."""
    index: int
    """Completion index within the step."""
    chars: int
    head: str
    where: str
    used_bytes: int
    """The model's measured peak in that step (rewardstack's, under its plan)."""
    tokens: int | None = None
    """The input's untruncated token count with the model's tokenizer (None: no tokenizer)."""
    reference_bytes: int | None = None
    reference_largest_bytes: int | None = None
    reference_note: str = ""
    recorded_cut: bool = False
    """The recorded run read this input only up to its `max_chars` (`chars`): the rest is not in the log."""


@dataclass
class Agreement:
    """How closely replayed raw values agree with the validator's logged ones, for one model."""

    model: str
    compared: int = 0
    within: int = 0
    max_diff: float = 0.0
    worst: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ReplayReport:
    """Everything `replay` found."""

    steps: int = 0
    completions: dict[str, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=dict)
    top: dict[str, list[TopInput]] = field(default_factory=dict)
    budget_bytes: int | None = None
    ooms: list[dict[str, Any]] = field(default_factory=list)
    oom_completions: dict[str, int] = field(default_factory=dict)
    changed: list[dict[str, Any]] = field(default_factory=list)
    """Inputs the budget cut or whose status it changed (`changed_by_budget`)."""
    agreement: dict[str, Agreement] = field(default_factory=dict)
    read_errors: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """No completion lost to an OOM and none cut or changed by the budget (recovered OOMs still fit)."""
        return not self.oom_completions and not self.changed

    def verdict(self) -> str:
        """One line on whether the run fits the budget."""
        if self.budget_bytes is None:
            return "no --budget given: the run was replayed without a memory limit"
        size = _fmt_bytes(self.budget_bytes)
        recovered = sum(1 for o in self.ooms if o["action"] in ("split", "cpu_fallback"))
        if self.changed:
            lost = f"; completions lost to OOM: {sum(self.oom_completions.values())}" if self.oom_completions else ""
            return (f"does not fit {size} unchanged: {len(self.changed)} input(s) cut or changed status compared "
                    f"with the run without the budget ({len(self.ooms)} OOM(s){lost}): "
                    + "; ".join(f"step {c['step']}, completion {c['index']} ({c['chars']:,} chars), {c['model']}: "
                                f"{c['unbudgeted']} without the budget -> {c['budgeted']}" for c in self.changed[:5])
                    + (f"; and {len(self.changed) - 5} more" if len(self.changed) > 5 else ""))
        if not self.ooms:
            return f"fits {size}: no OOM, no input cut or changed"
        if self.fits:
            return f"fits {size}: {recovered} OOM(s) hit and recovered (split or host fallback), no completion lost"
        lost = ", ".join(f"{m} {n}" for m, n in sorted(self.oom_completions.items()))
        return f"does not fit {size}: {len(self.ooms)} OOM(s); completions reported 'oom': {lost}"

    def to_dict(self) -> dict[str, Any]:
        """The summary.json form: every field (three under their summary names), `fits` and the verdict."""
        names = {"peaks": "peak_bytes", "top": "top_inputs", "changed": "changed_by_budget"}
        return {**{names.get(k, k): v for k, v in asdict(self).items()}, "fits": self.fits, "verdict": self.verdict()}


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# -- replay ---------------------------------------------------------------------------------------

def top_inputs(stack: Any, steps: list[RunStep], peaks: dict[int, dict[str, int]], k: int,
               reference: bool = True) -> dict[str, list[TopInput]]:
    """Per model, the k inputs behind its highest measured peaks (one per step; ties: the longer input)."""
    out: dict[str, list[TopInput]] = {}
    models = sorted({m for by in peaks.values() for m in by})
    for model in models:
        ranked = []
        for pos, by in peaks.items():
            if model not in by or pos < 0:
                continue
            comps = steps[pos].step.completions
            live = [i for i, c in enumerate(comps) if c is not None]
            if not live:
                continue
            i = max(live, key=lambda j: (len(comps[j] or ""), -j))
            ranked.append((by[model], len(comps[i] or ""), -pos, pos, i))
        ranked.sort(reverse=True)
        tops = []
        for peak, chars, _, pos, i in ranked[:k]:
            text = steps[pos].step.completions[i] or ""
            head = text[:HEAD_CHARS] + ("..." if len(text) > HEAD_CHARS else "")
            t = TopInput(model, pos, i, chars, head, steps[pos].where, peak,
                         recorded_cut=i in steps[pos].cut.get(model, ()))
            if reference and (spec(model).reference_unbounded or not tops):
                # Every top input of the OpenAssistant model (the one whose unbounded reference
                # crashed validators); the first of each other model.
                t.tokens, t.reference_bytes, t.reference_largest_bytes, t.reference_note = reference_need_of(
                    stack.scorers.get(model), model, steps[pos].step, i)
            tops.append(t)
        out[model] = tops
    return out


def agreement(steps: list[RunStep], raws: list[dict[str, list[float]]], worst: int = 3) -> dict[str, Agreement]:
    """Per model logged by the validator: replayed raw values against the logged ones."""
    out: dict[str, Agreement] = {}
    for pos, (rs, raw) in enumerate(zip(steps, raws)):
        for model, logged in rs.logged.items():
            if model not in raw:
                continue
            a = out.setdefault(model, Agreement(model))
            for i, (x, y) in enumerate(zip(raw[model], logged)):
                if not (math.isfinite(x) and math.isfinite(y)):
                    continue
                d = abs(x - y)
                a.compared += 1
                a.within += d <= AGREEMENT_TOL * max(1.0, abs(y))
                a.max_diff = max(a.max_diff, d)
                a.worst.append({"step": pos, "index": i, "logged": y, "replayed": x, "diff": d})
                a.worst.sort(key=lambda w: -w["diff"])
                del a.worst[worst:]
    return out


def changed_by_budget(stack: Any, steps: Sequence[RunStep], budgeted: Sequence[Mapping[str, Sequence[str]]],
                      raws: Sequence[Mapping[str, Sequence[float]]]) -> list[dict[str, Any]]:
    """Inputs whose status differs between `budgeted` (per step: model -> statuses) and `stack`
    with its activation budget lifted. A scored input whose raw value (`raws`, the budgeted run's)
    moved past `AGREEMENT_TOL` (relative) counts too: cut further than the model's own bound, it is
    `truncated` (or `cut`) both ways. The budget is restored after."""
    todo = [pos for pos, sts in enumerate(budgeted) if any(s not in ("ok", "failed") for v in sts.values() for s in v)]
    if not todo:
        return []
    saved = stack.memory.budget_bytes
    out: list[dict[str, Any]] = []
    stack.memory.set_budget(None)
    try:
        for pos in todo:
            step = steps[pos].step
            free = stack.forward(step)
            mark_cut({m: r.statuses for m, r in free.results.items()}, steps[pos].cut)
            for model, sts in budgeted[pos].items():
                res = free.results.get(model)
                if res is None:
                    continue
                values = raws[pos].get(model)
                for i, (b, u) in enumerate(zip(sts, res.statuses)):
                    where = {"step": pos, "index": i, "model": model}
                    chars = len(step.completions[i] or "")
                    if str(b) != str(u):
                        out.append({**where, "unbudgeted": str(u), "budgeted": str(b), "chars": chars})
                    elif values is not None and str(b) in ("ok", "truncated", "cut"):
                        x, y = float(values[i]), float(res.scores[i])
                        if math.isfinite(x) and math.isfinite(y) and abs(x - y) > AGREEMENT_TOL * max(1.0, abs(y)):
                            out.append({**where, "unbudgeted": f"{u} {y:.6g}", "budgeted": f"{b} {x:.6g}",
                                        "chars": chars})
    finally:
        stack.memory.set_budget(saved)
    return out


def replay(stack: Any, steps: list[RunStep], *, top: int = 3, reference: bool = True,
           on_event: Callable[[dict[str, Any]], None] | None = None) -> ReplayReport:
    """Score `steps` in order on `stack` (whose state should be empty) and build the report."""
    report = ReplayReport(steps=len(steps), budget_bytes=stack.memory.budget_bytes)
    probe = PeakProbe(stack)
    keep_cut = KeepCut()
    stack.step_observers.insert(0, keep_cut)
    oom_start = stack.memory.ooms_total  # a total: oom_log is a bounded ring buffer
    statuses: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    raws: list[dict[str, list[float]]] = []
    model_statuses: list[dict[str, list[str]]] = []  # per step, for the budget's verdict
    try:
        for pos, rs in enumerate(steps):
            probe.step = pos
            keep_cut.current = rs
            result = stack.score_step(rs.step, save=False)
            raws.append(result.raw)
            model_statuses.append(result.model_statuses)
            statuses.update(result.statuses)
            lost.update(m for m, sts in result.model_statuses.items() for s in sts if s == "oom")
            if on_event is not None:
                on_event(result.event)
    finally:
        stack.memory.unsubscribe(probe)
        stack.step_observers.remove(keep_cut)
    report.completions = dict(statuses)
    report.oom_completions = dict(lost)
    new_ooms = stack.memory.ooms_total - oom_start
    report.ooms = [r.to_dict() for r in list(stack.memory.oom_log)[-new_ooms:]] if new_ooms else []
    for by in probe.peaks.values():
        for m, p in by.items():
            report.peaks[m] = max(report.peaks.get(m, 0), p)
    report.top = top_inputs(stack, steps, probe.peaks, top, reference)
    report.agreement = agreement(steps, raws)
    if report.budget_bytes is not None:  # what the budget cut or changed, against the run without it
        report.changed = changed_by_budget(stack, steps, model_statuses, raws)
    return report


def format_report(report: ReplayReport) -> str:
    """The report as text for a person."""
    rows = [f"replayed {report.steps} steps; completions by status: "
            + ", ".join(f"{k} {v}" for k, v in sorted(report.completions.items()))]
    for e in report.read_errors[:10]:
        rows.append(f"  skipped: {e}")
    if len(report.read_errors) > 10:
        rows.append(f"  ... and {len(report.read_errors) - 10} more skipped records")
    rows.append("")
    rows.append("top inputs behind each model's peak (step = 0-based position in the run):")
    for model, tops in report.top.items():
        rows.append(f"  {model}: peak {_fmt_bytes(report.peaks.get(model))}")
        for t in tops:
            rows.append(f"    step {t.step}, completion {t.index}: {t.chars} chars {t.head!r}  ({t.where})")
            if t.recorded_cut:
                rows.append(f"      cut at {t.chars} characters by the recorded run ([input] max_chars): "
                            "the rest was never read, and is not in the log")
            if t.reference_bytes is not None:
                rows.append(
                    f"      the unbounded reference would have needed {_fmt_bytes(t.reference_bytes)} "
                    f"(largest single allocation {_fmt_bytes(t.reference_largest_bytes)}, {t.reference_note}); "
                    f"rewardstack used {_fmt_bytes(t.used_bytes)}"
                )
            elif t.reference_note:
                rows.append(f"      reference need {t.reference_note}; rewardstack used {_fmt_bytes(t.used_bytes)}")
    rows.append("")
    rows.append(report.verdict())
    if report.budget_bytes is not None:
        over = [t for ts in report.top.values() for t in ts
                if t.reference_bytes is not None and t.reference_bytes > report.budget_bytes]
        for t in over[:5]:
            rows.append(f"  the unbounded reference would have run out of memory at step {t.step}, completion {t.index} "
                        f"({t.model}: {_fmt_bytes(t.reference_bytes)} > {_fmt_bytes(report.budget_bytes)})")
        for o in report.ooms[:10]:
            rows.append(f"  OOM {o['model']}: batch {o['batch']} x {o['length']} -> {o['action']}"
                        + (" (injected)" if o.get("injected") else ""))
    if report.agreement:
        rows.append("")
        rows.append(f"agreement with the validator's logged raw values (within {AGREEMENT_TOL:g} relative):")
        for m, a in report.agreement.items():
            rows.append(f"  {m}: {a.within}/{a.compared} within, largest difference {a.max_diff:.3g}")
            for w in a.worst[:3]:
                if w["diff"] > 0:
                    rows.append(f"    step {w['step']}, completion {w['index']}: logged {w['logged']:.6g}, "
                                f"replayed {w['replayed']:.6g}")
    else:
        rows.append("")
        rows.append("agreement: the log holds no per-model values")
    return "\n".join(rows)


def warm_start(stack: Any, steps: list[RunStep]) -> dict[str, int]:
    """Fold a recorded run into the stack's state: normalizers, blacklist, diversity history.

    Reward models whose raw values the log holds are not run: the logged values (failed calls
    excluded) update the normalizers. Others are scored. Diversity embeds each step's completions
    (its history needs vectors); the blacklist records the logged bests. Returns how many steps
    used logged values per model and how many were scored.
    """
    counts: dict[str, int] = {"logged": 0, "scored": 0}
    for rs in steps:
        step = rs.step
        base = step.base_prompt if step.base_prompt is not None else step.prompt
        results: dict[str, Any] = {}
        embeddings: dict[str, Any] = {}
        for name, scorer in stack.scorers.items():
            logged = rs.logged.get(name)
            if name in REWARD_MODELS and logged is not None:
                scores = [x if c is not None else math.nan for x, c in zip(logged, step.completions)]
                sts = [Status.FAILED if c is None else (Status.OK if math.isfinite(x) else Status.ERROR)
                       for x, c in zip(scores, step.completions)]
                results[name] = ScoreResult(scores, sts)
                counts["logged"] += 1
            elif name in REWARD_MODELS:
                results[name] = stack.run_scorer(name, ScoreRequest(step.prompt, step.completions, step.name))
                counts["scored"] += 1
            elif scorer.stateful:  # its stateless half (diversity's embeddings); the state folds it in
                part = stack.run_stateless_part(name, ScoreRequest(base, step.completions, step.name))
                if part is not None:
                    embeddings[name] = part
        stack.state.apply(ForwardResult(step, results, embeddings))
    return counts


def _init_state(cfg: Any, steps: list[RunStep]) -> None:
    """`replay --init-state`: write the run's state into the config's state_dir (refuses to overwrite)."""
    with StateLock(cfg.state_dir):
        if StateStore(cfg.state_dir).path.exists():
            raise StateError(f"{cfg.state_dir} already holds a state: --init-state never overwrites one; "
                             "move it away or set another state_dir")
        stack = RewardStack(cfg, load_state=False)
        counts = warm_start(stack, steps)
        stack.save_state()
    print(f"state written to {cfg.state_dir} from {len(steps)} steps "
          f"({counts['logged']} model-steps from logged values, {counts['scored']} scored)")
    for name in REWARD_MODELS:
        if name in stack.scorers:
            n = stack.normalizers[name]
            print(f"  {name}: count {n.count}, mean {n.mean:.6g}, var {n.var:.6g}")


def cmd_replay(args: argparse.Namespace) -> int:
    """The `replay` command."""
    from rewardstack._settings import parse_bytes

    run = read_run(args.logs)
    if not run.steps:  # an empty replay is no answer: say why, before any model loads
        raise RewardStackError(run.why_empty())
    selected = parse_steps(args.steps, len(run.steps))
    if not selected:
        raise RewardStackError(f"--steps {args.steps} selects none of the {len(run.steps)} steps read (0-based positions)")
    steps = [run.steps[i] for i in selected]
    cfg = load_config(args.config)
    kinds = ", ".join(sorted({k for _, k in run.files}))
    print(f"read {len(run.steps)} steps from {len(run.files)} file(s) ({kinds}); "
          f"{len(run.errors)} record(s) skipped; replaying {len(steps)}", file=sys.stderr)
    skipped = EXIT_SKIPPED if run.errors else EXIT_OK
    if args.init_state:
        _init_state(cfg, steps)
        return skipped
    budget = parse_bytes(args.budget, key="--budget") if args.budget else None
    with ExitStack() as ctx:
        # From empty state, in a folder of its own: the operator's state is never read or written.
        cfg.state_dir = ctx.enter_context(tempfile.TemporaryDirectory(prefix="rewardstack-replay-"))
        if budget is not None:
            cfg.memory_budget = budget
            dev = torch.device(cfg.device)
            if dev.type == "cuda":  # pragma: no cover - CUDA-only path
                total = torch.cuda.get_device_properties(dev).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
        stack = RewardStack(cfg, load_state=False)
        run_dir = run_dir_for(args.run_dir, args.config, "replay")  # a bare --run-dir: a new one in the home
        telemetry = None
        if run_dir is not None:
            from rewardstack._telemetry import open_telemetry

            telemetry = open_telemetry(stack, run_dir=run_dir)  # makes the folder
        report = replay(stack, steps, top=args.top, reference=not args.no_reference)
        if telemetry is not None:
            telemetry.close()
        report.read_errors = list(run.errors)
        if run_dir is not None:
            merge_json_section(Path(run_dir) / "summary.json", "replay", {
                **report.to_dict(), "logs": [str(p) for p, _ in run.files],
                "selected": [selected.start, selected.stop], "time": time.time()})
    print(format_report(report))
    return skipped if report.fits else EXIT_DOES_NOT_FIT

