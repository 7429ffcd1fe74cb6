"""Build the run from a config: device, seed, the user's model, optimizers, schedulers, loss
(or own step) and data (sharded under torchrun), gathered in the `Session` every step reads.

Optimizers and schedulers are kept as ordered name -> object dicts whatever the config gave
(one, a list, a dict): names come from the user's dict keys, else `optimizer` / `optimizer[1]`,
and are what findings and the timeline call them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanaudit.config.schema import Config, RunOptions
from nanaudit.config.validate import (
    SHARD_KWARGS,
    Callables,
    check_config,
    data_accepts,
    device_problem,
)
from nanaudit.errors import ConfigError, Problem, UserCodeError, a_kind_of, call_user
from nanaudit.run.checkpoint import apply_model_state, load_checkpoint
from nanaudit.run.names import parameter_names, without_data_parallel
from nanaudit.run.seeding import seed_everything

if TYPE_CHECKING:
    import torch

    from nanaudit.run.distributed import Coordinator


def resolve_device(device: str) -> torch.device:
    import torch
    problem = device_problem(device)
    if problem:
        raise ConfigError([problem])
    from nanaudit.run.checks import canonical_device
    if device == "auto":
        return canonical_device("cuda" if torch.cuda.is_available() else "cpu")
    return canonical_device(device)


@dataclass
class Session:
    """Everything a step needs. `make_data` starts the data afresh; `options` is what the
    step reads of the run's settings; `config` the YAML config it came from (None for a
    session over a loop's own objects)."""

    options: RunOptions
    device: Any
    model: Any
    optimizer: Any             # the first (or only) optimizer; all of them in `optimizers`
    loss_fn: Callable | None   # None with `step:` (the user's own step)
    make_data: Callable[[], Iterable]
    param_names: dict          # id(parameter) -> qualified name
    precision: Any = None      # nanaudit.run.precision.Precision; built from the config if None
    coordinator: Any = None    # nanaudit.run.distributed.Coordinator under torchrun
    # None: filled by __post_init__ (every reader sees a dict).
    optimizers: dict = None    # type: ignore[assignment]  # name -> optimizer, in step order
    schedulers: dict = None    # type: ignore[assignment]  # name -> LR scheduler
    step_fn: Callable | None = None   # the user's own step (`step:`)
    unit: Any = None           # the step unit (nanaudit.run.units); built from the options if None
    config: Config | None = None

    def __post_init__(self) -> None:
        if self.precision is None:
            from nanaudit.run.precision import Precision
            self.precision = Precision(self.options, self.device)
        if self.optimizers is None:
            self.optimizers = {"optimizer": self.optimizer} if self.optimizer is not None else {}
        if self.schedulers is None:
            self.schedulers = {}
        if self.unit is None:
            from nanaudit.run.units import unit_for
            self.unit = unit_for(self)

    @property
    def local_model(self) -> Any:
        """The user's module itself, without a DistributedDataParallel wrapper (names.py's
        rule: a user's own child called `module` is no wrapper)."""
        return without_data_parallel(self.model)

    def compute_loss(self, batch: Any) -> Any:
        assert self.loss_fn is not None, "a session with `step:` has no loss function"
        return self.loss_fn(self.model, batch, **self.options.loss_args)

    @functools.cached_property
    def loss_what(self) -> str:
        """How an exception of the loss is introduced: ``loss `train:compute_loss` ``."""
        return f"loss `{self.options.loss_label}`"

    @property
    def loss_label(self) -> str:
        """What the report calls the user's loss code: the `loss:` or `step:` entrypoint."""
        return self.options.loss_label

    @classmethod
    def for_loop(cls, model: Any, optimizer: Any, loss_fn: Callable, device: Any,
                 batches: Iterable = (), label: str = "<your loop>", precision: Any = None,
                 optimizers: dict | None = None, **options: Any) -> Session:
        """A session over objects a loop already holds (`Sentinel`, the benchmark): no YAML, no
        entrypoints, no config. `label` names the loss and the data in messages; `options`
        are RunOptions' fields (`watch=`, `grad_clip=`, `accumulate=`...); `optimizers`: all
        of the loop's, by name (None: `optimizer` alone)."""
        run_options = RunOptions(data_label=label, loss_label=f"{label}:loss_fn",
                                 loss_key=label, **options)
        names = parameter_names(model)
        from nanaudit.run.checks import canonical_device
        return cls(run_options, canonical_device(device), model, optimizer, loss_fn,
                   lambda: batches, names, precision=precision,
                   optimizers=optimizers)  # type: ignore[arg-type]  # None: filled


