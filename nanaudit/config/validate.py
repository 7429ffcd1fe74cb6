"""Resolve every entrypoint of a config and check it can be called as nanaudit will call it,
without building anything (torchtune's approach): bind each signature, try the optimizer and
scheduler arguments on a throwaway parameter, check the checkpoint path and the device.

This is the one resolver of the user's code. `nanaudit validate` prints what it finds; the
session building (`scan`, `bisect`, a replay) runs it before it builds the model, loads a
checkpoint or wraps DDP and then calls what it resolved, so a problem is the same message and
exit code everywhere, and every problem of the file comes in one error.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanaudit.config.entrypoints import class_target, resolve_callable, user_import_path
from nanaudit.config.parse import load_draft
from nanaudit.config.schema import (
    BuilderSpec,
    Config,
    Entrypoint,
    OptimizerSpec,
    UserCode,
)
from nanaudit.errors import ConfigError, Problem, UserCodeError

ROLES: dict[str, tuple[tuple[str, ...], str]] = {
    "model": ((), "the model factory `fn(**args) -> nn.Module`"),
    "data": ((), "the data factory `fn(**args) -> iterable of batches`"),
    "loss": (("model", "batch"), "the loss `fn(model, batch, **args) -> scalar tensor`"),
    "step": (("model", "batch", "optimizer"),
             "the step `fn(model, batch, optimizer, **args) -> loss or {name: loss}`"),
    "parallelize": (("model", "tp_mesh"), "the tensor-parallel plan `fn(model, tp_mesh)`"),
}
"""How nanaudit calls each entrypoint key: its positional arguments, and how messages name it."""


SHARD_KWARGS = ("rank", "world_size")
"""Under torchrun, a data factory that takes both is given them and shards itself."""


@dataclass(frozen=True)
class Callables:
    """The user's objects a config names, resolved: what a session calls. `optimizer` and
    `scheduler` are the factory, or the class of `class:`; None where the config names none."""

    model: Callable | None = None
    data: Callable | None = None
    loss: Callable | None = None
    step: Callable | None = None
    optimizer: Callable | None = None
    scheduler: Callable | None = None
    parallelize: Callable | None = None


@dataclass
class Resolution:
    """What resolving a config's code found: the callables by key, and every problem in the
    order the keys were checked, each with the user's exception when it is their module
    failing to import (that is exit 4 in a run, not a problem of the file)."""

    found: dict[str, Callable] = field(default_factory=dict)
    checks: list[tuple[Problem, UserCodeError | None]] = field(default_factory=list)

    @property
    def problems(self) -> list[Problem]:
        return [problem for problem, _ in self.checks]

    @property
    def file_problems(self) -> list[Problem]:
        return [problem for problem, raised in self.checks if raised is None]

    @property
    def user_error(self) -> UserCodeError | None:
        return next((raised for _, raised in self.checks if raised is not None), None)

    def callables(self) -> Callables:
        return Callables(**self.found)

    def add(self, problems: list[Problem]) -> None:
        self.checks += [(problem, None) for problem in problems]

    def resolve(self, entry: Entrypoint, base_dir: Path) -> Callable | None:
        try:
            return resolve_callable(entry, base_dir)
        except ConfigError as exc:
            self.add(exc.problems)
        except UserCodeError as exc:
            self.checks.append((Problem(entry.key, str(exc)), exc))
        return None

    def bind(self, fn: Callable, entry: Entrypoint, positional: tuple, role: str,
             extra: Mapping[str, Any] | None = None) -> None:
        kwargs = {**dict(entry.args), **(extra or {})}
        problem = _bind_problem(fn, entry.key, positional, kwargs, role)
        if problem:
            self.add([problem])


def resolve_user_code(code: UserCode, sharded: bool = False) -> Resolution:
    """Resolve every entrypoint and builder of `code` and check it can be called as nanaudit
    will call it (`sharded`: under torchrun). Call within user_import_path(code.base_dir)."""
    resolution = Resolution()
    for key, (positional, role) in ROLES.items():
        entry = getattr(code, key)
        fn = resolution.resolve(entry, code.base_dir) if entry is not None else None
        if fn is None:
            continue
        shards = sharded and key == "data" and all(data_accepts(fn, n) for n in SHARD_KWARGS)
        resolution.bind(fn, entry, positional, role,
                        dict.fromkeys(SHARD_KWARGS, 0) if shards else None)
        resolution.found[key] = fn
    _resolve_builder(resolution, code.optimizer, code.base_dir, "model",
                     "the optimizer factory `fn(model, **args) -> Optimizer`",
                     _optimizer_class_problems)
    optimizer_class = (resolution.found.get("optimizer")
                       if code.optimizer is not None and code.optimizer.class_path else None)

    def scheduler_problems(cls: Callable, spec: BuilderSpec) -> list[Problem]:
        return (_scheduler_class_problems(cls, spec)
                or _scheduler_trial(cls, spec, code.optimizer, optimizer_class))
    _resolve_builder(resolution, code.scheduler, code.base_dir, "optimizer",
                     "the scheduler factory `fn(optimizer, **args) -> scheduler`",
                     scheduler_problems)
    return resolution


def _resolve_builder(resolution: Resolution, spec: BuilderSpec | None, base_dir: Path,
                     argument: str, role: str,
                     class_problems: Callable[[Callable, BuilderSpec], list[Problem]]) -> None:
    """An optimizer or scheduler: its factory resolves and binds `fn(argument, **args)`, or
    its class resolves and passes `class_problems(cls, spec)`."""
    if spec is None:
        return
    entry = spec.factory or Entrypoint(target=class_target(_class_path(spec)),
                                       key=f"{spec.key}.class")
    fn = resolution.resolve(entry, base_dir)
    if fn is None:
        return
    if spec.factory:
        resolution.bind(fn, entry, (argument,), role)
    else:
        resolution.add(class_problems(fn, spec))
    resolution.found[spec.key] = fn


def _class_path(spec: BuilderSpec) -> str:
    assert spec.class_path is not None, "a spec without a factory has a class path"
    return spec.class_path


def check_config(config: Config, sharded: bool = False) -> Callables:
    """The config's callables, once every check passed: every problem of its code, checkpoint
    and device raises one ConfigError; then the user's module failing to import raises its
    UserCodeError. Call within user_import_path(config.base_dir)."""
    resolution = resolve_user_code(config.user_code(), sharded)
    problems = resolution.file_problems + setting_problems(config.checkpoint, config.device)
    if problems:
        raise ConfigError(problems, source=str(config.path))
    if resolution.user_error is not None:
        raise resolution.user_error
    return resolution.callables()


def validate_config(config: Config) -> list[Problem]:
    """`nanaudit validate`: every problem, the user's import errors among them, in key order."""
    with user_import_path(config.base_dir):
        problems = resolve_user_code(config.user_code()).problems
    return problems + setting_problems(config.checkpoint, config.device)


