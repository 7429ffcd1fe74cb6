"""Intercepting a training step that the user's code owns, for `step:` and `nanaudit run` alike.

When nanaudit does not run the step itself (the user's `step(model, batch, optimizer)`, an
unmodified script), it sees the step through PyTorch's own seams, and both owners use the same
ones, from here:

* the losses: `torch.autograd.backward` is wrapped (`Tensor.backward` calls it), and, for a
  step that differentiates with `torch.autograd.grad`, that too (a scalar differentiated for the
  trained parameters is a loss; a gradient penalty's inner grad, for the inputs, is not). A loss
  scaled by `GradScaler.scale` is reported as the loss before scaling, since the scale is not
  part of the value the user computed. Differentiation nested inside a backward (reentrant
  activation checkpointing) is not a loss.
* the update: an optimizer's step pre-hook is where a check runs, before any parameter
  changes. An optimizer stepped with a closure (LBFGS, Lightning) computes the loss and the
  gradients inside `step()`, so the closure is wrapped and the check runs when it returns.
* the stop: `StepHalted`, raised from the hook, unwinds the user's code before the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nanaudit.errors import delegates
from nanaudit.run.loss_code import differentiates


class StepHalted(BaseException):
    """Stops the user's code at a check, before the update. A BaseException, so that the
    user's own `except Exception:` cannot swallow it (frameworks re-raise BaseExceptions)."""


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The tensors of what autograd takes: one tensor or a sequence of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


class LossTap:
    """Every scalar loss the user's code differentiates, as computed before any loss scaling.

    `on_loss(loss)` hears each loss as its differentiation starts; `before()` and
    `after(raised)` bracket the outermost differentiation (the tracer's phases); `on_scale`
    hears each GradScaler that scales a loss. `trained`: the ids of the trained parameters,
    to wrap `torch.autograd.grad` as well (None: only backward). `install()` / `remove()`."""

    def __init__(self, on_loss: Callable[[torch.Tensor], None],
                 before: Callable[[], None] | None = None,
                 after: Callable[[bool], None] | None = None,
                 on_scale: Callable[[Any], None] | None = None,
                 trained: set[int] | None = None):
        self.on_loss, self.before, self.after, self.on_scale = on_loss, before, after, on_scale
        self.trained = trained
        self.raised_in_backward = False   # the last differentiation raised (where it raised)
        self.muted = False                # nanaudit's own replay differentiates: not heard
        self._depth = 0
        self._scaled: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._restore: list[Callable[[], None]] = []

    def install(self) -> LossTap:
        autograd, scaler_class = torch.autograd, torch.amp.GradScaler
        backward, grad = autograd.backward, autograd.grad
        scale = scaler_class.__dict__["scale"]
        autograd.backward = self._wrap_backward(backward)
        scaler_class.scale = self._wrap_scale(scale)  # type: ignore[method-assign]
        self._restore = [lambda: setattr(autograd, "backward", backward),
                         lambda: setattr(scaler_class, "scale", scale),
                         differentiates(autograd.backward)]
        if self.trained is not None:
            autograd.grad = self._wrap_grad(grad)
            self._restore.append(lambda: setattr(autograd, "grad", grad))
        return self

    def remove(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        self._scaled.clear()

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @delegates
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            return self._differentiating(tensors, lambda: original(tensors, *args, **kwargs))
        return backward

    def _wrap_grad(self, original: Callable[..., Any]) -> Callable[..., Any]:
        trained = self.trained or set()

        @delegates
        def grad(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(inputs, (torch.Tensor, list, tuple)):
                inputs = tuple(inputs)          # `model.parameters()`: read it once, here
            losses = outputs if any(id(t) in trained for t in tensors_of(inputs)) else ()
            return self._differentiating(
                losses, lambda: original(outputs, inputs, *args, **kwargs))
        return grad

    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @delegates
        def scale(scaler: Any, outputs: Any) -> Any:
            scaled = original(scaler, outputs)
            if self.on_scale is not None:
                self.on_scale(scaler)
            if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor):
                self._scaled[id(scaled)] = (scaled, outputs)
            return scaled
        return scale

    def unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss before `GradScaler.scale`, for `scaler.scale(loss).backward()`."""
        pair = self._scaled.get(id(loss))
        return pair[1] if pair is not None and pair[0] is loss else loss

    def _differentiating(self, losses: Any, differentiate: Callable[[], Any]) -> Any:
        if self._depth or self.muted:
            return differentiate()              # inside a backward: not a loss of the step
        for t in tensors_of(losses):
            if t.numel() == 1 and (t.is_floating_point() or t.is_complex()):
                self.on_loss(self.unscaled(t))
        self._scaled.clear()
        if self.before is not None:
            self.before()
        self._depth += 1
        self.raised_in_backward = True
        try:
            result = differentiate()
            self.raised_in_backward = False
            return result
        finally:
            self._depth -= 1
            if self.after is not None:
                self.after(self.raised_in_backward)


def checked_closure_args(args: tuple, kwargs: dict,
                         check: Callable[[], None]) -> tuple[tuple, dict] | None:
    """For an optimizer step pre-hook: the step's (args, kwargs) with its closure wrapped so
    that `check()` runs each time the closure returns (before the optimizer uses what it
    computed); None when the step has no closure. `args[0]` is the optimizer."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if not callable(closure):
        return None

    def checked(*c_args: Any, **c_kwargs: Any) -> Any:
        result = closure(*c_args, **c_kwargs)
        check()
        return result
    if "closure" in kwargs:
        return args, {**kwargs, "closure": checked}
    return (args[0], checked, *args[2:]), kwargs
