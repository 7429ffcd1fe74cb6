"""The report data model: what every renderer reads, and the JSON contract (schema version 1).

Glossary:
  step      the 0-based optimizer step (with `step:`, one call of the user's step); the batch
            is named by `batch_index` (its index in the data) and, with accumulation,
            `micro_batch` (its place in the window)
  batch     the tree of tensors the data yields for one step
  sample    one row of the batch along its batch dimension
  where     the phase that made the value: input, parameter, forward, backward, optimizer
  op        the aten op that *created* the non-finite value (not one that passed it on)
  module    the qualified name of the innermost nn.Module running the op ("" for the root)

The report's sections beyond the finding and the timeline are in sections.py. Every section is a
dataclass whose fields are its JSON keys, in JSON order. A key that is in the JSON only sometimes is
declared on its class: OMIT_WHEN_NONE (left out while None) and OMIT_EMPTY (left out while empty). A
section with several shapes (the error, bisect's two modes) is one class per shape, so that each
keeps the keys and key order schema version 1 gave it; the shapes of one section share the fields
their readers use. Closed vocabularies are `str` enums (vocabulary.py); names that come from the
user's code or the system (exception classes, files, hosts, backends, precisions) are plain text.

A run that keeps going past bad steps (--keep-going) adds, within schema version 1, `findings`
(after `finding`, which stays its first) and the `bad_steps` section; each of its findings
says what became of its step (`action`, `stop_reason`). A run without --keep-going has neither:
its report keeps exactly the shape it had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from nanaudit.report.sections import (
    BadSteps,
    CheckpointBisect,
    CompiledReplay,
    DataBisect,
    DistributedRun,
    ErrorInfo,
    ScriptRun,
    SentinelRead,
    ShardElement,
)
from nanaudit.report.vocabulary import BadStepAction, Cause, Status, StopReason, Where

REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor (an op input, a batch leaf): enough to see why an op failed."""

    OMIT_EMPTY = ("released",)    # in the JSON only when true
    name: str
    shape: tuple
    dtype: str
    numel: int
    min: float | None
    max: float | None
    mean: float | None
    nan: int | None
    posinf: int | None
    neginf: int | None
    zeros: int | None
    negatives: int | None
    value: Any = None             # the values themselves, when the tensor is tiny
    released: bool = False        # memory gone when read (FSDP2's freed weights): no counts


@dataclass(frozen=True)
class SourceLine:
    file: str
    line: int
    code: str
    function: str = ""


@dataclass(frozen=True)
class SampleRow:
    """One offending batch row, shown in the report: values when small, statistics when large,
    and its entries of the batch's per-sample non-tensor leaves (ids, file names)."""

    index: int
    leaves: tuple = ()            # ((path, TensorStats), ...)
    values: tuple = ()            # ((path, value), ...): `batch["ids"]` -> "clip_0042.wav"

    OMIT_EMPTY = ("values",)      # in the JSON only when the batch has such leaves


@dataclass(frozen=True)
class SampleSearch:
    """How the offending rows were found: replays spent over a batch of `batch_size`."""

    batch_size: int | None
    replays: int
    coupled: bool              # no row reproduces alone; rows do together
    note: str = ""


@dataclass(frozen=True)
class ChainLink:
    """One hop from the op that created the value to the one that reached the sentinel."""

    op: str
    where: Where
    module: str | None
    value: list                # the non-finite kinds the op's output held
    line: int | None
    # What it received: each input by its schema name and its non-finite kinds ("self: nan").
    received: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class EarlyWarning:
    """A sign of trouble before any non-finite value: seen at `step`, growing since `began`."""

    kind: str                             # a WarningKind
    step: int
    began: int
    message: str
    module: str | None = None
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class InputProducer:
    """Where the non-finite value of an input finding was made, upstream of the model: by a
    torch op of the user's data code (then the finding's op, line, inputs and cause are that
    op's), outside torch (already non-finite when it reached torch), or not localized, and
    why. `traced` says what code nanaudit traced to find it."""

    made_by: str                          # a ProducerKind
    traced: str = ""
    worker: int | None = None             # the DataLoader worker process that made the batch
    sample_indices: list | None = None    # the data set's indices of the offending rows
    sample_ids: list | None = None        # ... and their ids, where the batch carries them
    note: str = ""


