"""The step's first module call of a `torch.compile`d model, heard outside the compiled code.

`nanaudit run` hears a step's first module call with a global forward pre-hook (hooks.py). A
compiled model must never meet that hook: `torch.compile(model)` warns about global hooks on
every call while one is registered, and a module compiled in place (`model.compile()`) runs
its hooks inside the compiled `_call_impl`, where dynamo traces ours (a graph break on
`sys._getframe`, another on the hook's handle) and guards on the global hook dictionaries, so
registering and removing the hook each step recompiles the user's program.

So the two entries into compiled code are wrapped where they are still plain Python, before
dynamo runs: `OptimizedModule.__call__` (what `torch.compile(model)` returns) and the
`_compiled_call_impl` that `Module.compile()` puts on a module. While the hooks wait for a
step's first call, the wrapper takes the call as that first call (in the user's module, with
its keyword arguments) and removes the global hook before the compiled code runs; a call that
is not the training forward (an evaluation under `no_grad`) runs without the hook too, and the
wait resumes after it. The step's call's output is handed to the hooks when it returns, still
outside the compiled code (the step record's loss code starts there), and a compiled call runs
with the loss code's recording mode popped. Between steps dynamo sees exactly the hooks the
user's own run has: none. `torch.compile` and `Module.compile` are wrapped to install this
when the script first compiles (dynamo is not imported for a script that never compiles), and
everything is restored on exit.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nanaudit.errors import delegates


class Waiting(Protocol):
    """What the script's hooks expose to this module (hooks.ScriptHooks)."""

    @property
    def waiting(self) -> bool: ...
    def stop_waiting(self) -> None: ...
    def await_forward(self) -> None: ...
    def take_first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                        entry: Any) -> bool: ...
    def compiled_returned(self, module: torch.nn.Module, output: Any) -> None: ...
    def outside_record(self, call: Callable[[], Any]) -> Any: ...


class CompiledCalls:
    """Installs and removes the wrappers of the module docstring for one script run."""

    def __init__(self, hooks: Waiting):
        self.hooks = hooks
        self._restore: list[Callable[[], None]] = []
        self._class_wrapped = False
        self._instances: list[tuple[weakref.ref, Any]] = []

    def install(self) -> CompiledCalls:
        compile_fn, module_compile = torch.compile, torch.nn.Module.compile

        @delegates
        @functools.wraps(compile_fn)
        def compile(*args: Any, **kwargs: Any) -> Any:
            compiled = compile_fn(*args, **kwargs)
            self._wrap_optimized_module()
            return compiled

        @delegates
        @functools.wraps(module_compile)
        def compile_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            module_compile(module, *args, **kwargs)
            self._wrap_instance(module)

        torch.compile = compile
        torch.nn.Module.compile = compile_module  # type: ignore[method-assign,assignment]
        self._restore += [lambda: setattr(torch, "compile", compile_fn),
                          lambda: setattr(torch.nn.Module, "compile", module_compile)]
        if "torch._dynamo.eval_frame" in sys.modules:
            self._wrap_optimized_module()    # a library imported dynamo: it may compile too
        return self

    def remove(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        for ref, original in self._instances:
            module = ref()
            if module is not None:
                module._compiled_call_impl = original
        self._instances = []
        self._class_wrapped = False

    def _entering(self, module: torch.nn.Module, entry: Any, args: tuple, kwargs: dict) -> bool:
        """Before a compiled call: no global hook stays for the compiled code; the call is the
        step's first if the hooks wait for one and it trains. True: wait again after it."""
        hooks = self.hooks
        if not hooks.waiting:
            return False
        hooks.stop_waiting()
        return not hooks.take_first_call(module, args, kwargs, entry)

    @delegates
    def _calling(self, module: torch.nn.Module, entry: Any, call: Callable[..., Any],
                 args: tuple, kwargs: dict) -> Any:
        waiting = self.hooks.waiting
        resume = self._entering(module, entry, args, kwargs)
        try:
            # Never under the step record's mode (a compiled call inside the loss code, as a
            # second model's): dynamo would trace it, break its graph and guard on it.
            output = self.hooks.outside_record(lambda: call(*args, **kwargs))
        finally:
            if resume:
                self.hooks.await_forward()
        if waiting and not resume:
            # The step's call returned, outside the compiled code: its output, for the step
            # record (the module's forward hook never runs for a compiled call).
            self.hooks.compiled_returned(module, output)
        return output

    def _wrap_optimized_module(self) -> None:
        if self._class_wrapped:
            return
        from torch._dynamo.eval_frame import OptimizedModule
        original = OptimizedModule.__call__

        @delegates
        @functools.wraps(original)
        def call(optimized: Any, *args: Any, **kwargs: Any) -> Any:
            return self._calling(optimized._orig_mod, optimized,
                                 functools.partial(original, optimized), args, kwargs)
        OptimizedModule.__call__ = call  # type: ignore[method-assign,assignment]
        self._restore.append(lambda: setattr(OptimizedModule, "__call__", original))
        self._class_wrapped = True

    def _wrap_instance(self, module: torch.nn.Module) -> None:
        """`module.compile()` set `_compiled_call_impl`, which `Module.__call__` calls
        instead of `_call_impl`: the module's hooks (and the global ones) run inside it."""
        original = module.__dict__.get("_compiled_call_impl")
        if original is None:
            return

        @delegates
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._calling(module, module, original, args, kwargs)
        module._compiled_call_impl = call
        self._instances.append((weakref.ref(module), original))
