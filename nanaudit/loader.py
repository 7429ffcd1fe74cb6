"""Resolve the config's entrypoints and build the run: model, data, loss, optimizer, device.

`validate_config` resolves every entrypoint and binds its signature without building anything
(torchtune's approach); `build_session` then calls the user's factories. The config's folder is
on `sys.path` only inside `user_import_path`, so `case:build_model` beside the YAML imports, and
nothing leaks into the interpreter after the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from nanaudit.config import Config, Entrypoint, OptimizerSpec
from nanaudit.errors import ConfigError, Problem, UserCodeError, call_user


@contextlib.contextmanager
def user_import_path(base_dir: Path):
    """Make the config's folder importable for the duration of the run, then restore sys.path."""
    entry = str(base_dir)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    before = set(sys.modules)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)
        # Forget modules imported from the config's folder, so a later run in this process
        # (the library API, a test) imports its own `case.py`, not this one's.
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if origin.startswith(entry + os.sep):
                del sys.modules[name]


def resolve(entry: Entrypoint, base_dir: Path) -> Any:
    """Import the entrypoint's module and return its attribute; ConfigError when it is not there."""
    module = _import_module(entry, base_dir)
    obj = module
    for part in entry.attr_part.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(module) if not n.startswith("_")]
            raise ConfigError([Problem(entry.key, f"`{entry.module_part}` has no attribute "
                                       f"`{entry.attr_part}`" + _did_you_mean(part, names))])
        obj = getattr(obj, part)
    return obj


def resolve_callable(entry: Entrypoint, base_dir: Path) -> Callable:
    obj = resolve(entry, base_dir)
    if not callable(obj):
        raise ConfigError([Problem(entry.key, f"`{entry.target}` is a {type(obj).__name__}, "
                                   f"not a callable")])
    return obj


def _did_you_mean(name: str, candidates: Iterable[str]) -> str:
    import difflib
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _import_module(entry: Entrypoint, base_dir: Path):
    module_part = entry.module_part
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        return _import_file(entry, base_dir)
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_part == missing or module_part.startswith(missing + "."):
            raise ConfigError([Problem(entry.key, f"module `{module_part}` not found (looked on "
                                       f"sys.path and in the config's folder {base_dir})")]) from None
        raise UserCodeError(f"importing `{module_part}`", exc) from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise UserCodeError(f"importing `{module_part}`", exc) from exc


def _import_file(entry: Entrypoint, base_dir: Path):
    path = Path(entry.module_part).expanduser()
    path = path if path.is_absolute() else (base_dir / path)
    if not path.is_file():
        raise ConfigError([Problem(entry.key, f"file `{entry.module_part}` not found "
                                   f"(resolved to {path})")])
    # A name unique to the file, so two configs' `model.py` never collide in sys.modules.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"_nanaudit_user_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError([Problem(entry.key, f"cannot import {path} as Python")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        del sys.modules[name]
        raise UserCodeError(f"importing `{entry.module_part}`", exc) from exc
    return module


# --- signature checks, without building anything -------------------------------------------

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
    ]
    with user_import_path(config.base_dir):
        for entry, positional, role in checks:
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
    if config.checkpoint is not None and not config.checkpoint.is_file():
        problems.append(Problem("checkpoint", f"file not found: {config.checkpoint}"))
    device_problem = _device_problem(config.device)
    if device_problem:
        problems.append(device_problem)
    return problems


def _validate_optimizer(spec: OptimizerSpec | None, base_dir: Path) -> list[Problem]:
    if spec is None:
        return []
    entry = spec.factory or Entrypoint(target=_class_target(spec.class_path), key="optimizer.class")
    try:
        fn = resolve_callable(entry, base_dir)
    except ConfigError as exc:
        return exc.problems
    except UserCodeError as exc:
        return [Problem(entry.key, str(exc))]
    if spec.factory:
        problem = _bind_problem(fn, entry.key, ("model",), dict(entry.args),
                                "the optimizer factory `fn(model, **args) -> Optimizer`")
        return [problem] if problem else []
    return _optimizer_class_problems(fn, spec)


