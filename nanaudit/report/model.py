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

Every section is a dataclass whose fields are its JSON keys, in JSON order. A key that is in
the JSON only sometimes is declared on its class: OMIT_WHEN_NONE (left out while None) and
OMIT_EMPTY (left out while empty). A section with several shapes (the error, bisect's two
modes) is one class per shape, so that each keeps the keys and key order schema version 1
gave it; the shapes of one section share the fields their readers use. Closed vocabularies
are `_Word` enums; names that come from the user's code or the system (exception classes,
files, hosts, backends, precisions) are plain text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from nanaudit.exitcodes import ExitCode

REPORT_SCHEMA_VERSION = 1


class _Word(str, Enum):
    """A closed vocabulary that still compares, formats and serialises as its plain string."""

    __str__ = str.__str__
    __format__ = str.__format__


class Status(_Word):
    """How a run ended."""

    CLEAN = "clean"
    NONFINITE = "nonfinite"
    ERROR = "error"
    INTERRUPTED = "interrupted"


class Check(_Word):
    """The sentinel that tripped, in step order."""

    INPUT = "input"
    PARAMETER = "parameter"
    LOSS = "loss"
    GRADIENT = "gradient"
    OPTIMIZER = "optimizer"


class Where(_Word):
    """The phase that made the value (a finding's `where`)."""

    INPUT = "input"
    PARAMETER = "parameter"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class SentinelReadMode(_Word):
    """How a scan read its sentinels: each step, or one step later (the device skips a bad
    update meanwhile)."""

    SYNC = "sync"
    DEFERRED = "deferred"


class BisectMode(_Word):
    DATA = "data"
    CHECKPOINTS = "checkpoints"


class RerunStatus(_Word):
    """What `nanaudit run`'s re-run of the script came to."""

    REPRODUCED = "reproduced"                 # it matched the first run and named the op
    SKIPPED = "skipped"                       # not run (--no-rerun, --max-rerun-steps, torchrun)
    FAILED = "failed"                         # it raised or wrote no result
    NONDETERMINISTIC = "nondeterministic"     # its losses before the step differed
    NOT_TRACED = "not-traced"                 # no module ran in the traced step
    NOT_REPRODUCED = "not-reproduced"         # the traced step came out finite


class WarningKind(_Word):
    NEAR_OVERFLOW = "near-overflow"
    LOSS_SPIKE = "loss-spike"
    GRAD_GROWTH = "grad-growth"
    UPDATE_RATIO = "update-ratio"


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor (an op input, a batch leaf): enough to see why an op failed."""

    name: str
    shape: tuple
    dtype: str
    numel: int
    min: float | None
    max: float | None
    mean: float | None
    nan: int
    posinf: int
    neginf: int
    zeros: int
    negatives: int
    value: Any = None             # the values themselves, when the tensor is tiny


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
    where: str
    module: str | None
    value: list                # the non-finite kinds the op's output held
    line: int | None


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
    where: str
    value: str                    # "nan" | "inf" | "-inf"
    cause: str
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
    skipped: bool = False                 # the GradScaler skipped the update (inf gradients)
    update_ratio: float | None = None     # |update| / |weights|, on sampled steps
    act_max: float | None = None          # the largest |module output|, on sampled steps
    act_ratio: float | None = None        # ... as a fraction of its dtype's largest value


# --- error: what stopped the run (one class per shape) ------------------------------------------

class ErrorInfo:
    """The report's `error`. Every shape has `type`, `message`, `exit_code` (the process exit
    code it leads to) and `rank` (under torchrun, the rank that failed; else left out)."""

    type: str
    message: str
    exit_code: ExitCode
    rank: int | None


@dataclass(kw_only=True)
class NanauditFailure(ErrorInfo):
    """One of nanaudit's own errors with nothing more to say than its message."""

    type: str                  # its class: UsageError, NothingAuditedError, DistributedError
    message: str
    exit_code: ExitCode
    rank: int | None = None

    OMIT_WHEN_NONE = ("rank",)


@dataclass(frozen=True)
class ConfigProblem:
    key: str                   # the key path ("optimizer.lr"; "" for the file as a whole)
    message: str


@dataclass(kw_only=True)
class ConfigFailure(ErrorInfo):
    """The config is wrong: every problem found, each at its key."""

    type: str = field(default="ConfigError", init=False)
    message: str
    source: str | None         # the config file, when known (null otherwise)
    problems: list             # [ConfigProblem]
    exit_code: ExitCode = ExitCode.CONFIG
    rank: int | None = None

    OMIT_WHEN_NONE = ("rank",)


@dataclass(frozen=True)
class UserFrame:
    """One frame of the user's code in a traceback (nanaudit's own frames are left out)."""

    file: str
    line: int | None
    function: str
    code: str | None           # the source line, when it can be read


@dataclass(kw_only=True)
class UserCodeFailure(ErrorInfo):
    """The user's code raised: their exception and their frames."""

    type: str = field(default="UserCodeError", init=False)
    message: str
    what: str                  # whose code: "the loss `train:loss`", "the script `train.py`"
    exception: str             # the exception's class name
    frames: list               # [UserFrame], outermost first
    exit_code: ExitCode = ExitCode.USER_CODE
    traceback: str | None = None      # `nanaudit run`: the script's traceback, as Python prints it
    rank: int | None = None

    OMIT_WHEN_NONE = ("traceback", "rank")


