"""The script's objects nanaudit keeps track of (the models it called, the optimizers it
stepped, the modules it hooked), by id, let go once the script has let go of them.

A script that trains models in turn (k-fold cross-validation, a sweep, one trial after another)
drops each when it is done; plain Python frees it, and so must a run under nanaudit: holding
every model and optimizer to the end held their weights, gradients and optimizer state, on the
GPU too. They are held (the report after a trip reads them, when the script's own names for them
are gone), and when a new one is registered, those only nanaudit still holds are let go, and
what was learned of each (its parameters' names, its last update) is forgotten with it: its id
goes to the next object at that address. Before one goes, its owner may take a last look and
keep it (`keep`): an optimizer's last update is read then, as the end of the script reads the
last updates of those it still holds (a fold whose last update left NaN weights, which the
script saved, is a finding), and a model stays while an optimizer still held trains it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def _refs_alone() -> int:
    """What `sys.getrefcount` says of an object held by one dict alone (calibrated, not
    assumed: interpreters count the call's own reference differently)."""
    held = {0: object()}
    return sys.getrefcount(held[0])


_ALONE = _refs_alone()


class LiveObjects:
    """id -> object, in the order first registered. `forget(id)` is called for each let go;
    `keep(object)`, asked of each only nanaudit holds, true: held still."""

    def __init__(self, forget: Callable[[int], None] | None = None,
                 keep: Callable[[Any], bool] | None = None) -> None:
        self._objects: dict[int, Any] = {}
        self.forget = forget
        self.keep = keep

    def __setitem__(self, key: int, obj: Any) -> None:
        if self._objects.get(key) is obj:
            return                        # every step registers its optimizer again: cheap
        self.let_go()
        self._objects[key] = obj

    def let_go(self) -> None:
        """Let go of those only nanaudit holds (and `keep` does not keep)."""
        # `self._objects[k]` in the call itself: the count `_ALONE` was calibrated that way
        alone = [k for k in self._objects if sys.getrefcount(self._objects[k]) <= _ALONE]
        for key in alone:
            if self.keep is not None and self.keep(self._objects[key]):
                continue
            del self._objects[key]
            if self.forget is not None:
                self.forget(key)

    def get(self, key: int) -> Any:
        return self._objects.get(key)

    def __contains__(self, key: int) -> bool:
        return key in self._objects

    def values(self) -> list:
        """The objects, oldest first."""
        return list(self._objects.values())

    def __len__(self) -> int:
        return len(self._objects)

    def discard(self, key: int) -> None:
        """No longer tracked, and nothing forgotten."""
        self._objects.pop(key, None)


def holds_hook(hooked: dict[int, Any], module: torch.nn.Module) -> bool:
    """Whether `hooked` (id(module) -> its forward hook's handle) holds one on `module`. A
    handle whose hooks are not this module's was a freed module's, at the same address."""
    handle = hooked.get(id(module))
    return handle is not None and handle.hooks_dict_ref() is module._forward_hooks