def _optimizer_class_problems(cls, spec: OptimizerSpec) -> list[Problem]:
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
    except Exception:  # noqa: BLE001 - a user class may refuse a dummy parameter: build tells
        return []
    return []


def _class_target(class_path: str) -> str:
    module, _, name = class_path.rpartition(".")
    return f"{module}:{name}"


def _device_problem(device: str) -> Problem | None:
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


def resolve_device(device: str):
    import torch
    problem = _device_problem(device)
    if problem:
        raise ConfigError([problem])
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# --- building the run ------------------------------------------------------------------------

@dataclass
class Session:
    """Everything a step needs, built from the config. `make_data` starts the data afresh."""

    config: Config
    device: Any
    model: Any
    optimizer: Any
    loss_fn: Callable
    make_data: Callable[[], Iterable]
    param_names: dict          # id(parameter) -> qualified name
    precision: Any = None      # nanaudit.precision.Precision; built from the config if None
    coordinator: Any = None    # nanaudit.distributed.Coordinator under torchrun

    def __post_init__(self):
        if self.precision is None:
            from nanaudit.precision import Precision
            self.precision = Precision(self.config, self.device)

    @property
    def local_model(self):
        """The user's module itself, without a DistributedDataParallel wrapper."""
        return getattr(self.model, "module", self.model) if self.coordinator else self.model

    def compute_loss(self, batch):
        return self.loss_fn(self.model, batch, **dict(self.config.loss.args))


def seed_everything(seed: int) -> None:
    import torch
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    try:
        import numpy
        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def build_session(config: Config, coordinator=None) -> Session:
    """Build model, optimizer, loss and data from the config; call within user_import_path.
    Under torchrun (`coordinator`), the model is wrapped in DDP and the data sharded."""
    import torch
    device = resolve_device(config.device)
    if coordinator is not None:
        device = coordinator.device(device)
    if config.seed is not None:
        seed_everything(config.seed)
    model_fn = resolve_callable(config.model, config.base_dir)
    model = call_user(f"model factory `{config.model.target}`", model_fn, **dict(config.model.args))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([Problem(config.model.key, f"`{config.model.target}` returned a "
                                   f"{type(model).__name__}, not a torch.nn.Module")])
    checkpoint = load_checkpoint(config.checkpoint) if config.checkpoint else None
    if checkpoint is not None:
        apply_model_state(model, checkpoint, "checkpoint", str(config.checkpoint))
    model.to(device)
    model.train()
    optimizer = build_optimizer(config, model)
    wrapped = coordinator.wrap(model, device) if coordinator is not None else model
    if checkpoint is not None and optimizer is not None and "optimizer" in checkpoint.raw:
        call_user("loading the checkpoint's optimizer state", optimizer.load_state_dict,
                  checkpoint.raw["optimizer"])
    data_fn = resolve_callable(config.data, config.base_dir)
    loss_fn = resolve_callable(config.loss, config.base_dir)
    names = {id(p): n for n, p in model.named_parameters()}

    shards_itself = (coordinator is not None and data_accepts(data_fn, "rank")
                     and data_accepts(data_fn, "world_size"))

    def make_data():
        what = f"data factory `{config.data.target}`"
        kwargs = dict(config.data.args)
        if shards_itself:
            kwargs.update(rank=coordinator.rank, world_size=coordinator.world_size)
        data = call_user(what, data_fn, **kwargs)
        if not _is_iterable(data):
            raise ConfigError([Problem(config.data.key, f"`{config.data.target}` returned a "
                                       f"{type(data).__name__}, which is not iterable; return a "
                                       f"list, generator or DataLoader of batches")])
        if coordinator is not None:
            data = coordinator.shard(data, shards_itself)
        return data

    return Session(config, device, wrapped, optimizer, loss_fn, make_data, names,
                   coordinator=coordinator)