@dataclass(kw_only=True)
class InternalFailure(ErrorInfo):
    """A bug in nanaudit: the hint says how to report it, with our full traceback."""

    type: str = field(default="InternalError", init=False)
    message: str
    exit_code: ExitCode = ExitCode.INTERNAL
    hint: str
    traceback: str
    rank: int | None = None

    OMIT_WHEN_NONE = ("rank",)


@dataclass(kw_only=True)
class Interruption(ErrorInfo):
    """SIGINT or SIGTERM stopped the run: the report is partial."""

    type: str = field(default="Interrupted", init=False)
    signal: str                # SIGINT | SIGTERM
    exit_code: ExitCode
    message: str
    rank: int | None = None

    OMIT_WHEN_NONE = ("rank",)


# --- the named sections ----------------------------------------------------------------------

@dataclass(frozen=True)
class SentinelRead:
    """scan: how the sentinels were read, and why."""

    mode: SentinelReadMode
    reason: str
    sync_from_step: int | None = None   # deferred until a value was non-finite at this step

    OMIT_WHEN_NONE = ("sync_from_step",)


@dataclass
class SkipEntry:
    """One poisoned batch of `bisect`, for a training loop to skip (also the --skip-list file)."""

    batch: int                      # the data's index of the batch (not the optimizer step)
    rows: list | None               # its offending rows (None: not isolated)
    sample_ids: list | None         # the data set's own ids of those rows, when the batch has them
    cause: str
    confirmed: bool | None = None   # False: read again, the data gave a different batch

    OMIT_WHEN_NONE = ("confirmed",)


@dataclass(kw_only=True)
class DataBisect:
    """bisect over a data set: every batch that trips against the starting weights."""

    mode: BisectMode = field(default=BisectMode.DATA, init=False)
    batches_audited: int
    bad_batches: list               # [Finding], in data order
    skip_list: list                 # [SkipEntry], one per finding


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: str


@dataclass(kw_only=True)
class CheckpointBisect:
    """bisect over a checkpoint folder: the first bad one by binary search, then a replay of
    training from the last good one."""

    mode: BisectMode = field(default=BisectMode.CHECKPOINTS, init=False)
    checkpoints: int                # files found
    checkpoints_loaded: int         # ... loaded by the binary search
    loaded_steps: list              # their steps, in load order
    linear_loads: int               # what a linear scan would have loaded
    first_bad: CheckpointRef | None = None
    last_good: CheckpointRef | None = None
    steps_replayed: int = 0
    optimizer_state: bool | None = None   # the last good one held optimizer state (None: no replay)
    reproduced: bool | None = None        # the replay reached a non-finite value (when replayed)
    note: str = ""

    OMIT_WHEN_NONE = ("reproduced",)


@dataclass(frozen=True)
class RankStatus:
    """How one torchrun rank ended."""

    rank: int
    status: Status
    steps_run: int
    device: str
    host: str
    warnings: int                   # how many early warnings it saw


@dataclass
class DistributedRun:
    """torchrun: this rank, the process group, and (once they met) every rank's status."""

    rank: int
    world_size: int
    backend: str
    host: str
    local_rank: int
    note: str | None = None         # why the ranks run where they do (one GPU for two ranks)
    ranks: list | None = None       # [RankStatus], by rank

    OMIT_WHEN_NONE = ("note", "ranks")


@dataclass(frozen=True)
class FirstRun:
    """`nanaudit run`: the script's own run under the checks."""

    steps: int
    duration_s: float
    host_reads: int
    skipped: int                    # steps a GradScaler skipped


@dataclass(kw_only=True)
class Rerun:
    """`nanaudit run`: the re-run to the bad step with the tracer armed. A skipped re-run has
    only its status and note."""

    steps: int | None = None        # steps re-run
    duration_s: float | None = None
    status: RerunStatus
    note: str | None = None         # why it did not name the op
    log_tail: str | None = None     # failed: the end of its output
    ops_traced: int | None = None   # reproduced: the ops of the traced step
    precision: str | None = None    # reproduced: the creating op's, fp16 | bf16 | fp32

    OMIT_WHEN_NONE = ("steps", "duration_s", "note", "log_tail", "ops_traced", "precision")


@dataclass
class ScriptRun:
    """`nanaudit run`: the first run and the re-run (each once it happened)."""

    rank: int | None = None         # torchrun: this process's rank
    first_run: FirstRun | None = None
    rerun: Rerun | None = None

    OMIT_WHEN_NONE = ("rank", "first_run", "rerun")


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
    timeline: list = field(default_factory=list)      # [TimelineEntry]
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

    SECTIONS = ("sentinel_read", "repro", "bisect", "distributed", "run")


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
        "timeline": report.timeline,
        "warnings": report.warnings,
        "error": report.error,
        "duration_s": round(report.duration_s, 3),
    }
    body = jsonable(body)
    finding = body.get("finding")
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
