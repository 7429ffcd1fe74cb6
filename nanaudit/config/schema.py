"""The config's schema (version 1): a glossary of what a run is asked to do, as frozen
dataclasses, and every key list and choice derived from them. Nothing here parses, resolves or
imports torch; `parse.py` reads YAML into these classes and `validate.py` resolves them.

A YAML key is the name of a field: the top level is `Config`'s fields, each section (`amp:`,
`watch:`, ...) its options class's fields, so a key list never drifts from the class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nanaudit.report.vocabulary import SentinelReadMode

SCHEMA_VERSION = 1


ENTRYPOINT_KEYS = ("entrypoint", "args")


PRECISIONS = ("fp32", "fp16", "bf16")


FAIL_ON = ("nonfinite", "warning")
"""`fail_on` and `--fail-on`: exit 1 on a non-finite value only, or also exit 7 on a warning."""


BACKENDS = ("auto", "gloo", "nccl")
FSDP_PARAM_DTYPES = ("fp32", "bf16", "fp16")
MESH_DIMS = ("dp_replicate", "dp_shard")    # `distributed.mesh`: HSDP's dimensions, outer first


SENTINEL_READS = ("auto", *(mode.value for mode in SentinelReadMode))
"""`sentinel_read`: auto, or one of the read modes a report records (see run/deferred.py)."""


@dataclass(frozen=True)
class Entrypoint:
    """A callable the config names (`model:`, `data:`, `loss:`, `step:`, a factory): the target
    `module.path:attr` or `relative/file.py:attr` (relative to the config's folder), the key
    path it came from (`optimizer.entrypoint`, for messages), and keyword arguments (`args:`)."""

    target: str
    key: str
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def module_part(self) -> str:
        return self.target.rsplit(":", 1)[0]

    @property
    def attr_part(self) -> str:
        return self.target.rsplit(":", 1)[1]


@dataclass(frozen=True)
class BuilderSpec:
    """`optimizer:` or `scheduler:`: either a class path with its keyword arguments
    (`class: torch.optim.AdamW`, `lr: 1e-3`), or a factory entrypoint."""

    key: str
    class_path: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    factory: Entrypoint | None = None

    def summary(self) -> dict:
        if self.class_path:
            return {"class": self.class_path, **dict(self.kwargs)}
        assert self.factory is not None, "a spec has a class path or a factory"
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
    """`localize:`, the expensive path after a finding: whether to isolate the offending
    batch rows (samples), and how many replays that may spend."""

    samples: bool = True
    max_replays: int = 64


@dataclass(frozen=True)
class AmpOptions:
    """`amp:`, the GradScaler under `precision: fp16` and when its skipped steps become a
    finding: the scale falling below `scale_floor`, or `max_skipped` skipped steps in a row."""

    grad_scaler: bool | None = None   # None: on for fp16, off for bf16
    init_scale: float = 65536.0
    growth_interval: int = 2000
    scale_floor: float = 1.0
    max_skipped: int = 10


@dataclass(frozen=True)
class WatchOptions:
    """`watch:`, the early-warning detectors that fire while values are still finite.
    `False` (or 0) turns one off."""

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
    """`distributed:`, how a run under torchrun (WORLD_SIZE > 1) sets up torch.distributed."""

    backend: str = "auto"             # auto: nccl on CUDA, gloo on CPU
    ddp: bool = True                  # wrap the model in DistributedDataParallel
    timeout_s: float = 600.0          # a peer silent this long is an error, not a hang
    find_unused_parameters: bool = False
    fsdp: bool = False                # shard with FSDP2 (fully_shard per block) instead of DDP
    fsdp_param_dtype: str = "fp32"    # FSDP2's MixedPrecisionPolicy param_dtype (fp32: none)
    mesh: dict | None = None          # HSDP: {dp_replicate: R, dp_shard: S}, R x S = world size
    tp: int = 1                       # tensor parallel: ranks per TP group, R x S x tp = world
    parallelize: str | None = None    # the TP plan `module:fn(model, tp_mesh)` (needed by tp > 1)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """`compile:`, torch.compile applied to the model the config builds (`true`, or these
    arguments of `torch.compile`), so the program audited is the program trained."""

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None

    def arguments(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def section_keys(options: type) -> tuple[str, ...]:
    """A section's YAML keys are its dataclass's fields: one list, never a hand-kept copy."""
    return tuple(f.name for f in fields(options))


LOCALIZE_KEYS = section_keys(LocalizeOptions)


AMP_KEYS = section_keys(AmpOptions)


WATCH_KEYS = section_keys(WatchOptions)


DISTRIBUTED_KEYS = section_keys(DistributedOptions)


COMPILE_KEYS = section_keys(CompileOptions)


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


# The run-time keys a config shares with RunOptions: each declared in Config with RunOptions'
# own default (`_shared`), and copied over by `Config.run_options`: one default for each.
RUN_FIELDS = ("grad_clip", "batch_dim", "localize", "precision", "amp", "watch",
              "sentinel_read", "accumulate", "checkpoint")


def _shared(name: str) -> Any:
    """A Config field whose default is RunOptions' default for `name`."""
    shared = RunOptions.__dataclass_fields__[name]
    return field(default=shared.default, default_factory=shared.default_factory)


@dataclass(frozen=True)
class UserCode:
    """The keys that name the user's code, and the folder they resolve from: what validation
    resolves and a session calls. A file with problems elsewhere still gives the keys that
    parsed, so their problems are reported with the rest."""

    base_dir: Path
    model: Entrypoint | None = None
    data: Entrypoint | None = None
    loss: Entrypoint | None = None
    step: Entrypoint | None = None
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    parallelize: Entrypoint | None = None


@dataclass(frozen=True)
class Config:
    """A config file, parsed and checked (what `nanaudit scan CONFIG` is asked to do):

    model, data      factories the run calls: `fn(**args) -> nn.Module`, `-> iterable of batches`
    loss             `fn(model, batch, **args) -> scalar tensor` (or `{"loss": tensor, ...}`);
                     None when `step` names the user's own step
    step             `fn(model, batch, optimizer, **args)`: forward, backward and update in the
                     user's code, nanaudit checking each optimizer step it makes
    optimizer        how the optimizers are built (`OptimizerSpec`); `scheduler` likewise
    steps            audit at most this many steps (None: the whole data)
    seed             seeds Python, torch and NumPy before the user's code is imported
    checkpoint       weights (and optimizer state) to start from, resolved beside the config
    device           auto, cpu, cuda, cuda:N or mps
    grad_clip        the gradient-norm clip the training applies
    batch_dim        the batch dimension: `{"*": dim}` for every leaf, or per batch path
    precision        fp32, fp16 or bf16 (autocast; `amp` configures fp16's GradScaler)
    localize, watch, distributed   the sections of their options classes
    fail_on          nonfinite, or warning (an early warning also fails the run, exit 7)
    sentinel_read    auto, sync or deferred (see run/deferred.py)
    accumulate       micro-batches (consecutive batches) per optimizer step
    compile          torch.compile the model (`CompileOptions`; None: run it as built)

    Field order is the order unknown-key messages list the YAML keys in."""

    path: Path
    model: Entrypoint
    data: Entrypoint
    loss: Entrypoint | None
    optimizer: OptimizerSpec | None = None
    steps: int | None = None
    seed: int | None = None
    checkpoint: Path | None = _shared("checkpoint")
    device: str = "auto"
    grad_clip: float | None = _shared("grad_clip")
    batch_dim: Mapping[str, int] = _shared("batch_dim")
    localize: LocalizeOptions = _shared("localize")
    precision: str = _shared("precision")
    amp: AmpOptions = _shared("amp")
    watch: WatchOptions = _shared("watch")
    fail_on: str = "nonfinite"
    distributed: DistributedOptions = field(default_factory=DistributedOptions)
    sentinel_read: str = _shared("sentinel_read")
    scheduler: SchedulerSpec | None = None
    accumulate: int = _shared("accumulate")
    step: Entrypoint | None = None
    compile: CompileOptions | None = None

    @property
    def own_code(self) -> Entrypoint:
        """The entrypoint that computes the loss: `step:` when given, else `loss:`."""
        code = self.step if self.step is not None else self.loss
        assert code is not None, "parsing requires `loss:` or `step:`"
        return code

    @property
    def uses_grad_scaler(self) -> bool:
        return self.run_options().uses_grad_scaler

    def run_options(self) -> RunOptions:
        code = self.own_code
        return RunOptions(**{name: getattr(self, name) for name in RUN_FIELDS},
                          data_label=self.data.target, loss_label=code.target,
                          loss_key=code.key, loss_args=dict(code.args))

    def user_code(self) -> UserCode:
        plan = self.distributed.parallelize
        return UserCode(self.base_dir, self.model, self.data, self.loss, self.step,
                        self.optimizer, self.scheduler,
                        Entrypoint(plan, "distributed.parallelize") if plan else None)

    @property
    def base_dir(self) -> Path:
        return self.path.parent

    def summary(self) -> dict:
        """The config as it appears in reports: paths and entrypoint names, no live objects."""
        opt = self.optimizer.summary() if self.optimizer is not None else None
        extra: dict[str, Any] = {}
        # Keys a run did not use stay out, so existing reports keep their shape.
        if self.scheduler is not None:
            extra["scheduler"] = self.scheduler.summary()
        if self.accumulate != 1:
            extra["accumulate"] = self.accumulate
        if self.step is not None:
            extra["step"] = self.step.target
        if self.compile is not None:
            extra["compile"] = self.compile.arguments()
        return {
            "path": str(self.path), "model": self.model.target, "data": self.data.target,
            "loss": self.loss.target if self.loss else None, **extra,
            "optimizer": opt, "steps": self.steps, "seed": self.seed,
            "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            "device": self.device, "grad_clip": self.grad_clip, "precision": self.precision,
            "grad_scaler": self.uses_grad_scaler, "fail_on": self.fail_on,
        }


TOP_LEVEL_KEYS = ("schema_version", *(f.name for f in fields(Config) if f.name != "path"))