def _is_iterable(obj) -> bool:
    import torch
    if isinstance(obj, (str, bytes, torch.Tensor)):
        return False
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def build_optimizer(config: Config, model):
    import torch
    spec = config.optimizer
    if spec is None:
        return None
    if spec.factory:
        fn = resolve_callable(spec.factory, config.base_dir)
        opt = call_user(f"optimizer factory `{spec.factory.target}`", fn, model,
                        **dict(spec.factory.args))
        where, target = spec.factory.key, spec.factory.target
    else:
        cls = resolve_callable(Entrypoint(_class_target(spec.class_path), "optimizer.class"),
                               config.base_dir)
        problems = _optimizer_class_problems(cls, spec)
        if problems:
            raise ConfigError(problems, source=str(config.path))
        opt = call_user(f"optimizer `{spec.class_path}`", cls, model.parameters(),
                        **dict(spec.kwargs))
        where, target = "optimizer.class", spec.class_path
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError([Problem(where, f"`{target}` gave a {type(opt).__name__}, "
                                   f"not a torch.optim.Optimizer")])
    return opt


@dataclass
class Checkpoint:
    model_state: dict
    raw: dict
    path: str


def load_checkpoint(path: Path, key: str = "checkpoint", weights_only: bool = True) -> Checkpoint:
    """Load a state_dict, or a dict holding one under `model` / `state_dict`, safely."""
    import pickle
    import torch
    if not Path(path).is_file():
        raise ConfigError([Problem(key, f"file not found: {path}")])
    if not _looks_like_torch_save(Path(path)):
        raise ConfigError([Problem(key, f"{path} is not a loadable checkpoint: neither a "
                                   f"torch.save archive nor a legacy pickle (truncated or "
                                   f"another format?)")])
    try:
        raw = torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        if "weights only" not in str(exc).lower():
            raise ConfigError([Problem(key, f"{path} is not a loadable checkpoint: "
                                       f"{str(exc).strip().splitlines()[0]}")]) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling failed"
        raise ConfigError([Problem(key, f"{path} cannot be loaded with weights_only=True "
                                   f"(it holds more than tensors and plain containers: {first}); "
                                   f"re-save it as a state_dict")]) from None
    except Exception as exc:  # noqa: BLE001 - corrupt zip, truncated file, ...
        raise ConfigError([Problem(key, f"{path} is not a loadable checkpoint: "
                                   f"{type(exc).__name__}: {exc}")]) from None
    if not isinstance(raw, dict):
        raise ConfigError([Problem(key, f"{path} holds a {type(raw).__name__}; expected a "
                                   f"state_dict or a dict with a `model` entry")])
    for name in ("model", "state_dict", "model_state_dict"):
        if isinstance(raw.get(name), dict):
            return Checkpoint(raw[name], raw, str(path))
    return Checkpoint(raw, {}, str(path))


def _looks_like_torch_save(path: Path) -> bool:
    import zipfile
    with open(path, "rb") as handle:
        head = handle.read(2)
    return zipfile.is_zipfile(path) or head[:1] == b"\x80"


def apply_model_state(model, checkpoint: Checkpoint, key: str, label: str) -> None:
    """load_state_dict strictly, turning mismatches into one error that lists the keys."""
    own = set(model.state_dict().keys())
    given = set(checkpoint.model_state.keys())
    missing, unexpected = sorted(own - given), sorted(given - own)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys: {_short_list(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {_short_list(unexpected)}")
        raise ConfigError([Problem(key, f"{label} does not match the model: " + "; ".join(parts))])
    try:
        model.load_state_dict(checkpoint.model_state, strict=True)
    except RuntimeError as exc:
        raise ConfigError([Problem(key, f"{label} does not match the model: "
                                   f"{str(exc).strip()}")]) from None


def _short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