@dataclass
class Finding:
    """The first non-finite value of a run and what made it: the `step` and (with
    `batch_index`, `micro_batch`) the batch, the `samples` (rows) that carry it, the `rank`,
    `where` it was made, the `op` that created it (and its `forward_op` for a backward op) in
    `module` at the user's `source` line, that op's `inputs` statistics, the `chain` of ops
    that carried it to the check that tripped, the `cause` (an id of the cause catalogue), the
    `explanation` (clauses joined by `explain`) and the `fix`. `reproduced` says whether a
    replay made the value again (None: none was needed)."""

    step: int
    where: Where
    value: str                    # "nan" | "inf" | "-inf"
    cause: Cause
    explanation: str
    fix: str
    tensor: str | None = None
    op: str | None = None
    forward_op: str | None = None
    module: str | None = None
    source: SourceLine | None = None
    samples: list | None = None
    inputs: list = field(default_factory=list)        # [TensorStats] of the creating op
    forward_inputs: list = field(default_factory=list)  # backward findings: the forward op's
    reproduced: bool | None = None                    # None: no replay was needed
    sample_rows: list = field(default_factory=list)   # [SampleRow]
    sample_search: SampleSearch | None = None
    chain: list = field(default_factory=list)         # [ChainLink], creator first
    rank: int | None = None
    tensors: list = field(default_factory=list)       # every parameter / batch path involved
    first_warning: EarlyWarning | None = None         # the earliest warning before the finding
    batch_index: int | None = None    # the data's index of the offending (micro-)batch
    micro_batch: int | None = None    # ... its position in the accumulation window (0-based)
    optimizer: str | None = None      # several optimizers / `step:`: the one whose check tripped
    loss_name: str | None = None      # `step:` returning named losses: the one that tripped
    producer: InputProducer | None = None  # input findings: where the batch's value was made
    compiled: CompiledReplay | None = None   # a torch.compile'd model: what its replays came to
    mesh: dict | None = None          # a device mesh: the origin rank's coordinate {"dp": 1, ...}
    placements: dict | None = None    # ... and the DTensor placement of each sharded `tensors`
    element: ShardElement | None = None   # ... a bad element of one, by local and global index
    localized_by: str | None = None   # `nanaudit run`: "in-process" | "re-run", which named the op
    action: BadStepAction | None = None      # --keep-going: the step's update skipped or not
    stop_reason: StopReason | None = None    # ... and why the run stopped at it

    # Added within schema version 1: absent wherever a finding is, while unset.
    OMIT_WHEN_NONE = ("producer", "compiled", "mesh", "placements", "element", "localized_by",
                      "action", "stop_reason")
    # Added within schema version 1: left out of the report's own `finding` while unset, so
    # reports of runs that do not use them keep their exact shape. bisect's `bad_batches`
    # shipped with them as null and keeps them (report_to_dict applies this to `finding` only).
    OMIT_WHEN_NONE_AS_FINDING = ("optimizer", "loss_name")

    def explain(self, clause: str) -> None:
        """Add a clause to the explanation: the one place clauses are joined ("; ")."""
        self.explanation = f"{self.explanation}; {clause}" if self.explanation else clause

    def qualify(self, note: str) -> None:
        """Add a parenthetical note to the explanation's last clause."""
        self.explanation = f"{self.explanation} ({note})"


@dataclass
class TimelineEntry:
    """One audited step. Under a GradScaler, grad_norm is of the unscaled gradients."""

    step: int
    loss: float | None
    grad_norm: float | None
    param_norm: float | None
    lr: float | None
    time_ms: float
    scale: float | None = None            # the loss scale this step ran with (GradScaler)
    skipped: bool = False                 # the update was skipped (a GradScaler, DeepSpeed)
    update_ratio: float | None = None     # |update| / |weights|, on sampled steps
    act_max: float | None = None          # the largest |module output|, on sampled steps
    act_ratio: float | None = None        # ... as a fraction of its dtype's largest value


@dataclass
class BadStepEntry(TimelineEntry):
    """--keep-going: the timeline entry of a bad step, marked with what became of its update
    (one more key, `bad`, after the others; added within schema version 1)."""

    bad: BadStepAction = BadStepAction.SKIPPED


@dataclass(frozen=True)
class SeriesRange:
    """One series of a TimelineBucket (`loss`, `grad_norm`, ...): its smallest, largest and last
    value over the bucket's steps. NaN is left out of `min` and `max` (a skipped step's NaN
    gradient norm is counted in the bucket's `skipped`); +-inf is not. `last` is the value of
    the bucket's latest step that had one."""

    min: float | None
    max: float | None
    last: float | None


@dataclass(frozen=True)
class TimelineBucket:
    """Consecutive audited steps `first_step`..`last_step` of a long run's middle, summarized:
    `count` steps (timeline entries), `skipped` of them skipped by the GradScaler, and each of
    TimelineEntry's number series as a SeriesRange (None: no step of the bucket had a value).
    A spike is never lost: it is its bucket's `max` (a dip its `min`)."""

    first_step: int
    last_step: int
    count: int
    skipped: int
    loss: SeriesRange | None
    grad_norm: SeriesRange | None
    param_norm: SeriesRange | None
    lr: SeriesRange | None
    time_ms: SeriesRange | None
    scale: SeriesRange | None
    update_ratio: SeriesRange | None
    act_max: SeriesRange | None
    act_ratio: SeriesRange | None


