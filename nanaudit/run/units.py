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
* `UserStep`, the user's own `step(model, batch, optimizer)`: it runs forward, backward and
  every optimizer step itself. nanaudit checks in each optimizer's step pre-hook (that
  optimizer's gradients and parameters, the losses backpropagated since) and raises out of the
  hook before a bad update; the updates made earlier in the same call are put back from copies
  taken just before them (only when a later optimizer step may follow in the call).

What the loop and the replays use: `window` (batches per optimizer step), `owns_update` (the
unit applies its updates itself, inside `run`), and `replay(state, batch, hooks)`, which
rewinds to the state before the (micro-)step and repeats it, returning the value to walk back
from (the loss). `LossStep` also gives the loop `forward_backward` and `update`, between which
the loop's one read decides.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nanaudit.errors import UserCodeError, call_user
from nanaudit.run.step import StepState, scalar_loss


def unit_for(session) -> "LossStep | UserStep":
    """The unit the run asks for: the user's own step, or the loss's (in windows)."""
    if session.step_fn is not None:
        return UserStep(session)
    return LossStep(session, session.options.accumulate)


@dataclass
class ReplayHooks:
    """What an instrumented replay needs told: when backward starts and ends (the tracer's
    phases), and a batch of rows to use instead of the recorded one (sample search)."""

    before_backward: Callable[[], None] | None = None
    after_backward: Callable[[], None] | None = None


