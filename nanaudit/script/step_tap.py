"""What `nanaudit run` keeps of the current step so that it can be replayed in-process at a trip:
the step record (run/step_record.py) filled from the auditor's hooks, and the loss code recorded
from the model's return to `backward` (run/loss_code.py); for a step that calls no module (a
model written as raw tensors), its code from the step's start to `backward` instead.

The model's return is heard by a forward hook put on the step's outermost module at its first
call, removed when the script ends (one hook call a micro-batch; the forward's inner modules
keep PyTorch's hook-free path). `Tensor.backward` is wrapped to end the recording before it
runs (a later `backward` of a tensor the recorded code made is one more root of its replay),
and the optimizers' and modules' `zero_grad` to run outside the recorder's mode: through
it, each would cost a Python call per parameter. Only the first run records: a re-run traces
instead."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.errors import delegates
from nanaudit.run.live import holds_hook
from nanaudit.run.loss_code import LossCodeRecorder
from nanaudit.run.step_record import ModelCall, StepRecord
from nanaudit.script.code_window import Untrained, last_skipped, reached, untrained

_stack_depth = torch._C._len_torch_function_stack


def _hook_once(hooked: dict[int, Any], module: torch.nn.Module, hook: Any) -> None:
    """`hook` on `module`'s return, once per model (`hooked`: id -> handle; live.py)."""
    if not holds_hook(hooked, module):
        hooked[id(module)] = module.register_forward_hook(hook)


def _skipped_loss(record: StepRecord, code_step: bool) -> torch.Tensor | None:
    """The loss the last micro-batch's code made, non-finite, and never differentiated
    (None: it reached backward, or was finite, or the code made no differentiable scalar);
    `code_step`: the step has called no module. One host read, only after a forward that had
    no backward. A bad one joins the micro-batch's losses: the step's check reads it, the
    replay verifies it."""
    last = record.last
    if last is None:                # a step that calls no module, at the script's end
        window = record.code_window
        return last_skipped(window) if window is not None and code_step else None
    if last.losses or last.output is None:
        return None
    loss = last.code.skipped_loss()
    if loss is None or bool(torch.isfinite(loss.detach())):
        return None
    last.skipped = True
    last.losses.append(loss)
    return loss


