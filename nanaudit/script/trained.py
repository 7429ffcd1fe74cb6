"""Which modules the script trains: the one place `nanaudit run` decides it.

A module is trained when an optimizer the script built holds one of its parameters (whatever
the order of its calls: a submodule of the model, an evaluation before the first step). A
script that built no optimizer updates its weights by hand; its trained modules are then those
it called with autograd as a step's first call. The hooks ask it of a call made without
autograd (a teacher's is kept as a frozen call, an evaluation of a trained model is not), and
the step tap of a call in the first step's window (code_window.untrained).

Both answers are remembered per module (a weak reference tells a new module under a dead one's
id apart), the optimizers' part until an optimizer is built or given a parameter group: a
call's question is a dict lookup.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from nanaudit.run.deepspeed_zero import is_engine

Called = tuple[weakref.ref, bool]      # (the module, whether it is a DeepSpeed engine)


class TrainedModules:
    """The optimizers the script built (weakly) and the modules it called to train."""

    def __init__(self) -> None:
        self.optimizers: list[weakref.ref] = []
        self._called: dict[int, Called] = {}
        self._held: dict[int, tuple[weakref.ref, bool]] = {}
        self._held_ids: set[int] = set()
        self._groups: tuple[int, ...] | None = None    # the param groups `_held_ids` is of

    def built(self, optimizer: Any) -> None:
        """The script built `optimizer` (those it dropped are forgotten: a script may build one
        an epoch)."""
        self.optimizers = [*(ref for ref in self.optimizers if ref() is not None),
                           weakref.ref(optimizer)]

    def training_call(self, module: torch.nn.Module) -> Called | None:
        """(a weak reference to the module, whether it is a DeepSpeed engine) when its call is
        a training forward, else None: not a call without autograd (an evaluation under
        `no_grad`), nor a module without parameters (a data transform the DataLoader calls on
        each sample, as torchvision's `Normalize`). Such modules are remembered."""
        if not torch.is_grad_enabled():
            return None
        seen = self._called.get(id(module))
        if seen is not None and seen[0]() is module:
            return seen
        if next(module.parameters(), None) is None:
            return None
        seen = self._called[id(module)] = (weakref.ref(module), is_engine(module))
        return seen

    def trains(self, module: torch.nn.Module) -> bool:
        """Whether the script trains `module` (see the module docstring)."""
        if not self.optimizers:
            seen = self._called.get(id(module))
            return seen is not None and seen[0]() is module
        groups = self._group_counts()
        if groups != self._groups:
            self._groups, self._held = groups, {}
            self._held_ids = {id(p) for ref in self.optimizers if (opt := ref()) is not None
                              for group in opt.param_groups for p in group["params"]}
        known = self._held.get(id(module))
        if known is not None and known[0]() is module:
            return known[1]
        held = any(id(p) in self._held_ids for p in module.parameters())
        self._held[id(module)] = (weakref.ref(module), held)
        return held

    def _group_counts(self) -> tuple[int, ...]:
        """Each optimizer's number of param groups (-1: collected): what the held set depends on
        (`add_param_group`, a progressive unfreezing, adds one)."""
        return tuple(len(opt.param_groups) if (opt := ref()) is not None else -1
                     for ref in self.optimizers)
