"""Load a checkpoint safely (`weights_only=True`) and apply it strictly, turning a mismatch
into one config error that lists the keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanaudit.errors import ConfigError, Problem
from nanaudit.run.names import unwrapped, user_path


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
    except Exception as exc:
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


def apply_model_state(model: Any, checkpoint: Checkpoint, key: str, label: str) -> None:
    """load_state_dict strictly, turning mismatches into one error that lists the keys. A
    model a wrapper holds (`torch.compile(model)`) takes the user's module's state, its keys
    with or without the wrapper's prefix (as nanoGPT strips `_orig_mod.`)."""
    state = checkpoint.model_state
    inner = unwrapped(model)
    if inner is not model:
        state = {user_path(model, name): value for name, value in state.items()}
        model, checkpoint = inner, Checkpoint(state, checkpoint.raw, checkpoint.path)
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