@dataclass(frozen=True)
class TimelineSummary:
    """The middle of a timeline too long to keep whole (the `timeline_summary` section, present
    only then). The report's `timeline` keeps its first `head` steps and its last `tail` steps
    (those before the finding) at full resolution; the `steps` audited between them are the
    `buckets`, in step order, each a run of consecutive steps (all of one width, the last
    perhaps narrower). Early warnings are never summarized: all are in `warnings`."""

    steps: int                    # audited steps the buckets cover (in no timeline entry)
    head: int                     # entries kept from the start of the run
    tail: int                     # entries kept before its end
    buckets: list = field(default_factory=list)       # [TimelineBucket]

    def runs(self, timeline: list) -> list[list]:
        """The timeline's entries in runs of consecutive kept steps: the first steps and the
        last ones, with the summarized middle between them (a line must not cross it)."""
        if not self.buckets:
            return [timeline]
        gap = self.buckets[0].first_step
        return [[e for e in timeline if e.step < gap], [e for e in timeline if e.step > gap]]

    def ranges(self, name: str) -> list[tuple[TimelineBucket, float, float, float | None]]:
        """(bucket, min, max, last) of series `name` in each bucket where its min and max are
        finite."""
        out = []
        for bucket in self.buckets:
            r = getattr(bucket, name)
            if (r is not None and r.min is not None and r.max is not None
                    and math.isfinite(r.min) and math.isfinite(r.max)):
                out.append((bucket, r.min, r.max, r.last))
        return out


@dataclass
class Report:
    """Everything one command found: how it ended (`status`), the `finding`, the `timeline` of
    audited steps and the early `warnings`, the `error` that stopped it, and the sections of
    the commands that have them (the repro bundle, bisect's bad batches or checkpoints, each
    rank's status under torchrun, `nanaudit run`'s first run and re-run). Every renderer reads
    this; `report_to_dict` is its JSON contract."""

    tool_version: str
    config: dict
    torch_version: str
    device: str
    status: Status
    steps_run: int
    command: str = "scan"
    finding: Finding | None = None
    timeline: list = field(default_factory=list)      # [TimelineEntry] (long runs: see below)
    warnings: list = field(default_factory=list)      # [EarlyWarning], in step order
    error: ErrorInfo | None = None
    duration_s: float = 0.0
    # Named sections, each in the JSON only when set (schema version 1, in this order):
    sentinel_read: SentinelRead | None = None     # scan: the read mode (sync or deferred) and why
    repro: str | None = None              # the repro bundle's folder
    repro_error: str | None = None        # ... or why it could not be written ("repro": null)
    bisect: DataBisect | CheckpointBisect | None = None   # bisect: the bad batches or checkpoints
    distributed: DistributedRun | None = None     # torchrun: every rank's status
    run: ScriptRun | None = None          # `nanaudit run`: the first run and the re-run
    # A long run: `timeline` holds its first and last steps, this summarizes the steps between.
    timeline_summary: TimelineSummary | None = None
    # --keep-going: every bad step's finding in step order (the first `bad_steps.whole`;
    # `finding` is the first of them) and the section that counts and summarizes them all.
    findings: list = field(default_factory=list)      # [Finding]
    bad_steps: BadSteps | None = None
    # ... and every bad step's entry of the --skip-list file, past the findings kept whole
    # too ([SkipEntry]; not in the JSON, which stays bounded).
    skip_list: list = field(default_factory=list)

    SECTIONS = ("sentinel_read", "repro", "bisect", "distributed", "run", "timeline_summary",
                "bad_steps")


def json_number(x: Any) -> Any:
    """Floats as JSON allows them: non-finite values become the strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
    return x


def jsonable(obj: Any) -> Any:
    """Plain JSON values of a report or any part of it, each dataclass's keys in field order."""
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, float):
        return json_number(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        empty, none = getattr(obj, "OMIT_EMPTY", ()), getattr(obj, "OMIT_WHEN_NONE", ())
        body = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if not ((f.name in empty and not value) or (f.name in none and value is None)):
                body[f.name] = jsonable(value)
        return body
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def report_to_dict(report: Report) -> dict:
    """The JSON contract. Keys are stable within a schema version; additions only."""
    body = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "tool": {"name": "nanaudit", "version": report.tool_version},
        "command": report.command,
        "config": report.config,
        "torch": report.torch_version,
        "device": report.device,
        "status": report.status,
        "steps_run": report.steps_run,
        "finding": report.finding,
        # Only a run that kept going has `findings` (schema version 1 gave `finding` alone).
        **({"findings": report.findings} if report.bad_steps is not None else {}),
        "timeline": report.timeline,
        "warnings": report.warnings,
        "error": report.error,
        "duration_s": round(report.duration_s, 3),
    }
    body = jsonable(body)
    for finding in [body.get("finding"), *body.get("findings", [])]:
        for key in Finding.OMIT_WHEN_NONE_AS_FINDING if finding else ():
            if finding.get(key) is None:
                finding.pop(key, None)
    for name in Report.SECTIONS:
        value = getattr(report, name)
        if name == "repro" and report.repro_error is not None:
            body["repro"] = None
            body["repro_error"] = report.repro_error
        elif value is not None:
            body[name] = jsonable(value)
    return body
