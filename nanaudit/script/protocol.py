"""What the first run and its re-run process say to each other: typed, frozen records pickled
through a private temporary folder (written by our own parent and child only)."""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from nanaudit.errors import NanauditError
from nanaudit.report.model import Finding
from nanaudit.report.vocabulary import Check
from nanaudit.run.timeline import Timeline
from nanaudit.script.target import ScriptTarget
from nanaudit.script.trip import ScriptTrip


@dataclass(frozen=True)
class RerunSpec:
    """What the re-run repeats: the script, the seed, the step and closure evaluation to trace,
    the check that tripped there, and the first run's losses before it, as (step, loss) for
    the steps its timeline kept (all of a short run; a long one's first and last)."""

    target: ScriptTarget
    seed: int
    step: int
    check: Check
    evaluation: int
    losses: tuple[tuple[int, float | None], ...]
    skips: int = 0        # a scale collapse: the skipped try of the step that collapsed it
    buffers: bool = False     # the step's forward made floating buffers non-finite
    skip_model: bool = False  # an input trip: stand in for the model before the step ...
    trace_from: int = 0       # ... and trace the data code of set-up and from this step only
    before: bool = False      # a loss trip whose value the script made before step N's first
    #                           model call (in-process): trace its code too (before_rerun.py)


@dataclass(frozen=True)
class RerunFailure:
    """The re-run's own failure (its frames are nanaudit's, or the script's)."""

    type: str
    message: str
    traceback: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> RerunFailure:
        if isinstance(exc, NanauditError):
            return cls(type(exc).__name__, str(exc))
        return cls("InternalError", f"{type(exc).__name__}: {exc}", traceback.format_exc())


@dataclass
class RerunResult:
    """What the re-run saw: its timeline (to check it followed the first run), whether it
    reached the traced step, the finding there, and the trace's size and precision."""

    timeline: Timeline = field(default_factory=Timeline)
    reached: bool = False
    traced: bool = False
    finding: Finding | None = None
    ops_traced: int | None = None
    precision: str | None = None
    trip: ScriptTrip | None = None       # the re-run tripped before the step: it left the run
    received: bool = False               # torchrun: the value reached this rank from a peer
    error: RerunFailure | None = None
    fingerprint: str | None = None       # an input trip: the first bad input's (trip.py)
    stood_in: int | None = None          # model_skip.py: the model calls not computed ...
    computed: int | None = None          # ... and those computed before the step
    abandoned: str | None = None         # why the re-run without the model was given up


def write(path: Path, record: RerunSpec | RerunResult) -> None:
    path.write_bytes(pickle.dumps(record))


def read_spec(path: str | Path) -> RerunSpec:
    record = pickle.loads(Path(path).read_bytes())
    if not isinstance(record, RerunSpec):
        raise TypeError(f"{path} holds no RerunSpec")
    return record


def read_result(path: Path) -> RerunResult | None:
    """The child's result, or None when it wrote none (killed, timed out)."""
    if not path.exists():
        return None
    record = pickle.loads(path.read_bytes())
    return record if isinstance(record, RerunResult) else None
