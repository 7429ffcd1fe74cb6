"""The global hooks `nanaudit run` puts into an unmodified script, all removed on exit.

Nothing in the script changes. What is installed, and what each tells the auditor:

* an optimizer step pre-hook: the step's check, before the update; for an optimizer stepped
  with a closure (Lightning, LBFGS) forward and backward run inside `step()`, so the closure is
  wrapped and the check runs each time it returns (intercept.py);
* an optimizer step post-hook: counts the step (the step is the optimizer step, so gradient
  accumulation's micro-batches belong to the step they feed);
* a module forward pre-hook, registered only while waiting for a step's first module call (the
  outermost one) and removed in it, so the rest of the forward keeps PyTorch's hook-free path;
  a compiled model's call is heard before its compiled code runs, which never meets the hook
  (compiled_calls.py);
* the loss tap (intercept.py): the scalar reaching `backward`, unscaled, kept on the device
  until the step's read;
* `GradScaler.step` wrapped: a step the scaler skips (inf gradients) is heard, as a step
  skipped (its optimizer's step hooks never run);
* a DeepSpeed engine's ZeRO optimizer's `step` wrapped (on the instance, when the engine is
  first called): every stage steps the torch optimizer once per part (ZeRO-1/2 per param
  group, ZeRO-3 per sub-group), so the ZeRO step is the step, checked once at its entry, and a
  step DeepSpeed skips is told as such (zero_steps.py);
* `Optimizer.__init__` wrapped to count the optimizers the script builds: a script that builds
  none updates its weights by hand, and each backward is then its step;
* `torch.nn.utils.clip_grad_norm_` wrapped: the total norm it returns (before clipping, what
  the script's log prints) is kept on the device for the step's one read, whose timeline
  shows it as the step's gradient norm (the check reads the gradients as clipped).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from nanaudit.errors import delegates
from nanaudit.run.check.scope import BufferScope
from nanaudit.run.intercept import LossTap, checked_closure_args
from nanaudit.script.compiled_calls import CompiledCalls
from nanaudit.script.ledger import Ledger
from nanaudit.script.step_log import StepLog
from nanaudit.script.step_tap import StepTap
from nanaudit.script.step_values import caller_kwargs, continues_graph
from nanaudit.script.trained import TrainedModules
from nanaudit.script.warning_site import show_at_script_lines
from nanaudit.script.zero_steps import ZeroSteps


class Listener(Protocol):
    """What the hooks tell (the auditor); `log`, its timeline, a ZeRO step tells directly."""

    log: StepLog
    buffers: BufferScope      # the floating buffers the check reads
    ledger: Ledger            # what the script holds, and the names it holds them by

    def first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None: ...
    def loss(self, loss: torch.Tensor) -> None: ...
    def backward_started(self) -> None: ...
    def backward_ended(self, raised: bool) -> None: ...
    def update_starting(self) -> None: ...
    def before_update(self, optimizer: Any, evaluation: int | None) -> None: ...
    def after_update(self, optimizer: Any) -> None: ...
    def scaling(self, scaler: Any) -> None: ...
    def scaler_skipped(self, optimizer: Any, scaler: Any) -> None: ...
    def scale_skipped(self, optimizer: Any, scale: float, next_scale: float | None,
                      params: list[torch.Tensor], scaler: str = ...) -> None: ...
    def optimizer_built(self, optimizer: Any) -> None: ...
    def stepped(self) -> int: ...
    def clipped(self, total_norm: Any) -> None: ...


_transforming = torch._C._functorch.peek_interpreter_stack   # a torch.func transform running


class ScriptHooks:
    """Installs and removes the hooks of one script run (see the module docstring)."""

    def __init__(self, listener: Listener, record: bool = True):
        self.listener = listener
        # The step, kept to replay it in-process (a call after the model's return and before
        # any backward is heard: the loss code skipped its backward, `continue`).
        self.tap = StepTap(enabled=record, on_return=self._model_returned)
        self._after_return = False
        self._handles: list = []
        self._forward_handle: Any = None
        self._restore: list = []
        self.trained = TrainedModules()    # which modules the script trains
        self._tap = LossTap(self._loss, before=listener.backward_started,
                            after=self._backward_ended)
        self._compiled = CompiledCalls(self)
        self.entry: Any = None        # what the script called for the step's first call
        # DeepSpeed ZeRO optimizers, wrapped when their engine is first called
        self.zero = ZeroSteps(listener, self.tap, self.await_forward)
        self.scaler: Any = None       # the GradScaler whose `step` is running (it steps)

    @property
    def raised_in_backward(self) -> bool:
        return self._tap.raised_in_backward

    def install(self) -> ScriptHooks:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )
        self._handles = [register_optimizer_step_pre_hook(self._pre_step),
                         register_optimizer_step_post_hook(self._post_step)]
        self._tap.install()
        self.tap.install()
        self._restore.append(_wrap_scaler_step(self))
        self._restore.append(_wrap_clip(self.listener))
        self._restore.append(show_at_script_lines())
        self._wrap_optimizer_init()
        self._compiled.install()
        self.await_forward()
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stop_waiting()
        self._compiled.remove()
        self.tap.remove()
        self._tap.remove()
        self.zero.remove()
        for restore in reversed(self._restore):
            restore()
        self._restore = []

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """nanaudit's own replay of a step inside the script (--keep-going localizes a skipped
        step at its trip): its model calls and backward are not the script's, so none of them
        is heard; the hooks wait as they did before."""
        waiting = self.waiting
        self.stop_waiting()
        self.tap.muted = self._tap.muted = True
        try:
            yield
        finally:
            self.tap.muted = self._tap.muted = False
            if waiting:
                self._forward_handle = None
                after_return = self._after_return
                self.await_forward()
                self._after_return = after_return

    def await_forward(self) -> None:
        """Listen for the next outermost module call (after a step or a backward)."""
        self._after_return = False
        if self._forward_handle is None:
            from torch.nn.modules.module import register_module_forward_pre_hook
            self._forward_handle = register_module_forward_pre_hook(self._first_call)

    @property
    def waiting(self) -> bool:
        return self._forward_handle is not None

    def stop_waiting(self) -> None:
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None

    def _model_returned(self) -> None:
        if self._forward_handle is None:
            self.await_forward()
            self._after_return = True

    def hear_skipped_loss(self) -> bool:
        """A non-finite loss the last forward's code skipped before backward is a loss of the
        step (the check reads it); True when there was one."""
        skipped = self.tap.skipped_loss()
        if skipped is not None:
            self.listener.loss(skipped)
        return skipped is not None

    def _first_call(self, module: torch.nn.Module, args: tuple) -> None:
        if _transforming() is not None:
            return      # inside vmap or grad (a `torch.func` ensemble): the transform's tensors
        seen = self.trained.training_call(module)
        if seen is None:
            if self.tap.opening:        # the first step's window: an evaluation's call
                self.tap.untrained_call(module, self.trained.trains(module))
            elif not torch.is_grad_enabled() and not self.tap.inside_kept_call:
                # a teacher's, an EMA model's: its value may reach the loss; a model the script
                # trains, evaluated between steps: an error its outputs cause is replayed
                self.tap.called_without_grad(module, args, caller_kwargs(),
                                             self.trained.trains(module))
            elif self._after_return and continues_graph(args):
                self._piece(module)     # no parameters, on the model's output (a quantizer)
            return
        if self._after_return and self._second_call(args):   # no call on the common path
            self._piece(module)
            self.stop_waiting()
            return
        kwargs = caller_kwargs()
        self.stop_waiting()
        if seen[1]:                     # a DeepSpeed engine (told once per module)
            self.zero.wrap(module)
        self.entry = module
        self.tap.called(module, module, args, kwargs)
        self.listener.first_call(module, args, kwargs)

    def _second_call(self, args: tuple) -> bool:
        """A call after the model returned: a micro-batch's second (unheard), or, when the loss
        code skipped its loss before backward (heard now), the next micro-batch's first, which
        takes data, never a tensor of the forward's graph."""
        self._after_return = False
        return continues_graph(args) or not self.hear_skipped_loss()

    def _piece(self, module: torch.nn.Module) -> None:
        """A module the forward goes on through after the model returned: its buffers too."""
        if not self.listener.buffers.holds(module):     # named by the script's variable
            names = self.listener.ledger.tracer_names(sys._getframe())
            self.listener.buffers.add(module, names.get(id(module)))
        self.tap.piece(module)

    def take_first_call(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                        entry: Any) -> bool:
        """A compiled module's call, heard before its compiled code (the hook is already
        removed): the step's first call when it trains; `entry` is what the script called (a
        `torch.compile` wrapper of `module`). True when taken (or left unheard, as a second
        model call of a micro-batch is: no wait after it)."""
        seen = self.trained.training_call(module)
        if seen is None:
            return False
        if self._after_return and self._second_call(args):
            return True
        self.entry = entry
        self.tap.called(module, entry, args, kwargs)
        self.listener.first_call(module, args, kwargs)
        return True

    def outside_record(self, call: Any) -> Any:
        """`call()` with the step record's loss-code mode popped (compiled code runs so)."""
        return self.tap.paused(call)

    def compiled_returned(self, module: torch.nn.Module, output: Any) -> None:
        """A compiled step call returned (compiled_calls.py): the tap's model return."""
        self.tap.returned(module, output)

    def _loss(self, loss: torch.Tensor) -> None:
        for skipped in self.tap.loss(loss):     # none on the common path
            self.listener.loss(skipped)
        self.listener.loss(loss)

    def _backward_ended(self, raised: bool) -> None:
        # gradient accumulation: the next micro-batch's forward (listened for since the
        # model returned, in the common case: no call then)
        self._after_return = False
        if self._forward_handle is None:
            self.await_forward()
        self.listener.backward_ended(raised)

    def _pre_step(self, optimizer: Any, args: tuple, kwargs: dict) -> Any:
        if optimizer is self.zero.running:
            return None          # a ZeRO group's turn: the ZeRO step was checked
        self.tap.stop()
        self.listener.update_starting()
        evaluations = [0]

        def after_closure() -> None:
            evaluation = evaluations[0]
            evaluations[0] += 1
            self.listener.before_update(optimizer, evaluation)
            self.tap.close()         # checked: the closure's next call is a window of its own
        wrapped = checked_closure_args(args, kwargs, after_closure)
        if wrapped is None:
            self.listener.before_update(optimizer, None)     # no closure: one check
        else:   # a model call in the closure is the evaluation's, not a second call of a
            self._after_return = False      # forward before the step (Lightning's no-op
        return wrapped                      # closure of manual optimization calls none)

    def _post_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if optimizer is self.zero.running:
            return               # counted once, when the ZeRO step returns
        self.listener.after_update(optimizer)
        self._after_return = False
        if self._forward_handle is None:
            self.await_forward()

    def _wrap_optimizer_init(self) -> None:
        Optimizer, original = torch.optim.Optimizer, torch.optim.Optimizer.__init__
        listener, tap, trained = self.listener, self.tap, self.trained

        @delegates
        @functools.wraps(original)
        def init(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            listener.optimizer_built(optimizer)
            original(optimizer, *args, **kwargs)
            trained.built(optimizer)
            tap.begin_code(opening=True)        # should step 0 call no module
        Optimizer.__init__ = init  # type: ignore[method-assign,assignment]
        self._restore.append(lambda: setattr(Optimizer, "__init__", original))


def _wrap_scaler_step(hooks: ScriptHooks) -> Any:
    """`GradScaler.step` wrapped (a step the GradScaler skipped: no post-hook ran during its
    `step`); returns what restores it."""
    from torch.amp import GradScaler
    original, listener, tap = GradScaler.step, hooks.listener, hooks.tap

    @delegates
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        before = listener.stepped()
        hooks.scaler = scaler
        if scaler.is_enabled():
            listener.scaling(scaler)
        try:
            result = original(scaler, optimizer, *args, **kwargs)
        finally:
            hooks.scaler = None
        if listener.stepped() == before and scaler.is_enabled():
            listener.scaler_skipped(optimizer, scaler)
            tap.close()              # a skipped step that did not trip: not replayed
        return result
    GradScaler.step = step  # type: ignore[method-assign,assignment]
    return lambda: setattr(GradScaler, "step", original)


def _wrap_clip(listener: Listener) -> Any:
    """`clip_grad_norm_` wrapped where a script finds it (`torch.nn.utils`, its `clip_grad`
    module, which the deprecated `clip_grad_norm` calls): its returned total norm is told, no
    host read; returns what restores it."""
    from torch.nn.utils import clip_grad
    original = clip_grad.clip_grad_norm_

    @delegates
    @functools.wraps(original)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        total = original(*args, **kwargs)
        listener.clipped(total)
        return total
    torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = clip_grad_norm_

    def restore() -> None:
        torch.nn.utils.clip_grad_norm_ = clip_grad.clip_grad_norm_ = original
    return restore
