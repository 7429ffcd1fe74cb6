"""Which nn.Module is running: the stack of the running modules' qualified names, kept by
global forward hooks for the length of a traced replay (after PyTorch's ModTracker).

Global hooks leave the user's model untouched: nothing is registered on its modules, and every
hook has a handle removed on exit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from nanaudit.run.names import user_named


class ModuleStack:
    """The innermost running module of `model` while entered: `with ModuleStack(model) as m:`
    ... `m.current`."""

    def __init__(self, model: torch.nn.Module, others: dict[int, str] | None = None,
                 owners: dict[int, str] | None = None):
        # `others`: id -> name of modules outside `model` the step may call (nanaudit run's
        # ledger: a GAN's critic called in the loss code); `owners`: id(parameter) -> the
        # name of the module that holds it, for those modules
        named = list(user_named(model, model.named_modules()))
        self.names = {**(others or {}), **{id(m): n for n, m in named}}
        self.owners = {**(owners or {}),
                       **{id(p): n for n, m in named for p in m.parameters(recurse=False)}}
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> ModuleStack:
        self.handles = [register_module_forward_pre_hook(self._push),
                        register_module_forward_hook(self._pop, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _push(self, module: torch.nn.Module, args: tuple) -> None:
        self.stack.append(self.names.get(id(module), f"<{type(module).__name__}>"))

    def _pop(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    def owner(self, tensors: list) -> str | None:
        """The module holding the first parameter among `tensors`: an op run outside every
        module's forward (a module's ops replayed from the recorded loss code, a generator
        called there) that reads a module's weight is that module's op."""
        return next((self.owners[id(t)] for t in tensors if id(t) in self.owners), None)

    @property
    def current(self) -> str | None:
        """The innermost running module; None outside every module's forward (the loss)."""
        return self.stack[-1] if self.stack else None