class StepTap:
    """Feeds the step record; `enabled` False (a re-run) keeps nothing. `install()` /
    `remove()` (the zero_grad wrappers, the forward hooks it put on the script's models)."""

    def __init__(self, enabled: bool = True, on_return: Any = None):
        self.enabled = enabled
        self.on_return = on_return        # told when the model's outermost call returned
        self.record = StepRecord()
        self._recorder = LossCodeRecorder()
        self._hooked: dict[int, Any] = {}   # id(module) -> its forward hook's handle
        self._pending: ModelCall | None = None
        self._frozen: ModelCall | None = None   # a frozen call not yet returned
        self._after_frozen: Any = None  # the code after the latest frozen call (its recording)
        self._restore: list = []
        self.muted = False                # nanaudit's own replay calls the model: not heard
        self._returning: torch.nn.Module | None = None   # a re-run's model call, not returned
        # The current step has made no training call so far (its code is recorded from its
        # start: `begin_code`), and a loss of it reached backward; `opening`: its window opened
        # at the optimizer's construction, before the script was seen to step.
        self._code_step = self._code_reached = self.opening = False

    def install(self) -> None:
        if not self.enabled:
            return
        # A `zero_grad` between the loss and backward reads and writes every parameter's
        # gradient: with the recorder paused, those are not calls through its mode.
        for owner in (torch.optim.Optimizer, torch.nn.Module):
            original = owner.__dict__["zero_grad"]
            owner.zero_grad = self._paused(original)  # type: ignore[method-assign]
            self._restore.append(lambda owner=owner, original=original:
                                 setattr(owner, "zero_grad", original))
        # `loss.backward()` ends the loss code before it would pass through the mode.
        backward, recorder, tap = torch.Tensor.backward, self._recorder, self

        @delegates
        @functools.wraps(backward)
        def reaching(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if recorder.pushed:         # else: no loss code is being recorded
                recorder.reached_backward(backward, (tensor, *args), kwargs)
            else:
                tap.another_root(backward, (tensor, *args), kwargs)
            return backward(tensor, *args, **kwargs)
        torch.Tensor.backward = reaching  # type: ignore[method-assign,assignment]
        self._restore.append(lambda: setattr(torch.Tensor, "backward", backward))

    def another_root(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A later `backward` of the last micro-batch's loss code (`main.backward(
        retain_graph=True)` then `aux.backward()`): one more root its replay differentiates,
        when the model or the recorded code made its tensor."""
        last = self.record.last
        if not self.enabled or self.muted or last is None or not last.code.roots:
            return
        tensor = args[0]
        made = itertools.chain(tree_flatten(last.output)[0],
                               *(tree_flatten(op.out)[0] for op in last.code.ops))
        if any(tensor is t for t in made):
            last.code.roots.append((func, args, kwargs))

    def _paused(self, original: Any) -> Any:
        recorder = self._recorder

        @delegates
        @functools.wraps(original)
        def zero_grad(owner: Any, *args: Any, **kwargs: Any) -> Any:
            if recorder.pushed:
                return recorder.paused(original, owner, *args, **kwargs)
            return original(owner, *args, **kwargs)
        return zero_grad

    def remove(self) -> None:
        self.stop()
        for handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore = []

    def called(self, module: torch.nn.Module, entry: Any, args: tuple, kwargs: dict) -> None:
        """A micro-batch's outermost module call (before its forward)."""
        if not self.enabled:        # a re-run keeps nothing, but hears the model return
            self._returning = module if entry is module else None   # (hooks._piece)
            if entry is module:
                _hook_once(self._hooked, module, self._rerun_returned)
            return
        self._pending = self._frozen = self._after_frozen = None
        self._code_step = self.opening = False
        if self._recorder.pushed:
            self._recorder.stop()
        call = self.record.called(module, entry, args, kwargs)
        if entry is module:         # a compiled call never meets the module's hooks
            self._pending = call
            _hook_once(self._hooked, module, self._returned)

    def piece(self, module: torch.nn.Module) -> None:
        """A module the micro-batch's forward went on through after the model returned."""
        if self.enabled and not self.muted and self.record.calls:
            self.record.piece(module)

    def called_without_grad(self, module: torch.nn.Module, args: tuple, kwargs: dict,
                            trained: bool) -> None:
        """A module called without autograd while the step's training call is awaited, kept
        with its output and the code after it: a frozen one's (a teacher's) is replayed before
        the training call; of one it trains (minGPT's `generate` sampling between steps), the
        latest, for an error raised before the next training call (`StepRecord.evaluated`).
        A call in a loss code or a step's code recorded already is that code's op."""
        recording = self._recorder.code
        if (not self.enabled or self.muted or self._frozen is not None
                or self.record.code_window is not None
                # recording a training call's loss code, not what followed a frozen call
                or (recording is not None and recording is not self._after_frozen)
                or next(module.parameters(), None) is None):
            return
        if recording is not None:
            self._recorder.stop()       # the previous frozen call's code ends here
        self._frozen = (self.record.evaluation_call if trained else
                        self.record.frozen_call)(module, args, kwargs)
        _hook_once(self._hooked, module, self._returned)

    @property
    def inside_kept_call(self) -> bool:     # the calls a kept call makes are its own
        return self._frozen is not None

    def _rerun_returned(self, module: torch.nn.Module, _args: Any, _output: Any) -> None:
        if module is self._returning and self.on_return is not None:
            self._returning = None
            self.on_return()

    def _returned(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        frozen = self._frozen
        if frozen is not None and frozen.module is module:
            self._frozen, self._after_frozen = None, frozen.code
            frozen.output = output
            self._recorder.start(frozen.code)
            return
        call = self._pending
        if call is None or call.module is not module or self.muted:
            return                  # another call of the model (an evaluation)
        self._pending = None
        call.output = output
        self._recorder.start(call.code)
        if self.on_return is not None:
            self.on_return()

    def paused(self, call: Any) -> Any:
        """`call()` outside the loss code's recording."""
        return self._recorder.paused(call)

    def returned(self, module: torch.nn.Module, output: Any) -> None:
        """A compiled call of the micro-batch returned (heard outside its compiled code)."""
        call = self.record.last
        if (not self.enabled or self.muted or call is None or call.module is not module
                or call.output is not None):
            return                  # heard already: an in-place compile ran the forward hook
        self._pending = None
        call.output = output        # as `_returned` does, for the call dynamo ran
        self._recorder.start(call.code)
        if self.on_return is not None:
            self.on_return()

    def loss(self, loss: torch.Tensor) -> Sequence[torch.Tensor]:
        """An unscaled loss reaching backward: the current micro-batch's (or the step's code's,
        when it called no module). Returns the losses the step's code skipped before it
        (code_window.reached); a shared empty tuple for a step that calls a module."""
        calls = self.record.calls
        if calls:                   # none when not enabled
            calls[-1].losses.append(loss)
            return ()
        if not self._code_step:
            return ()
        first, self._code_reached = not self._code_reached, True
        return reached(self.record.code_window, loss, first)

    def begin_code(self, opening: bool = False) -> None:
        """A step's start (`opening`: an optimizer built; else the update after a step that
        called no module): the script's code is recorded from here until a model call (which
        drops it) or `backward` (which ends it), so that a step that calls no module is
        replayed from its code. Not under another torch function mode: that one's `__exit__`
        pops the innermost."""
        if not self.enabled or self.muted or self.record.calls:
            return
        self._code_step, self._code_reached, self.opening = True, False, opening
        if self._recorder.pushed:
            self._recorder.stop()
        if not _stack_depth():
            self._recorder.start(self.record.begin_code().code)

    def untrained_call(self, module: torch.nn.Module, trained: bool) -> None:
        """A module call under `no_grad` in the window opened at the optimizer's construction
        (`trained`: of a module the script trains, script/trained.py): the window starts
        again, or is dropped (code_window.untrained says which)."""
        action = untrained(self.record.code_window, module, trained)
        if action is Untrained.RESTART:
            self.begin_code(opening=True)
        elif action is Untrained.DROP:
            self.opening = False
            self.record.code_window = None
            self.stop()

    def skipped_loss(self) -> torch.Tensor | None:
        """The loss the last micro-batch's code made and skipped, non-finite (_skipped_loss)."""
        return _skipped_loss(self.record, self._code_step) if self.enabled else None

    def stop(self) -> None:
        """The loss code ended (a model call, an optimizer step, the script's end)."""
        self._pending = self._frozen = None
        if self._recorder.pushed:   # else there is nothing to stop (most calls: a clean step)
            self._recorder.stop()

    def close(self) -> None:
        """The window was checked: drop it (what `stop` does, inline: this runs each step). A
        step that called no module and reached backward: the next step's code is recorded from
        now (a step that calls a module pays one attribute read for this)."""
        self._pending = self._frozen = self._after_frozen = None
        if self._recorder.pushed:
            self._recorder.stop()
        code_step = self._code_step and self._code_reached
        self.record.close()
        if code_step:
            self.begin_code()
