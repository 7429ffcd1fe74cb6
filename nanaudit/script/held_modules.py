"""The modules a script holds besides the ones it called first in a step, by the names it gave
them: a GAN's critic called in the loss code, a teacher, an EMA copy. Without them a finding
names a parameter by its shape (`<parameter (32, 8)>`) and a module by its class (`<Linear>`).

Read from the user's frames on the stack at a trip (their locals, module-level globals among
them, and the attributes of a `self` that is not a module itself, as a trainer class holds its
models), outermost first: the name the script's top level gave a module wins over a helper's
parameter name for it (`model` in `def train_step(model, batch)`). Trip time only: nothing
here runs on a clean step."""

from __future__ import annotations

from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch

from nanaudit.run.loss_code import is_user_file


def held_modules(frame: FrameType | None) -> list[tuple[str, torch.nn.Module]]:
    """(the variable's name, the module) for every module the user's frames from `frame`
    outward hold, each once, outermost frame first."""
    frames = []
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            frames.append(frame)
        frame = frame.f_back
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    for held in reversed(frames):
        for name, value in _variables(held.f_locals):
            if isinstance(value, torch.nn.Module) and id(value) not in seen:
                seen.add(id(value))
                found.append((name, value))
    return found


def _variables(names: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, value in list(names.items()):
        if name == "self" and not isinstance(value, torch.nn.Module):
            yield from list(getattr(value, "__dict__", {}).items())
        elif not name.startswith("__"):
            yield name, value


def innermost_frame(exc: BaseException) -> FrameType | None:
    """The frame an exception was raised in (its traceback keeps the frames it unwound)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None
