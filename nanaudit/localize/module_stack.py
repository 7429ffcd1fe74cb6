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

    def __init__(self, model: torch.nn.Module, others: dict[int, str] | None = None):
        # `others`: id -> name of modules outside `model` the step may call (nanaudit run's
        # ledger: a GAN's critic called in the loss code)
        self.names = {**(others or {}),
                      **{id(m): n for n, m in user_named(model, model.named_modules())}}
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
        self.stack.append(self._named(module))

    def name_of(self, module: Any) -> str | None:
        """The user's name of `module` (`<Linear>` for one it does not know; None: no module)."""
        return self._named(module) if isinstance(module, torch.nn.Module) else None

    def _named(self, module: torch.nn.Module) -> str:
        return self.names.get(id(module), f"<{type(module).__name__}>")

    def _pop(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str | None:
        """The innermost running module; None outside every module's forward (the loss)."""
        return self.stack[-1] if self.stack else None
