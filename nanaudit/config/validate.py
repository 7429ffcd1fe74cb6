"""`nanaudit validate`: resolve every entrypoint and bind its signature without building
anything (torchtune's approach), and check the optimizer's arguments, the checkpoint path and
the device; `scan` runs the same checks, so a problem is the same exit code in both.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

from nanaudit.config.entrypoints import class_target, resolve_callable, user_import_path
from nanaudit.config.schema import Config, Entrypoint, OptimizerSpec, SchedulerSpec
from nanaudit.errors import ConfigError, Problem, UserCodeError


def _bind_problem(fn: Callable, key: str, args: tuple, kwargs: dict, role: str) -> Problem | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins without a signature: we cannot check, the call will tell
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        return Problem(key, f"cannot be called as {role}: {exc} (signature {fn.__name__}{sig})")
    return None


def data_accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def validate_config(config: Config) -> list[Problem]:
    """Resolve every entrypoint and check it can be called as nanaudit will call it."""
    problems: list[Problem] = []
    checks = [
        (config.model, (), "the model factory `fn(**args) -> nn.Module`"),
        (config.data, (), "the data factory `fn(**args) -> iterable of batches`"),
        (config.loss, ("model", "batch"), "the loss `fn(model, batch, **args) -> scalar tensor`"),
        (config.step, ("model", "batch", "optimizer"),
         "the step `fn(model, batch, optimizer, **args) -> loss or {name: loss}`"),
    ]
    with user_import_path(config.base_dir):
        for entry, positional, role in checks:
            if entry is None:
                continue
            try:
                fn = resolve_callable(entry, config.base_dir)
            except ConfigError as exc:
                problems += exc.problems
                continue
            except UserCodeError as exc:
                problems.append(Problem(entry.key, str(exc)))
                continue
            problem = _bind_problem(fn, entry.key, positional, dict(entry.args), role)
            if problem:
                problems.append(problem)
        problems += _validate_optimizer(config.optimizer, config.base_dir)
        problems += _validate_scheduler(config.scheduler, config.base_dir, config.optimizer)
    if config.checkpoint is not None and not config.checkpoint.is_file():
        problems.append(Problem("checkpoint", f"file not found: {config.checkpoint}"))
    bad_device = device_problem(config.device)
    if bad_device:
        problems.append(bad_device)
    return problems


def _validate_optimizer(spec: OptimizerSpec | None, base_dir: Path) -> list[Problem]:
    return _validate_builder(spec, base_dir, "model",
                             "the optimizer factory `fn(model, **args) -> Optimizer`",
                             optimizer_class_problems)


def _validate_scheduler(spec: SchedulerSpec | None, base_dir: Path,
                        optimizer: OptimizerSpec | None = None) -> list[Problem]:
    def class_problems(cls, spec):
        return scheduler_class_problems(cls, spec) or _scheduler_trial(cls, spec, optimizer,
                                                                       base_dir)
    return _validate_builder(spec, base_dir, "optimizer",
                             "the scheduler factory `fn(optimizer, **args) -> scheduler`",
                             class_problems)


def _validate_builder(spec, base_dir: Path, argument: str, role: str,
                      class_problems: Callable) -> list[Problem]:
    """An optimizer or scheduler: its factory resolves and binds `fn(argument, **args)`, or
    its class resolves and passes `class_problems(cls, spec)`."""
    if spec is None:
        return []
    entry = spec.factory or Entrypoint(target=class_target(spec.class_path),
                                       key=f"{spec.key}.class")
    try:
        fn = resolve_callable(entry, base_dir)
    except ConfigError as exc:
        return exc.problems
    except UserCodeError as exc:
        return [Problem(entry.key, str(exc))]
    if spec.factory:
        problem = _bind_problem(fn, entry.key, (argument,), dict(entry.args), role)
        return [problem] if problem else []
    return class_problems(fn, spec)


def _scheduler_trial(cls, spec: SchedulerSpec, optimizer: OptimizerSpec | None,
                     base_dir: Path) -> list[Problem]:
    """Build the scheduler on a throwaway optimizer: OneCycleLR without `total_steps` binds
    but raises when built, and must be exit 3 in `validate` as in `scan`. An optimizer given
    as a class is built as the config gives it; one from a factory is not known before the
    model is built, so the scheduler must refuse both an SGD with momentum and an Adam to be
    reported (a valid pairing is never refused here; `scan` checks the real one)."""
    import torch
    param = [torch.nn.Parameter(torch.zeros(1))]
    if optimizer is not None and optimizer.class_path:
        try:
            opt_cls = resolve_callable(Entrypoint(class_target(optimizer.class_path),
                                                  "optimizer.class"), base_dir)
        except (ConfigError, UserCodeError):
            return []                     # reported as the optimizer's problem
        trials = [lambda: opt_cls(param, **dict(optimizer.kwargs))]
    else:
        trials = [lambda: torch.optim.SGD(param, lr=0.1, momentum=0.9),
                  lambda: torch.optim.Adam(param, lr=0.1)]
    refusal = None
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


def scheduler_class_problems(cls, spec: SchedulerSpec) -> list[Problem]:
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


def optimizer_class_problems(cls, spec: OptimizerSpec) -> list[Problem]:
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
    import torch
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return Problem("device", f"`{device}` requested but CUDA is not available "
                           f"(torch {torch.__version__}); use `device: auto` or `cpu`")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            return Problem("device", f"`{device}` requested but only "
                           f"{torch.cuda.device_count()} CUDA device(s) exist")
    if device == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        return Problem("device", "`mps` requested but MPS is not available")
    return None