class LossStep:
    """The standard step and the accumulation window: the user's loss, nanaudit's backward
    and update."""

    owns_update = False

    def __init__(self, session, window: int = 1):
        self.session, self.window = session, window
        self._labels: tuple = (None, [])      # (the optimizers dict, [(label, optimizer)])

    @property
    def name(self) -> str:
        return "accumulation window" if self.window > 1 else "standard step"

    def forward_backward(self, batch: Any, *, before_backward=None, scale=None,
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


def forward_backward(session, batch: Any,
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


def optimizer_label(name: str, optimizer) -> str:
    return f"optimizer step of `{name}` ({type(optimizer).__name__})"


def step_schedulers(schedulers: dict, loss_value: float) -> None:
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    for name, scheduler in schedulers.items():
        what = f"scheduler `{name}` ({type(scheduler).__name__}).step()"
        if isinstance(scheduler, plateau):
            call_user(what, scheduler.step, loss_value)
        else:
            call_user(what, scheduler.step)


def lr_problem(session, only=None) -> str | None:
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


def _scheduler_of(session, optimizer):
    for name, scheduler in session.schedulers.items():
        if getattr(scheduler, "optimizer", None) is optimizer:
            return name, scheduler
    return None


# --- the user's own step ------------------------------------------------------------------------


class Halt(BaseException):
    """Raised from an optimizer's step pre-hook to stop the user's step before an update.
    A BaseException so that the user's `except Exception` cannot swallow it."""


@dataclass
class UpdatePoint:
    """An optimizer about to step inside the user's step: which, and the losses so far."""

    index: int                       # the optimizer step's place in this call (0, 1, ...)
    name: str
    optimizer: Any
    losses: list                     # loss tensors backpropagated since the previous update
    loss_names: list                 # their names when known (from an earlier call's dict)


@dataclass
class UserRun:
    """What one call of the user's step did."""

    losses: dict = field(default_factory=dict)    # name -> loss tensor it returned
    updates: int = 0                               # optimizer steps applied
    halted: UpdatePoint | None = None              # where a check stopped it
    undo: list = field(default_factory=list)       # put back the updates applied before it


class UserStep:
    """The user's `step(model, batch, optimizer)`, checked at each optimizer step."""

    owns_update = True
    window = 1
    name = "user step"

    def __init__(self, session):
        self.session = session
        self._gate: Callable[[UpdatePoint], bool] | None = None
        self._run: UserRun | None = None
        self._pending: list = []
        self._updates_per_call: int | None = None   # learnt from the first complete call
        self._loss_order: list = []                  # names of losses in backward order
        self._hooks: ReplayHooks | None = None
        self._by_optimizer = {id(o): n for n, o in session.optimizers.items()}
        self._handles = [o.register_step_pre_hook(self._pre_step)
                         for o in session.optimizers.values()]

    @property
    def optimizer_argument(self):
        """What the user's function gets: the optimizer, or all of them as the config gave."""
        optimizers = self.session.optimizers
        if len(optimizers) == 1:
            return next(iter(optimizers.values()))
        if all(n.startswith("optimizer[") for n in optimizers):
            return list(optimizers.values())
        return dict(optimizers)

    def run(self, batch: Any, gate: Callable[[UpdatePoint], bool],
            hooks: ReplayHooks | None = None) -> UserRun:
        """Call the user's step; `gate(point)` runs before each optimizer step and returns
        False to stop the call there (before that update)."""
        self._gate, self._run, self._pending, self._hooks = gate, UserRun(), [], hooks
        self._backwarded: list = []      # every loss this call backpropagated, in order
        original = torch.autograd.backward
        torch.autograd.backward = self._backward(original)
        try:
            self.session.model.zero_grad(set_to_none=True)
            with self.session.precision.autocast():
                returned = call_user(f"step `{self.session.loss_label}`", self.session.step_fn,
                                     self.session.model, batch, self.optimizer_argument,
                                     **dict(self.session.options.loss_args))
            self._run.losses = self._named_losses(returned)
            if self._updates_per_call is None:
                self._updates_per_call = self._run.updates
        except Halt:
            pass                        # a check stopped it before an update: see run.halted
        finally:
            torch.autograd.backward = original
            self._gate = None
        return self._run

    def _backward(self, original):
        def backward(tensors, *args, **kwargs):
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                self._pending.append(tensors)
                self._backwarded.append(tensors)
            if self._hooks and self._hooks.before_backward:
                self._hooks.before_backward()
            try:
                return original(tensors, *args, **kwargs)
            finally:
                if self._hooks and self._hooks.after_backward:
                    self._hooks.after_backward()
        return backward

    def _pre_step(self, optimizer, args, kwargs):
        if self._gate is None:
            return None                 # a step outside nanaudit's call: not ours to check
        run = self._run
        name = self._by_optimizer.get(id(optimizer), type(optimizer).__name__)
        count = len(self._pending)
        start = len(self._backwarded) - count
        names = self._loss_order[start:start + count]
        point = UpdatePoint(run.updates, name, optimizer, list(self._pending), names)
        self._pending = []
        if not self._gate(point):
            run.halted = point
            raise Halt()
        if self._updates_per_call is None or run.updates + 1 < self._updates_per_call:
            run.undo.append(_undo_for(optimizer))
        run.updates += 1
        return None

    def _named_losses(self, returned) -> dict:
        if isinstance(returned, dict):
            losses = {str(k): v for k, v in returned.items() if isinstance(v, torch.Tensor)}
        elif isinstance(returned, torch.Tensor):
            losses = {"loss": returned}
        else:
            losses = {}
        if not self._loss_order and losses:
            ids = {id(t): n for n, t in losses.items()}
            self._loss_order = [ids.get(id(t), "") for t in self._backwarded]
        return {n: scalar_loss(t, self.session.options.loss_key) if t.requires_grad else t
                for n, t in losses.items()}

    def replay(self, state: StepState, batch: Any = None,
               hooks: ReplayHooks | None = None) -> torch.Tensor:
        """The user's step again from the pre-step state, stopped where it tripped; returns
        the last loss backpropagated before that point (the sink of a loss trip)."""
        state.rewind()
        halt_at = state.halt_at if state.halt_at is not None else 0
        seen: list = []

        def gate(point: UpdatePoint) -> bool:
            seen.extend(point.losses)
            return point.index < halt_at
        run = self.run(state.batch if batch is None else batch, gate, hooks)
        for put_back in reversed(run.undo):
            put_back()              # the replay's own updates before the halt: state as before
        seen.extend(self._pending)
        if run.halted is None and run.losses:
            seen.extend(run.losses.values())
        if not seen:
            raise UserCodeError(f"step `{self.session.loss_label}`",
                                RuntimeError("the step backpropagated no loss"))
        bad = [t for t in seen if not bool(torch.isfinite(t.detach()).all())]
        return (bad or seen)[-1]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _undo_for(optimizer) -> Callable[[], None]:
    """A copy of what `optimizer.step()` is about to change (its parameters and state), and
    how to put it back: taken only when a later optimizer step in the same call could trip."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = [p.detach().clone() for p in params]
    state = copy.deepcopy(optimizer.state_dict())

    def put_back() -> None:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        optimizer.load_state_dict(copy.deepcopy(state))
    return put_back
