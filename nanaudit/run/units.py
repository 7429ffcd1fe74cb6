"""The step unit: one optimizer step of the user's training, as the loop runs it under the
sentinels and every replay (localizer, sample search, bisect, bundles, `Sentinel`, the
integrations) repeats it under the instruments.

Three implementations of one small interface:

* `LossStep(window=1)`, the standard step: zero the gradients, the loss (under autocast),
  backward (scaled), then the update: each optimizer, then each scheduler.
* `LossStep(window=N)`, an accumulation window: N micro-batches (consecutive batches of the
  data), each loss scaled by 1/N and backpropagated in turn, then one update. A replay runs the
  offending micro-batch from its own saved state: the accumulated gradients of the earlier
  micro-batches were finite (the loop checked them), so the bad value is made inside it.
* `UserStep` (user_step.py), the user's own `step(model, batch, optimizer)`: it runs forward,
  backward and every optimizer step itself, checked before each update.

What the loop and the replays use: `window` (batches per optimizer step), `owns_update` (the
unit applies its updates itself, inside `run`), and `replay(state, batch, hooks)`, which
rewinds to the state before the (micro-)step and repeats it, returning the value to walk back
from (the loss). `LossStep` also gives the loop `forward_backward` and `update`, between which
the loop's one read decides.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nanaudit.errors import call_user
from nanaudit.run.step import ReplayHooks, StepState, scalar_loss
from nanaudit.run.user_step import StepSession, UserStep


class LossSession(StepSession, Protocol):
    """What the loss's step reads of the run's session (session.Session, which builds its
    step unit here and so is not imported)."""

    @property
    def schedulers(self) -> dict[str, Any]: ...
    @property
    def loss_what(self) -> str: ...
    def compute_loss(self, batch: Any) -> Any: ...


def unit_for(session: LossSession) -> LossStep | UserStep:
    """The unit the run asks for: the user's own step, or the loss's (in windows)."""
    if session.step_fn is not None:
        return UserStep(session)
    return LossStep(session, session.options.accumulate)


class LossStep:
    """The standard step and the accumulation window: the user's loss, nanaudit's backward
    and update."""

    owns_update = False

    def __init__(self, session: LossSession, window: int = 1) -> None:
        self.session, self.window = session, window
        self._labels: tuple = (None, [])      # (the optimizers dict, [(label, optimizer)])

    @property
    def name(self) -> str:
        return "accumulation window" if self.window > 1 else "standard step"

    def forward_backward(self, batch: Any, *,
                         before_backward: Callable[[], None] | None = None,
                         scale: float | None = None,
                         zero_grad: Callable[[], None] | None = None) -> torch.Tensor:
        """One (micro-)batch's loss and backward; `zero_grad` None keeps the accumulated
        gradients (the later micro-batches of a window)."""
        return forward_backward(self.session, batch, before_backward=before_backward,
                                scale=scale, zero_grad=zero_grad or _keep, divide=self.window)

    def update(self, loss_value: float) -> None:
        """Each optimizer's step, then each scheduler's (after an applied update only)."""
        optimizers = self.session.optimizers
        if self._labels[0] is not optimizers:   # named once, not per step (a small step feels it)
            self._labels = (optimizers, [(optimizer_label(n, o), o)
                                         for n, o in optimizers.items()])
        for label, optimizer in self._labels[1]:
            call_user(label, optimizer.step)
        if self.session.schedulers:
            step_schedulers(self.session.schedulers, loss_value)

    def replay(self, state: StepState, batch: Any = None,
               hooks: ReplayHooks | None = None) -> torch.Tensor:
        state.rewind()
        hooks = hooks or ReplayHooks()
        return self.forward_backward(state.batch if batch is None else batch,
                                     before_backward=hooks.before_backward, scale=state.scale,
                                     zero_grad=self.session.model.zero_grad)


def forward_backward(session: LossSession, batch: Any,
                     before_backward: Callable[[], None] | None = None,
                     scale: float | None = None,
                     zero_grad: Callable[[], None] | None = None,
                     divide: int = 1) -> torch.Tensor:
    """Zero grads, compute the loss (under autocast) and backpropagate it (scaled, and divided
    by the window's micro-batches): the part of a step a replay repeats. `scale` is the
    recorded loss scale on a replay; `zero_grad` the step loop's own (its parameter list, not
    a walk of the module tree). Returns the loss as the user's code computed it."""
    if zero_grad is not None:
        zero_grad()
    else:
        session.model.zero_grad(set_to_none=True)
    precision = session.precision
    with precision.autocast():
        loss = scalar_loss(call_user(session.loss_what, session.compute_loss, batch),
                           session.options.loss_key)
    if before_backward is not None:
        before_backward()
    scaled = precision.scaled(loss / divide if divide != 1 else loss, scale)
    call_user("backward of the loss", scaled.backward)
    return loss


def _keep() -> None:
    """zero_grad for a window's later micro-batches: their gradients add to the earlier ones."""


def optimizer_label(name: str, optimizer: torch.optim.Optimizer) -> str:
    return f"optimizer step of `{name}` ({type(optimizer).__name__})"


def step_schedulers(schedulers: dict, loss_value: float | None) -> None:
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    for name, scheduler in schedulers.items():
        what = f"scheduler `{name}` ({type(scheduler).__name__}).step()"
        if isinstance(scheduler, plateau):
            if loss_value is not None:   # a user's step that differentiated no scalar loss
                call_user(what, scheduler.step, loss_value)
        else:
            call_user(what, scheduler.step)


def lr_problem(session: LossSession, only: torch.optim.Optimizer | None = None) -> str | None:
    """A learning rate no update should run with (non-finite or negative), named with the
    scheduler that set it; read from the host-side param groups (no sync for float lrs).
    `only`: check that optimizer alone."""
    for name, optimizer in session.optimizers.items():
        if only is not None and optimizer is not only:
            continue
        for index, group in enumerate(optimizer.param_groups):
            lr = group.get("lr")
            value = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
            if value is None or (math.isfinite(value) and value >= 0):
                continue
            setter = _scheduler_of(session, optimizer)
            by = (f"scheduler `{setter[0]}` ({type(setter[1]).__name__}, after "
                  f"{getattr(setter[1], 'last_epoch', '?')} step(s)) set" if setter else
                  "the optimizer's settings give")
            return (f"{by} lr={value:g} for param group {index} of `{name}` "
                    f"({type(optimizer).__name__}); the update was not applied")
    return None


def _scheduler_of(session: LossSession, optimizer: torch.optim.Optimizer
                  ) -> tuple[str, Any] | None:
    for name, scheduler in session.schedulers.items():
        if getattr(scheduler, "optimizer", None) is optimizer:
            return name, scheduler
    return None
