"""Resolve the config's entrypoints (`pkg.mod:fn` or `file.py:fn`) to the user's callables.

The config's folder is on `sys.path` only inside `user_import_path`, so `case:build_model`
beside the YAML imports, and nothing leaks into the interpreter after the run. Inside
`import_gate(gate)` every entrypoint's module is shown to `gate` before it is imported (a
replay vets what a bundle names: commands/bundle_trust.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from nanaudit.config.schema import Entrypoint
from nanaudit.config.values import did_you_mean
from nanaudit.errors import USER_FAILURES, ConfigError, Problem, UserCodeError, a_kind_of

_GATES: list[Callable[[Entrypoint, Path], None]] = []


@contextlib.contextmanager
def import_gate(gate: Callable[[Entrypoint, Path], None]) -> Iterator[None]:
    """`gate(entry, base_dir)` is called before each entrypoint's module is imported; it
    raises to refuse the import."""
    _GATES.append(gate)
    try:
        yield
    finally:
        _GATES.remove(gate)


@contextlib.contextmanager
def user_import_path(base_dir: Path) -> Iterator[None]:
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
                                       f"`{entry.attr_part}`" + did_you_mean(part, names))])
        obj = getattr(obj, part)
    return obj


def resolve_callable(entry: Entrypoint, base_dir: Path) -> Callable:
    """resolve(), and ConfigError when what it names cannot be called."""
    obj = resolve(entry, base_dir)
    if not callable(obj):
        raise ConfigError([Problem(entry.key, f"`{entry.target}` is {a_kind_of(obj)}, "
                                   f"not a callable")])
    return obj


def _import_module(entry: Entrypoint, base_dir: Path) -> ModuleType:
    for gate in _GATES:
        gate(entry, base_dir)
    module_part = entry.module_part
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        return _import_file(entry, base_dir)
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_part == missing or module_part.startswith(missing + "."):
            raise ConfigError([Problem(entry.key, f"module `{module_part}` not found (looked "
                                       f"on sys.path and in the config's folder {base_dir})")]
                              ) from None
        raise UserCodeError(f"importing `{module_part}`", exc) from exc
    except USER_FAILURES as exc:
        raise UserCodeError(f"importing `{module_part}`", exc) from exc


def _import_file(entry: Entrypoint, base_dir: Path) -> ModuleType:
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
    except USER_FAILURES as exc:
        del sys.modules[name]
        raise UserCodeError(f"importing `{entry.module_part}`", exc) from exc
    return module


def class_target(class_path: str) -> str:
    """`torch.optim.AdamW` as an entrypoint target, `torch.optim:AdamW`."""
    module, _, name = class_path.rpartition(".")
    return f"{module}:{name}"