def build_session(config: Config, coordinator: Coordinator | None = None) -> Session:
    """Build model, optimizer, loss and data from the config; call within user_import_path.
    Every problem of the config is raised first (config.validate.check_config), before the
    model is built, a checkpoint loaded or DDP wraps it; what the check resolved is what is
    called. Under torchrun (`coordinator`), the model is wrapped in DDP and the data sharded."""
    import torch
    if config.seed is not None:
        seed_everything(config.seed)     # before the user's modules import, as they always did
    code = check_config(config, sharded=coordinator is not None)
    device = resolve_device(config.device)
    if coordinator is not None:
        device = coordinator.device(device)
    model_fn, data_fn = _present(code.model), _present(code.data)
    model = call_user(f"model factory `{config.model.target}`", model_fn, **dict(config.model.args))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([Problem(config.model.key, f"`{config.model.target}` returned "
                                   f"{a_kind_of(model)}, not a torch.nn.Module")])
    checkpoint = load_checkpoint(config.checkpoint) if config.checkpoint else None
    if checkpoint is not None:
        apply_model_state(model, checkpoint, "checkpoint", str(config.checkpoint))
    model.to(device)
    model.train()
    if config.compile is not None:
        from nanaudit.run.compiled import compile_model
        compile_model(model, config.compile.arguments())
    # Wrapped before the optimizers are built: FSDP2 replaces the parameters with its shards.
    wrapped = (coordinator.parallel.wrap(model, device, code.parallelize)
               if coordinator is not None else model)
    optimizers = build_optimizers(config, code, model)
    schedulers = build_schedulers(config, code, optimizers)
    if checkpoint is not None:
        load_training_state(checkpoint.raw, optimizers, schedulers)
    names = parameter_names(model)

    shards_itself = (coordinator is not None
                     and all(data_accepts(data_fn, name) for name in SHARD_KWARGS))

    def make_data() -> Any:
        what = f"data factory `{config.data.target}`"
        kwargs = dict(config.data.args)
        if shards_itself and coordinator is not None:
            parallel = coordinator.parallel    # a tensor-parallel group shares its batches
            kwargs.update(rank=parallel.data_rank, world_size=parallel.data_world)
        data = call_user(what, data_fn, **kwargs)
        if not _is_iterable(data):
            raise ConfigError([Problem(config.data.key, f"`{config.data.target}` returned a "
                                       f"{type(data).__name__}, which is not iterable; return a "
                                       f"list, generator or DataLoader of batches")])
        if coordinator is not None:
            data = coordinator.parallel.shard(data, shards_itself)
        return data

    first = next(iter(optimizers.values()), None)
    return Session(config.run_options(), device, wrapped, first, code.loss, make_data, names,
                   coordinator=coordinator, optimizers=optimizers, schedulers=schedulers,
                   step_fn=code.step, config=config)


def _present(fn: Callable | None) -> Callable:
    assert fn is not None, "a checked config resolves its model and data"
    return fn


def load_training_state(raw: dict, optimizers: dict, schedulers: dict) -> None:
    """Load the optimizers' and schedulers' states a bundle or checkpoint holds: `optimizers`
    and `schedulers` by name (what repro bundles write), or a plain checkpoint's `optimizer`
    (for the first optimizer)."""
    by_name = dict(raw.get("optimizers") or {})
    if not by_name and "optimizer" in raw and optimizers:
        by_name = {next(iter(optimizers)): raw["optimizer"]}
    for name, value in by_name.items():
        if name in optimizers:
            call_user(f"loading the optimizer state of `{name}`",
                      optimizers[name].load_state_dict, value)
    for name, value in (raw.get("schedulers") or {}).items():
        if name in schedulers:
            call_user(f"loading the scheduler state of `{name}`",
                      schedulers[name].load_state_dict, value)


def _is_iterable(obj: Any) -> bool:
    import torch
    if isinstance(obj, (str, bytes, torch.Tensor)):
        return False
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def build_optimizers(config: Config, code: Callables, model: Any) -> dict:
    """name -> optimizer, made by the checked factory or class (`code.optimizer`); a factory
    may return one, a list or a dict of them."""
    import torch
    spec = config.optimizer
    if spec is None:
        return {}
    make = _present(code.optimizer)
    if spec.factory:
        made = call_user(f"optimizer factory `{spec.factory.target}`", make, model,
                         **dict(spec.factory.args))
        where, target = spec.factory.key, spec.factory.target
    else:
        target = str(spec.class_path)
        made = call_user(f"optimizer `{target}`", make, model.parameters(), **dict(spec.kwargs))
        where = "optimizer.class"
    optimizers = named_collection(made, "optimizer")
    _require(optimizers, torch.optim.Optimizer, made, where, target,
             "a torch.optim.Optimizer; return one optimizer, a list or a dict name -> optimizer")
    if not optimizers:
        raise ConfigError([Problem(where, f"`{target}` returned an empty "
                                   f"{type(made).__name__}: no optimizer to step")])
    return optimizers


