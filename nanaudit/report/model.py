"""The report data model: what every renderer reads, and the JSON contract (schema version 1).

Glossary:
  step      the 0-based index of the batch in the data (the training step that consumed it);
            with gradient accumulation (Sentinel, integrations) the 0-based optimizer step, the
            batch being named by `batch_index` and `micro_batch`
  batch     the tree of tensors the data yields for one step
  sample    one row of the batch along its batch dimension
  where     the phase that made the value: input, parameter, forward, backward, optimizer
  op        the aten op that *created* the non-finite value (not one that passed it on)
  module    the qualified name of the innermost nn.Module running the op ("" for the root)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_SCHEMA_VERSION = 1
WHERE_VALUES = ("input", "parameter", "forward", "backward", "optimizer")
STATUS_VALUES = ("clean", "nonfinite", "error", "interrupted")


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
    """One offending batch row, shown in the report: values when small, statistics when large."""

    index: int
    leaves: tuple = ()            # ((path, TensorStats), ...)


WARNING_KINDS = ("near-overflow", "loss-spike", "grad-growth", "update-ratio")


@dataclass(frozen=True)
class EarlyWarning:
    """A sign of trouble before any non-finite value: seen at `step`, growing since `began`."""

    kind: str                             # one of WARNING_KINDS
    step: int
    began: int
    message: str
    module: str | None = None
    value: float | None = None
    threshold: float | None = None


@dataclass
class Finding:
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
    sample_search: dict | None = None                 # {"replays", "coupled", "batch_size", ...}
    chain: list = field(default_factory=list)         # [{"op", "where", "module", "value"}]
    rank: int | None = None
    tensors: list = field(default_factory=list)       # every parameter / batch path involved
    first_warning: EarlyWarning | None = None         # the earliest warning before the finding
    batch_index: int | None = None    # integrations: the data's batch index of the bad batch
    micro_batch: int | None = None    # ... its position in the accumulation window (0-based)


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


@dataclass
class Report:
    tool_version: str
    config: dict
    torch_version: str
    device: str
    status: str
    steps_run: int
    command: str = "scan"
    finding: Finding | None = None
    timeline: list = field(default_factory=list)      # [TimelineEntry]
    warnings: list = field(default_factory=list)      # [EarlyWarning], in step order
    error: dict | None = None
    duration_s: float = 0.0
    extra: dict = field(default_factory=dict)         # command-specific sections (bisect)


def json_number(x: Any) -> Any:
    """Floats as JSON allows them: non-finite values become the strings 'nan', 'inf', '-inf'."""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
    return x


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return json_number(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
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
    body.update(report.extra)
    return _jsonable(body)
