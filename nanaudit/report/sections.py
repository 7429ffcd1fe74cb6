"""The report's sections beyond the finding: the error that stopped a run (one class per shape,
each keeping the keys and key order schema version 1 gave it) and the sections particular
commands add (the sentinel read mode, bisect's bad batches or checkpoints, every rank's status
under torchrun, `nanaudit run`'s first run and re-run). Fields are JSON keys, in JSON order;
OMIT_WHEN_NONE lists the keys left out while None (see model.jsonable)."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanaudit.exitcodes import ExitCode
from nanaudit.report.vocabulary import (
    BisectMode,
    Cause,
    CompiledOutcome,
    CompileStage,
    RerunStatus,
    SentinelReadMode,
    Status,
    StopReason,
)

# --- error: what stopped the run ----------------------------------------------------------------

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
    hint: str | None = None           # what to do, for a failure training code is known for

    OMIT_WHEN_NONE = ("traceback", "rank", "hint")


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
    """SIGINT, SIGTERM or SIGHUP stopped the run: the report is partial."""

    type: str = field(default="Interrupted", init=False)
    signal: str                # SIGINT | SIGTERM | SIGHUP
    exit_code: ExitCode
    message: str
    rank: int | None = None

    OMIT_WHEN_NONE = ("rank",)


# --- the sections of particular commands ------------------------------------------------------

@dataclass(frozen=True)
class SentinelRead:
    """scan: how the sentinels were read, and why."""

    mode: SentinelReadMode
    reason: str
    sync_from_step: int | None = None   # deferred until a value was non-finite at this step
    # keep-going, deferred: the steps run twice, each after a skipped step (the first wasted)
    steps_run_again: int | None = None

    OMIT_WHEN_NONE = ("sync_from_step", "steps_run_again")


@dataclass
class SkipEntry:
    """One poisoned batch of `bisect`, for a training loop to skip (also the --skip-list file)."""

    batch: int                      # the data's index of the batch (not the optimizer step)
    rows: list | None               # its offending rows (None: not isolated)
    sample_ids: list | None         # the data set's own ids of those rows, when the batch has them
    cause: str
    confirmed: bool | None = None   # False: read again, the data gave a different batch
    # --keep-going's bad steps (run, scan): the optimizer step and the rank whose batch it was.
    step: int | None = None
    rank: int | None = None
    # `run` under gradient accumulation, whose `batch` is the step: the bad batch's place in it
    micro_batch: int | None = None
    sample_indices: list | None = None   # `run`: the data set's indices of the rows, if known

    OMIT_WHEN_NONE = ("confirmed", "step", "rank", "micro_batch", "sample_indices")


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
class ShardElement:
    """A non-finite element of a sharded (DTensor) parameter or gradient: its index in the
    origin rank's own shard and in the whole tensor, from the DTensor's placements."""

    tensor: str                     # the parameter's name; `NAME.grad` for its gradient
    local_index: list               # in the origin rank's local shard
    global_index: list              # in the whole (unsharded) tensor


@dataclass(frozen=True)
class RankStatus:
    """How one torchrun rank ended."""

    rank: int
    status: Status
    steps_run: int
    device: str
    host: str
    warnings: int                   # how many early warnings it saw
    mesh: dict | None = None        # its coordinate on the model's device mesh {"dp": 0, ...}

    OMIT_WHEN_NONE = ("mesh",)


@dataclass
class DistributedRun:
    """torchrun: this rank, the process group, and (once they met) every rank's status."""

    rank: int
    world_size: int
    backend: str
    host: str
    local_rank: int
    note: str | None = None         # why the ranks run where they do (one GPU for two ranks)
    ranks: list[RankStatus] | None = None  # by rank

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
    # An input trip (the data code made the batch): whether the steps before it ran without
    # computing the model, the model calls stood in for, and else why the model was computed
    # (the re-run without it tried first, for `model_try_s`, and could not be used).
    model_skipped: bool | None = None
    stood_in: int | None = None
    model_note: str | None = None
    model_try_s: float | None = None

    OMIT_WHEN_NONE = ("steps", "duration_s", "note", "log_tail", "ops_traced", "precision",
                      "model_skipped", "stood_in", "model_note", "model_try_s")


@dataclass
class ScriptRun:
    """`nanaudit run`: the first run and the re-run (each once it happened)."""

    rank: int | None = None         # torchrun: this process's rank
    first_run: FirstRun | None = None
    rerun: Rerun | None = None
    replay: Rerun | None = None     # the in-process replay at the trip (the same fields)
    process: str | None = None      # the process the script started that trained, if not itself

    OMIT_WHEN_NONE = ("rank", "first_run", "rerun", "replay", "process")


@dataclass(frozen=True)
class StageReplay:
    """One replay of a compiled step from its saved state: the stage it stops at, the backend
    it ran with, and whether the value came back (None: the replay itself failed)."""

    stage: str                      # "eager", or a CompileStage
    backend: str
    nonfinite: bool | None
    note: str | None = None         # why it failed

    OMIT_WHEN_NONE = ("note",)


@dataclass
class CompiledReplay:
    """A finding's replays when the model is `torch.compile`d: its backend, what the replays
    came to (`outcome`), and for a compiled-only value the first compiler stage that makes it,
    each replay tried, and the FX node (in which graph, decomposed from which op) that made it
    first; `random_ops`: the value needs the random numbers the compiled program draws."""

    backend: str
    outcome: CompiledOutcome
    stage: CompileStage | None = None
    replays: list = field(default_factory=list)     # [StageReplay], in the order tried
    node: str | None = None
    graph: str | None = None        # forward | backward (AOTAutograd's) | graph (dynamo's)
    decomposed_from: str | None = None
    random_ops: bool | None = None

    OMIT_WHEN_NONE = ("stage", "node", "graph", "decomposed_from", "random_ops")
    OMIT_EMPTY = ("replays",)


@dataclass(frozen=True)
class StepSpans:
    """A set of steps, bounded: the `first` and `last`, and the runs of consecutive steps from
    the first as [start, end] pairs (a lone step is [n, n]); past the first MAX_SPANS runs
    (report/bad_steps.py) the rest are counted in `spans_left_out`, not listed."""

    first: int
    last: int
    spans: list                     # [[start, end], ...], in step order
    spans_left_out: int = 0


@dataclass(frozen=True)
class BadStepGroup:
    """The bad steps past the report's whole findings that share a cause, an op and a line:
    how many, and which steps."""

    cause: Cause
    op: str | None
    file: str | None
    line: int | None
    count: int
    steps: StepSpans


@dataclass(frozen=True)
class BadSteps:
    """--keep-going (the `bad_steps` section): every bad step of the run. The first `whole`
    are the report's `findings`, in full; the rest are `summarized` by cause, op and line.
    `skipped` of the `count` bad steps had their update skipped; a run that stopped at a bad
    step says why (`stopped`). `persistent`: every bad step names the same op at the same line
    (at least PERSISTENT_MIN_STEPS of them): one cause that skipping will not outrun."""

    max_bad_steps: int
    count: int
    skipped: int
    whole: int
    stopped: StopReason | None
    persistent: bool
    steps: StepSpans                # every bad step
    summarized: list = field(default_factory=list)   # [BadStepGroup], by their first step