def _require(built: dict, kinds: type | tuple[type, ...], made: object, where: str, target: str,
             expected: str) -> None:
    """Each object `target` returned (`made`, named in `built`) is one of `kinds`; otherwise a
    config problem at `where` that names the entry."""
    for name, obj in built.items():
        if not isinstance(obj, kinds):
            raise ConfigError([Problem(where, f"`{target}` {_entry(made, name)} a "
                                       f"{type(obj).__name__}, not {expected}")])


def _entry(made: object, name: str) -> str:
    """How a message names one entry of what a factory returned."""
    if isinstance(made, dict):
        return f"returned a dict whose entry `{name}` is"
    if isinstance(made, (list, tuple)) and len(made) > 1:
        return f"returned a {type(made).__name__} whose item {name[name.index('['):]} is"
    return "returned"


def _given(optimizers: dict) -> str:
    """What a scheduler factory was called with, for the message when it raises."""
    if len(optimizers) == 1:
        name, opt = next(iter(optimizers.items()))
        return f"the optimizer `{name}` ({type(opt).__name__})"
    kind = "dict" if _named(optimizers) else "list"
    return f"a {kind} of {len(optimizers)} optimizers ({', '.join(optimizers)})"


def build_schedulers(config: Config, code: Callables, optimizers: dict) -> dict:
    """name -> scheduler, made by the checked factory or class (`code.scheduler`). A class is
    built once per optimizer; a factory is called with the optimizer (the list or dict when
    there are several) and may return a list or dict."""
    import torch
    spec = config.scheduler
    if spec is None:
        return {}
    if not optimizers:
        raise ConfigError([Problem("scheduler", "a scheduler needs an `optimizer:`")])
    fn = _present(code.scheduler)
    if spec.factory:
        given = (next(iter(optimizers.values())) if len(optimizers) == 1
                 else (optimizers if _named(optimizers) else list(optimizers.values())))
        made = call_user(f"scheduler factory `{spec.factory.target}` (given "
                         f"{_given(optimizers)})", fn, given, **dict(spec.factory.args))
        schedulers = named_collection(made, "scheduler")
        where, target = spec.factory.key, spec.factory.target
    else:
        schedulers = {f"scheduler({name})" if len(optimizers) > 1 else "scheduler":
                      _scheduler(fn, spec, name, opt, config)
                      for name, opt in optimizers.items()}
        where, target, made = "scheduler.class", str(spec.class_path), schedulers
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    _require(schedulers, kinds, made, where, target,
             "a learning-rate scheduler (torch.optim.lr_scheduler)")
    return schedulers


def _scheduler(cls: Callable[..., Any], spec: Any, name: str, optimizer: Any,
               config: Config) -> Any:
    """The config's scheduler class on one optimizer. Arguments it refuses when built
    (OneCycleLR without `total_steps`, `cycle_momentum` on an optimizer without momentum)
    are the config's problem (exit 3), as the optimizer's are."""
    try:
        return cls(optimizer, **dict(spec.kwargs))
    except (TypeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError([Problem("scheduler", f"`{spec.class_path}` rejects these arguments "
                                   f"with optimizer `{name}` ({type(optimizer).__name__}): "
                                   f"{first}")], source=str(config.path)) from None
    except Exception as exc:
        raise UserCodeError(f"scheduler `{spec.class_path}`", exc) from exc


def _named(optimizers: dict) -> bool:
    """Did the user name them (a dict), rather than us (`optimizer[1]`)?"""
    return not all(n == "optimizer" or n.startswith("optimizer[") for n in optimizers)


def named_collection(made: object, default: str) -> dict:
    """One object, a list/tuple, or a dict of them, as an ordered name -> object dict."""
    if isinstance(made, dict):
        return {str(k): v for k, v in made.items()}
    if isinstance(made, (list, tuple)):
        if len(made) == 1:
            return {default: made[0]}
        return {f"{default}[{i}]": v for i, v in enumerate(made)}
    return {default: made}
