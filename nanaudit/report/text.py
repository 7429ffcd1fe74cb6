"""Small text helpers shared by renderers: sparklines and one-line summaries of a finding."""

from __future__ import annotations

import math

from nanaudit.report.model import (
    BadStepEntry,
    EarlyWarning,
    Finding,
    Report,
    SampleSearch,
    TensorStats,
    TimelineSummary,
)
from nanaudit.report.vocabulary import CompiledOutcome, ProducerKind

BARS = "▁▂▃▄▅▆▇█"


NO_VALUE = "·"


def sparkline(values: list, log: bool = False) -> str:
    """Bars for finite values, ✗ for non-finite ones, · for a step that has none (the second
    of two optimizers stepped after one backward heard no loss of its own: not a bad value);
    log scale for norms spanning decades."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return "".join(NO_VALUE if v is None else "✗" for v in values)
    scale = (lambda v: math.log10(max(abs(v), 1e-30))) if log else (lambda v: v)
    lo, hi = min(scale(v) for v in finite), max(scale(v) for v in finite)
    out = []
    for v in values:
        if v is None:
            out.append(NO_VALUE)
        elif not math.isfinite(v):
            out.append("✗")
        else:
            frac = 0.0 if hi == lo else (scale(v) - lo) / (hi - lo)
            out.append(BARS[min(len(BARS) - 1, int(frac * (len(BARS) - 1) + 0.5))])
    return "".join(out)


def headline(report: Report) -> str:
    if report.status == "clean":
        run = report.run     # `nanaudit run` of a script that trained in a process it started
        where = f" in {run.process}" if run is not None and run.process else ""
        return f"clean: {report.steps_run} step(s) audited{where}, every value finite"
    if report.status == "interrupted":
        return f"interrupted after {report.steps_run} step(s): partial report"
    if report.status == "error":
        error = report.error
        if error is None:
            return "error: unknown error"
        rank = f" on rank {error.rank}" if error.rank is not None else ""
        return f"error{rank}: {error.message}"
    f = report.finding
    if f is None:
        return f"non-finite value after {report.steps_run} step(s)"
    rank = f", rank {f.rank}" if f.rank is not None else ""
    what = "negative learning rate" if f.value == "negative" else f"non-finite {f.value}"
    return f"{what} at step {f.step} ({f.where}{rank}): {f.cause}"


def finding_facts(f: Finding) -> list[tuple[str, str]]:
    """The finding's facts as (label, text), in one order, for every renderer that lists them
    (console, Markdown, JUnit, HTML): the one place that decides what a fact is called (and
    module_label how the root module reads)."""
    module = module_label(f.module)
    batch = None
    if f.batch_index is not None:   # under gradient accumulation: which batch of the data
        micro = f" (micro-batch {f.micro_batch})" if f.micro_batch is not None else ""
        batch = f"{f.batch_index}{micro}"
    elif f.micro_batch is not None:  # `nanaudit run`: the data's index is the script's own
        batch = f"micro-batch {f.micro_batch}"
    mesh = describe_coordinate(f.mesh) if f.mesh else None
    facts = [("step", f.step), ("batch", batch), ("rank", f.rank), ("mesh", mesh),
             ("where", f.where),
             ("value", f.value),
             ("op", f.op), ("forward op", f.forward_op), ("module", module),
             ("tensor", f.tensor), ("element", element_label(f)),
             ("optimizer", f.optimizer), ("loss", f.loss_name),
             ("samples", rows_label(f.samples)), ("made by", producer_label(f)),
             ("cause", f.cause),
             ("compiled", compiled_fact(f))]
    return [(label, str(value)) for label, value in facts if value not in (None, "", [])]


# Rows shown before the rest are counted: a batch-level value names every row of the batch.
ROWS_SHOWN = 8


def rows_label(rows: list[int] | None) -> str | None:
    """`[3, 7]`; a long list as its first ROWS_SHOWN and how many in all (every row of a batch
    is bad when the value is a batch's): the JSON keeps them all."""
    if not rows:
        return None
    if len(rows) <= ROWS_SHOWN:
        return str(rows)
    return f"[{', '.join(map(str, rows[:ROWS_SHOWN]))}, ...] ({len(rows)} rows)"


def element_label(f: Finding) -> str | None:
    """`blocks.0.up.weight.grad[9, 0] (rank 3's shard [1, 0])`: a sharded tensor's bad element,
    by its global index, then its index in the origin rank's own shard."""
    e = f.element
    if e is None:
        return None
    who = f"rank {f.rank}'s shard" if f.rank is not None else "the shard"
    return (f"{e.tensor}[{', '.join(map(str, e.global_index))}] "
            f"({who} [{', '.join(map(str, e.local_index))}])")


def describe_coordinate(coordinate: dict) -> str:
    """`dp_replicate=1, dp_shard=0`: how every renderer writes a rank's mesh coordinate."""
    return ", ".join(f"{name}={index}" for name, index in coordinate.items())


def module_label(module: str | None) -> str | None:
    """A module's name as every renderer shows it: the root module ("") reads `(root)`; None
    (no module) stays None."""
    return None if module is None else (module or "(root)")


def search_summary(s: SampleSearch) -> str:
    """How the offending rows were searched, in one line (console, HTML)."""
    note = f" ({s.note})" if s.note else ""
    return (f"{s.replays} replay(s) over a batch of {s.batch_size}{note}"
            if s.batch_size is not None else s.note or "not run")


def producer_label(f: Finding) -> str | None:
    """What made an input finding's value, in a few words (None: not an input finding)."""
    p = f.producer
    if p is None:
        return None
    worker = f" in DataLoader worker {p.worker}" if p.worker is not None else ""
    labels: dict[str, str] = {
        ProducerKind.TORCH_OP: f"a torch op of the data code{worker}",
        ProducerKind.OUTSIDE_TORCH: f"outside torch (already non-finite when it reached torch)"
                                    f"{worker}"}
    label = labels.get(p.made_by, f"not localized{worker}")
    if p.sample_indices:
        label += f"; data set indices {p.sample_indices}"
    return label


def compiled_fact(f: Finding) -> str | None:
    """A torch.compile'd model's replays in a line: eager made it, only the compiled program
    makes it (and where), or neither."""
    c = f.compiled
    if c is None:
        return None
    if c.outcome == CompiledOutcome.EAGER:
        return f"replayed eagerly, which makes it too (backend {c.backend})"
    if c.outcome == CompiledOutcome.NOT_REPRODUCED:
        return f"finite replayed eagerly and compiled (backend {c.backend})"
    where = f", stage {c.stage}" if c.stage else ""
    node = f", node {c.node} in the {c.graph} graph" if c.node else ""
    random = ", random ops" if c.random_ops else ""
    return f"only the compiled program makes it (backend {c.backend}{where}{node}{random})"


def finding_message(f: Finding) -> str:
    """A one-paragraph message: what, where, why, and the fix (annotations, JUnit)."""
    where = f"{f.where} op {f.op}" if f.op else f.where
    if f.forward_op:
        where += f" (backward of {f.forward_op})"
    module = f" in module `{f.module}`" if f.module else ""
    samples = f" Samples: {f.samples}." if f.samples else ""
    if f.rank is not None:
        module += f" on rank {f.rank}"
    if f.mesh:
        module += f" ({describe_coordinate(f.mesh)})"
    tensor = f" Tensor: {f.tensor}." if f.tensor and not f.op else ""
    return (f"{f.value} created at step {f.step} by {where}{module}.{tensor}{samples} "
            f"Cause {f.cause}: {f.explanation}. Fix: {f.fix}")


def step_marks(timeline: list, warnings: list, finding: Finding | None) -> str:
    """One character per timeline step, aligned under the sparklines: ▲ the first step of a
    warning, s a step the GradScaler skipped, ✗ the finding's step (--keep-going: every bad
    step's)."""
    warned = {w.step for w in warnings}
    bad = finding.step if finding is not None else None
    marks = []
    for e in timeline:
        marked = e.step == bad or isinstance(e, BadStepEntry)
        marks.append("✗" if marked else "▲" if e.step in warned else
                     "s" if e.skipped else " ")
    return "".join(marks).rstrip()


def summary_line(summary: TimelineSummary) -> str:
    """One line for a long run's summarized steps (between the timeline's first and last ones):
    their range, the extremes of the loss and the gradient norm over them (a spike shows in
    the max), and the steps the GradScaler skipped."""
    buckets = summary.buckets
    parts = [f"steps {buckets[0].first_step}..{buckets[-1].last_step} summarized "
             f"({summary.steps} steps in {len(buckets)} buckets)"]
    for label, name in (("loss", "loss"), ("grad norm", "grad_norm")):
        ranges = [r for r in (getattr(b, name) for b in buckets) if r is not None]
        lows = [r.min for r in ranges if r.min is not None]
        highs = [r.max for r in ranges if r.max is not None]
        if lows and highs:
            parts.append(f"{label} {min(lows):.4g}..{max(highs):.4g}")
    skipped = sum(b.skipped for b in buckets)
    if skipped:
        parts.append(f"{skipped} skipped by the GradScaler")
    return ", ".join(parts)


def warning_line(w: EarlyWarning) -> str:
    began = f", growing since step {w.began}" if w.began < w.step else ""
    module = f" in {w.module}" if w.module else ""
    return f"step {w.step}{began}: {w.kind}{module}: {w.message}"


# What a statistics row says of a tensor whose memory was gone when it was read (no values).
RELEASED = "released"
RELEASED_WHY = "its memory was freed after the op read it (FSDP2's unsharded weights)"


def describe(stats: TensorStats) -> str:
    """One line, lovely-tensors style: `f32[16, 8] x∈[-2.0, 3.1] μ=0.12 nan=3 zeros=2`."""
    dims = ", ".join(str(d) for d in stats.shape)
    parts = [f"{stats.dtype}[{dims}]"]
    if stats.released:
        return f"{parts[0]} {RELEASED}: {RELEASED_WHY}"
    if stats.min is not None:
        parts.append(f"x∈[{stats.min:.4g}, {stats.max:.4g}]")
        parts.append(f"μ={stats.mean:.4g}")
    for label in ("nan", "posinf", "neginf", "zeros", "negatives"):
        count = getattr(stats, label)
        if count:
            parts.append(f"{label.replace('posinf', '+inf').replace('neginf', '-inf')}={count}")
    return " ".join(parts)


def sample_value(value: object, limit: int = 80) -> str:
    """A per-sample non-tensor entry (an id, a file name) as the user's code would write it
    (strings in double quotes, as batch paths are)."""
    import json
    text = json.dumps(value) if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
