"""The config's schema (version 1): frozen dataclasses for every section, and the key lists
derived from them. What a run is asked to do, as data; nothing here parses or imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


TOP_LEVEL_KEYS = (
    "schema_version", "model", "data", "loss", "optimizer", "steps", "seed",
    "checkpoint", "device", "grad_clip", "batch_dim", "localize", "precision", "amp", "watch",
    "fail_on", "distributed", "sentinel_read", "scheduler", "accumulate", "step",
)


ENTRYPOINT_KEYS = ("entrypoint", "args")


PRECISIONS = ("fp32", "fp16", "bf16")


FAIL_ON = ("nonfinite", "warning")


BACKENDS = ("auto", "gloo", "nccl")


SENTINEL_READS = ("auto", "sync", "deferred")   # see nanaudit/deferred.py


@dataclass(frozen=True)
class Entrypoint:
    """A callable named in the config: `module.path:attr` or `relative/file.py:attr`, plus kwargs."""

    target: str
    key: str                      # the config key path it came from, for error messages
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def module_part(self) -> str:
        return self.target.rsplit(":", 1)[0]

    @property
    def attr_part(self) -> str:
        return self.target.rsplit(":", 1)[1]


@dataclass(frozen=True)
class BuilderSpec:
    """Either a class path with keyword arguments, or a factory entrypoint."""

    key: str
    class_path: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    factory: Entrypoint | None = None

    def summary(self) -> dict:
        if self.class_path:
            return {"class": self.class_path, **dict(self.kwargs)}
        return {"entrypoint": self.factory.target}


@dataclass(frozen=True)
class OptimizerSpec(BuilderSpec):
    """The class is called with the model's parameters; the factory with the model, and may
    return one optimizer, a list, or a dict name -> optimizer."""


@dataclass(frozen=True)
class SchedulerSpec(BuilderSpec):
    """The class is called with the (each) optimizer; the factory with the optimizer (the list
    or dict when there are several) and may return a list/dict of schedulers to match."""


@dataclass(frozen=True)
class LocalizeOptions:
    samples: bool = True          # isolate the offending batch rows after a finding
    max_replays: int = 64         # cap on replays spent isolating samples


@dataclass(frozen=True)
class AmpOptions:
    """The GradScaler under `precision: fp16` and when its skipped steps become a finding."""

    grad_scaler: bool | None = None   # None: on for fp16, off for bf16
    init_scale: float = 65536.0
    growth_interval: int = 2000
    scale_floor: float = 1.0          # a finding when the scale falls below this
    max_skipped: int = 10             # ... or when this many steps in a row are skipped


@dataclass(frozen=True)
class WatchOptions:
    """Early-warning detectors. `False` (or 0) turns one off."""

    activations: int | str = "auto"   # sample module outputs every N steps; auto: 1 under fp16
    near_overflow: float = 0.5        # warn at this fraction of the dtype's largest value
    loss_spike: float | bool = 2.0    # warn when loss > window mean + this x |window mean|
    spike_window: int = 20
    grad_growth: float | bool = 10.0  # warn when the grad norm grew this much ...
    growth_steps: int = 4             # ... over at least this many consecutive increases
    update_ratio: float | bool = 0.1  # warn when |update| / |weights| exceeds this
    update_every: int = 10            # measure the update ratio every N steps (0: never)

    def activation_every(self, precision: str) -> int:
        if self.activations == "auto":
            return 1 if precision == "fp16" else 0
        return int(self.activations)


@dataclass(frozen=True)
class DistributedOptions:
    """How a run under torchrun (WORLD_SIZE > 1) sets up torch.distributed."""

    backend: str = "auto"             # auto: nccl on CUDA, gloo on CPU
    ddp: bool = True                  # wrap the model in DistributedDataParallel
    timeout_s: float = 600.0          # a peer silent this long is an error, not a hang
    find_unused_parameters: bool = False


def _keys(options) -> tuple[str, ...]:
    """A section's YAML keys are its dataclass's fields: one list, never a hand-kept copy."""
    return tuple(f.name for f in fields(options))


LOCALIZE_KEYS = _keys(LocalizeOptions)


AMP_KEYS = _keys(AmpOptions)


WATCH_KEYS = _keys(WatchOptions)


DISTRIBUTED_KEYS = _keys(DistributedOptions)


@dataclass(frozen=True)
class RunOptions:
    """What the step loop, the replays and the diagnosis read of a run: the config's run-time
    keys and the labels of the user's code, without entrypoints or paths to resolve. A config
    gives one (`Config.run_options`); `Sentinel` and the benchmark build one directly."""

    grad_clip: float | None = None
    batch_dim: Mapping[str, int] = field(default_factory=dict)
    localize: LocalizeOptions = field(default_factory=LocalizeOptions)
    precision: str = "fp32"
    amp: AmpOptions = field(default_factory=AmpOptions)
    watch: WatchOptions = field(default_factory=WatchOptions)
    sentinel_read: str = "auto"
    accumulate: int = 1
    checkpoint: Path | None = None
    data_label: str = "<your data>"       # how messages name the data, the loss, the step
    loss_label: str = "<your loss>"
    loss_key: str = "loss"                # the config key a loss problem is reported under
    loss_args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def uses_grad_scaler(self) -> bool:
        if self.precision == "fp32":
            return False
        if self.amp.grad_scaler is None:
            return self.precision == "fp16"   # bf16 has float32's range: no scaling needed
        return self.amp.grad_scaler


@dataclass(frozen=True)
class Config:
    path: Path
    model: Entrypoint
    data: Entrypoint
    loss: Entrypoint | None           # None when `step:` names the user's own step
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    accumulate: int = 1               # micro-batches (consecutive batches) per optimizer step
    step: Entrypoint | None = None    # fn(model, batch, optimizer) -> loss or {name: loss}
    steps: int | None = None
    seed: int | None = None
    checkpoint: Path | None = None
    device: str = "auto"
    grad_clip: float | None = None
    batch_dim: Mapping[str, int] = field(default_factory=dict)
    localize: LocalizeOptions = field(default_factory=LocalizeOptions)
    precision: str = "fp32"
    amp: AmpOptions = field(default_factory=AmpOptions)
    watch: WatchOptions = field(default_factory=WatchOptions)
    fail_on: str = "nonfinite"
    distributed: DistributedOptions = field(default_factory=DistributedOptions)
    sentinel_read: str = "auto"       # auto: deferred on CUDA when the optimizer can skip

    @property
    def uses_grad_scaler(self) -> bool:
        return self.run_options().uses_grad_scaler

    def run_options(self) -> RunOptions:
        code = self.step if self.step is not None else self.loss
        return RunOptions(
            grad_clip=self.grad_clip, batch_dim=self.batch_dim, localize=self.localize,
            precision=self.precision, amp=self.amp, watch=self.watch,
            sentinel_read=self.sentinel_read, accumulate=self.accumulate,
            checkpoint=self.checkpoint, data_label=self.data.target, loss_label=code.target,
            loss_key=code.key, loss_args=dict(code.args))

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def summary(self) -> dict:
        """The config as it appears in reports: paths and entrypoint names, no live objects."""
        opt = self.optimizer.summary() if self.optimizer is not None else None
        extra = {}
        # Keys a run did not use stay out, so existing reports keep their shape.
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.summary()
        if self.accumulate != 1:
            extra["accumulate"] = self.accumulate
        if self.step is not None:
            extra["step"] = self.step.target
        return {
            "path": str(self.path), "model": self.model.target, "data": self.data.target,
            "loss": self.loss.target if self.loss else None, **extra,
            "optimizer": opt, "steps": self.steps, "seed": self.seed,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "device": self.device, "grad_clip": self.grad_clip, "precision": self.precision,
            "grad_scaler": self.uses_grad_scaler, "fail_on": self.fail_on,
        }
