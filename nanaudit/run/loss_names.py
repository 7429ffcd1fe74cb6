"""The names of the losses a user's step differentiates, learnt from what its calls return.

A step returns its losses (a tensor, a tuple, or a dict of named ones); the checks before each
update see them earlier, as the tensors `backward` ran on. A finding names a bad loss by the
name the step returned it under: learnt from earlier calls, by the loss's place among those a
call differentiates, else by the loss each optimizer stepped on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch


class Gated(Protocol):
    """An update point a check saw (user_step.UpdatePoint): its optimizer and losses."""

    name: str
    losses: list


class LossNames:
    """The names learnt from a step's calls, and the losses the last call returned."""

    def __init__(self) -> None:
        self.returned: dict[str, torch.Tensor] = {}   # the last call's losses, as returned
        self._named: dict[int, str] = {}   # id(checked loss) -> the name it was returned under
        self._names_at: list[str | None] = []   # names by differentiation order in a call
        self._loss_of: dict[str, str] = {}      # optimizer name -> the loss it stepped on

    def begin(self) -> None:
        """A new call: nothing returned yet."""
        self.returned = {}

    def name(self, position: int, optimizer_name: str) -> str | None:
        """A differentiated loss's name, learnt from the dicts earlier calls returned: by its
        place in the call, else the loss this optimizer stepped on."""
        if position < len(self._names_at) and self._names_at[position]:
            return self._names_at[position]
        return self._loss_of.get(optimizer_name)

    def named_losses(self, returned: Any, gated: Sequence[Gated]) -> dict[str, torch.Tensor]:
        """The floating scalar tensors the call returned, by name (logits, counts and Python
        floats beside them are not losses); a loss no check saw is detached for the loop."""
        if isinstance(returned, Mapping):
            items = [(str(k), v) for k, v in returned.items()]
        elif isinstance(returned, (list, tuple)):
            items = [(f"[{i}]", v) for i, v in enumerate(returned)]
        else:
            items = [("loss", returned)]
        losses = {n: v for n, v in items if isinstance(v, torch.Tensor)
                  and v.is_floating_point() and v.numel() == 1}
        if len(losses) == 1 and not isinstance(returned, Mapping):
            losses = {"loss": next(iter(losses.values()))}
        self.returned = losses
        checked = [t for point in gated for t in point.losses]
        ids = {id(t) for t in checked}
        out: dict[str, torch.Tensor] = {}
        self._named = {}
        for n, t in losses.items():
            seen = t if id(t) in ids else _alias_of(t, checked)
            if seen is not None:
                self._named[id(seen)] = n
            out[n] = seen if seen is not None else t.detach()
        return out

    def learn(self, backwarded: Sequence[torch.Tensor], gated: Sequence[Gated]) -> None:
        """Learn each name from the call just made: by place among the losses it
        differentiated (`backwarded`, in order), and by the optimizer that stepped on it."""
        ids = {**{id(t): n for n, t in self.returned.items()}, **self._named}
        if not ids:
            return
        for i, t in enumerate(backwarded):
            name = ids.get(id(t))
            if name:
                self._names_at += [None] * (i + 1 - len(self._names_at))
                self._names_at[i] = name
        for point in gated:
            for t in point.losses:
                if id(t) in ids:
                    self._loss_of[point.name] = ids[id(t)]


def _alias_of(tensor: torch.Tensor, checked: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The checked loss a returned `loss.detach()` shares its storage with (no read needed)."""
    try:
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        for t in checked:
            if (t.untyped_storage().data_ptr(), t.storage_offset()) == where:
                return t
    except (RuntimeError, NotImplementedError):
        return None
    return None