def load_with_all_problems(path: str | Path,
                           overrides: Mapping[str, Any] | None = None) -> Config:
    """load_config for the commands: a file with problems in its keys also has the code it
    names resolved, so the one ConfigError lists every problem of the file."""
    draft = load_draft(path, overrides)
    if not draft.problems:
        return draft.config()
    code = draft.user_code()
    with user_import_path(code.base_dir):
        more = resolve_user_code(code).file_problems
    checkpoint = draft.values.get("checkpoint") if draft.clean("checkpoint") else None
    device = draft.values.get("device", "auto") if draft.clean("device") else "auto"
    raise ConfigError(draft.problems + more + setting_problems(checkpoint, device),
                      source=str(draft.path))


def setting_problems(checkpoint: Path | None, device: str) -> list[Problem]:
    """The checkpoint file exists and the device is there."""
    problems = []
    if checkpoint is not None and not checkpoint.is_file():
        problems.append(Problem("checkpoint", f"file not found: {checkpoint}"))
    bad_device = device_problem(device)
    if bad_device:
        problems.append(bad_device)
    return problems


def _bind_problem(fn: Callable, key: str, args: tuple, kwargs: dict, role: str) -> Problem | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without a signature: we cannot check, the call will tell
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__name__", type(fn).__name__)
        return Problem(key, f"cannot be called as {role}: {exc} (signature {name}{sig})")
    return None


