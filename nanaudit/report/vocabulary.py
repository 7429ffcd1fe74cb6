"""The report's closed vocabularies: how a run ended, which check tripped, where a value was
made, the read modes, bisect's modes, the re-run's outcomes, the warning kinds and the cause
ids. Each is a `str` enum, so it compares, formats and serialises as its plain string and the
JSON stays exactly what schema version 1 gave."""

from __future__ import annotations

from enum import Enum


class Word(str, Enum):
    """A closed vocabulary that still compares, formats and serialises as its plain string."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Status(Word):
    """How a run ended."""

    CLEAN = "clean"
    NONFINITE = "nonfinite"
    ERROR = "error"
    INTERRUPTED = "interrupted"


class Check(Word):
    """What tripped: a sentinel, in step order, or one of the two trips that are not sentinels
    (SCHEDULE: the learning rate, read before an update; ERROR: the script raised with
    non-finite values in its frames)."""

    INPUT = "input"
    PARAMETER = "parameter"
    LOSS = "loss"
    GRADIENT = "gradient"
    OPTIMIZER = "optimizer"
    SCHEDULE = "schedule"
    ERROR = "error"


class Where(Word):
    """The phase that made the value (a finding's `where`)."""

    INPUT = "input"
    PARAMETER = "parameter"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class SentinelReadMode(Word):
    """How a scan read its sentinels: each step, or one step later (the device skips a bad
    update meanwhile)."""

    SYNC = "sync"
    DEFERRED = "deferred"


class BisectMode(Word):
    DATA = "data"
    CHECKPOINTS = "checkpoints"


class RerunStatus(Word):
    """What `nanaudit run`'s re-run of the script came to."""

    REPRODUCED = "reproduced"                 # it matched the first run and named the op
    SKIPPED = "skipped"                       # not run (--no-rerun, --max-rerun-steps, torchrun)
    FAILED = "failed"                         # it raised or wrote no result
    NONDETERMINISTIC = "nondeterministic"     # its losses before the step differed
    NOT_TRACED = "not-traced"                 # no module ran in the traced step
    NOT_REPRODUCED = "not-reproduced"         # the traced step came out finite
    COMPILED_ONLY = "compiled-only"           # finite eagerly; the compiled step makes it
    MADE_BEFORE = "made-before-step"          # in-process: the value entered the step already bad


class CompiledOutcome(Word):
    """What the replays of a compiled model's bad step came to (a finding's `compiled`)."""

    EAGER = "eager"                       # the eager replay made the value: the usual finding
    COMPILED_ONLY = "compiled-only"       # eager is finite; the compiled step makes the value
    NOT_REPRODUCED = "not-reproduced"     # eager and compiled replays are finite


class CompileStage(Word):
    """The stage of torch.compile that first makes a compiled-only value, in pipeline order."""

    DYNAMO = "dynamo"                     # dynamo's captured graph, run as Python
    AOT_AUTOGRAD = "aot-autograd"         # AOTAutograd's forward and backward graphs (aot_eager)
    DECOMPOSITIONS = "decompositions"     # the backend's decomposition table, without its compiler
    INDUCTOR = "inductor"                 # inductor's generated kernels
    BACKEND = "backend"                   # a custom backend's own compiler


class ProducerKind(Word):
    """What made the non-finite value of an input finding (its `producer.made_by`)."""

    TORCH_OP = "torch-op"                 # a torch op of the user's data code: the finding's op
    OUTSIDE_TORCH = "outside-torch"       # already non-finite when it reached torch
    NOT_LOCALIZED = "not-localized"       # the data code could not be traced faithfully


class WarningKind(Word):
    NEAR_OVERFLOW = "near-overflow"
    LOSS_SPIKE = "loss-spike"
    GRAD_GROWTH = "grad-growth"
    UPDATE_RATIO = "update-ratio"



class Cause(Word):
    """An id of the cause catalogue (localize/causes.py holds what each means and its fix).
    The ids are a public contract (the JSON report's `finding.cause`, JUnit test names, GitHub
    annotations): an id never changes meaning once released."""

    NONFINITE_INPUT = "nonfinite-input"
    NONFINITE_PARAMETER = "nonfinite-parameter"
    LOG_DOMAIN = "log-domain"
    DIV_BY_ZERO = "div-by-zero"
    SQRT_DOMAIN = "sqrt-domain"
    EXP_OVERFLOW = "exp-overflow"
    TRIG_DOMAIN = "trig-domain"
    NORM_AT_ZERO = "norm-at-zero"
    SOFTMAX_ALL_MASKED = "softmax-all-masked"
    DEGENERATE_REDUCTION = "degenerate-reduction"
    POLE = "pole"
    DTYPE_OVERFLOW = "dtype-overflow"
    MASKED_NONFINITE_GRADIENT = "masked-nonfinite-gradient"
    IMPOSSIBLE_CTC_TARGET = "impossible-ctc-target"
    DIVERGENCE = "divergence"
    OPTIMIZER_UPDATE = "optimizer-update"
    INF_ARITHMETIC = "inf-arithmetic"
    COMPILED_ONLY = "compiled-only"
    UNKNOWN = "unknown"


class BadStepAction(Word):
    """What became of a bad step's update under --keep-going (a finding's `action`)."""

    SKIPPED = "skipped"       # the update was not applied; the run went on
    STOPPED = "stopped"       # the run stopped at this step (see the finding's `stop_reason`)


class StopReason(Word):
    """Why a run that kept going stopped at a bad step (a finding's `stop_reason`)."""

    MAX_BAD_STEPS = "max-bad-steps"       # --max-bad-steps steps were skipped already
    NONFINITE_STATE = "nonfinite-state"   # the weights, buffers or optimizer state were
                                          # non-finite before the step: skipping changes nothing
    CANNOT_SKIP = "cannot-skip"           # the update cannot be held back (a hand-written one,
                                          # a closure's optimizer that already moved the
                                          # weights, a script that raised, a collapsed scale)