def data_accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _scheduler_trial(cls: Callable, spec: BuilderSpec, optimizer: OptimizerSpec | None,
                     optimizer_class: Callable | None) -> list[Problem]:
    """Build the scheduler on a throwaway optimizer: OneCycleLR without `total_steps` binds
    but raises when built, and must be exit 3 in `validate` as in `scan`. An optimizer given
    as a class is built as the config gives it; one from a factory is not known before the
    model is built, so the scheduler must refuse both an SGD with momentum and an Adam to be
    reported (a valid pairing is never refused here; the session checks the real one)."""
    import torch
    param = [torch.nn.Parameter(torch.zeros(1))]
    if optimizer is not None and optimizer.class_path:
        if optimizer_class is None:
            return []                     # reported as the optimizer's problem
        opt_cls, kwargs = optimizer_class, dict(optimizer.kwargs)
        trials = [lambda: opt_cls(param, **kwargs)]
    else:
        trials = [lambda: torch.optim.SGD(param, lr=0.1, momentum=0.9),
                  lambda: torch.optim.Adam(param, lr=0.1)]
    refusal: Exception | None = None
    for make in trials:
        try:
            opt = make()
        except Exception:
            return []
        try:
            cls(opt, **dict(spec.kwargs))
        except (TypeError, ValueError) as exc:
            refusal = refusal or exc
            continue
        except Exception:
            return []
        return []
    first = (str(refusal).strip().splitlines() or [""])[0]
    return [Problem("scheduler", f"`{spec.class_path}` rejects these arguments: {first}")]


def _scheduler_class_problems(cls: Callable, spec: BuilderSpec) -> list[Problem]:
    """A scheduler class must be one (`LRScheduler` or `ReduceLROnPlateau`) and take the
    optimizer plus the given keyword arguments."""
    import torch
    kinds = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not (isinstance(cls, type) and issubclass(cls, kinds)):
        return [Problem("scheduler.class", f"`{spec.class_path}` is not a learning-rate "
                        f"scheduler (a subclass of torch.optim.lr_scheduler.LRScheduler or "
                        f"ReduceLROnPlateau)")]
    problem = _bind_problem(cls, "scheduler", (None,), dict(spec.kwargs),
                            f"`{spec.class_path}(optimizer, **kwargs)`")
    return [problem] if problem else []


def _optimizer_class_problems(cls: Callable, spec: BuilderSpec) -> list[Problem]:
    """The class path's keyword arguments, bound and then tried on one throwaway parameter:
    `torch.optim.SGD(lr=-1)` raises only when built, and must be a config error (exit 3) in
    `validate` and `scan` alike, not the user's code raising."""
    import torch
    problem = _bind_problem(cls, "optimizer", ([],), dict(spec.kwargs),
                            f"`{spec.class_path}(params, **kwargs)`")
    if problem:
        return [problem]
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **dict(spec.kwargs))
    except (TypeError, ValueError, RuntimeError) as exc:
        return [Problem("optimizer", f"`{spec.class_path}` rejects these arguments: {exc}")]
    except Exception:
        return []
    return []


def device_problem(device: str) -> Problem | None:
    """Why `device` is not there (no CUDA, too few devices, no MPS), or None."""
    import torch
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return Problem("device", f"`{device}` requested but CUDA is not available "
                           f"(torch {torch.__version__}); use `device: auto` or `cpu`")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            return Problem("device", f"`{device}` requested but only "
                           f"{torch.cuda.device_count()} CUDA device(s) exist")
    mps = getattr(torch.backends, "mps", None)
    if device == "mps" and not (mps is not None and mps.is_available()):
        return Problem("device", "`mps` requested but MPS is not available")
    return None
