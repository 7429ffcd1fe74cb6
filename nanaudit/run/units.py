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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.errors import UserCodeError, call_user
from nanaudit.run.step import StepState, scalar_loss


def unit_for(session) -> LossStep | UserStep:
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
            if loss_value is not None:   # a user's step that differentiated no scalar loss
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

    # name -> the floating scalar tensor it returned as a loss; one that no check before an
    # update saw is handed over detached: the loop reads those after the call.
    losses: dict = field(default_factory=dict)
    updates: int = 0                               # optimizer steps applied
    halted: UpdatePoint | None = None              # where a check stopped it
    undo: list = field(default_factory=list)       # put back the updates applied before it


class UserStep:
    """The user's `step(model, batch, optimizer)`, checked at each optimizer step.

    What the call differentiates is seen by wrapping `torch.autograd.backward` and
    `torch.autograd.grad` (a scalar differentiated for the trained parameters is a loss) and
    `GradScaler.scale` (the loss checked and shown is the one before scaling). An optimizer
    stepped with a closure (LBFGS) is checked after the closure's first evaluation, which
    computes the loss and gradients inside `step()` before any parameter changes."""

    owns_update = True
    window = 1
    name = "user step"

    def __init__(self, session):
        self.session = session
        self.hold_weights = False       # bisect over data: every update is put back after the call
        self._gate: Callable[[UpdatePoint], bool] | None = None
        self._run: UserRun | None = None
        self._pending: list = []
        self._backwarded: list = []      # every loss this call differentiated, in order
        self._gated: list = []           # the UpdatePoints this call checked
        self._returned: dict = {}        # the losses the last call returned, as returned
        self._named: dict = {}           # id(checked loss) -> the name it was returned under
        self._updates_per_call: int | None = None   # the most updates a complete call made
        self._names_at: list = []        # loss names by differentiation order in a call (learnt)
        self._loss_of: dict = {}         # optimizer name -> the returned loss it stepped on
        self._snapshot_all = False       # a replay: every update it makes is put back
        self._snapshotted: set = set()   # ids of the optimizers copied in this call
        self._scalers: list = []         # the GradScalers this call scaled a loss with
        self._scaled: dict = {}          # id(scaled loss) -> (scaled, loss before scaling)
        self._depth = 0                  # nested differentiation (reentrant checkpointing)
        self._hooks: ReplayHooks | None = None
        self._by_optimizer = {id(o): n for n, o in session.optimizers.items()}
        self._trained = {id(p) for o in session.optimizers.values()
                         for g in o.param_groups for p in g["params"]}
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
        self._backwarded, self._gated, self._returned = [], [], {}
        self._snapshotted, self._scalers, self._scaled = set(), [], {}
        saved_scalers: list = []
        unpatch = self._patch(saved_scalers)
        try:
            self.session.model.zero_grad(set_to_none=True)
            with self.session.precision.autocast():
                returned = call_user(f"step `{self.session.loss_label}`", self.session.step_fn,
                                     self.session.model, batch, self.optimizer_argument,
                                     **dict(self.session.options.loss_args))
            self._run.losses = self._named_losses(returned)
            self._learn_names()
            self._updates_per_call = max(self._updates_per_call or 0, self._run.updates)
        except Halt:
            self._abandon_scalers()     # stopped inside `scaler.step`: no `update()` followed
        finally:
            unpatch()
            self._gate = None
        for scaler, state in saved_scalers:       # a replay leaves the user's scaler as it was
            scaler.load_state_dict(state)
            _forget_optimizers(scaler, self.session.optimizers.values())
        if self.hold_weights and self._run.halted is None:
            for put_back in reversed(self._run.undo):
                put_back()
            self._run.undo, self._run.updates = [], 0
        return self._run

    def _patch(self, saved_scalers: list) -> Callable[[], None]:
        """Wrap what the user's step differentiates and scales with, for the call."""
        autograd, scaler_class = torch.autograd, torch.amp.GradScaler
        backward, grad = autograd.backward, autograd.grad
        scale = scaler_class.__dict__["scale"]
        autograd.backward = self._wrap_backward(backward)
        autograd.grad = self._wrap_grad(grad)
        scaler_class.scale = self._wrap_scale(scale, saved_scalers)

        def unpatch() -> None:
            autograd.backward, autograd.grad = backward, grad
            scaler_class.scale = scale
        return unpatch

    def _wrap_backward(self, original):
        def backward(tensors, *args, **kwargs):
            return self._differentiating(tensors, lambda: original(tensors, *args, **kwargs))
        return backward

    def _wrap_grad(self, original):
        def grad(outputs, inputs, *args, **kwargs):
            if not isinstance(inputs, (torch.Tensor, list, tuple)):
                inputs = tuple(inputs)          # `model.parameters()`: read it once, here
            # A scalar differentiated for trained parameters is a loss; a gradient penalty's
            # inner grad (for the inputs) is not.
            losses = outputs if any(id(t) in self._trained for t in _tensors(inputs)) else ()
            return self._differentiating(losses, lambda: original(outputs, inputs, *args,
                                                                  **kwargs))
        return grad

    def _wrap_scale(self, original, saved_scalers: list):
        def scale(scaler, outputs):
            scaled = original(scaler, outputs)
            if not any(s is scaler for s in self._scalers):
                self._scalers.append(scaler)
                if self._snapshot_all and getattr(scaler, "is_enabled", lambda: False)():
                    saved_scalers.append((scaler, scaler.state_dict()))
            if isinstance(outputs, torch.Tensor) and isinstance(scaled, torch.Tensor):
                self._scaled[id(scaled)] = (scaled, outputs)
            return scaled
        return scale

    def _differentiating(self, losses, differentiate):
        """Record the scalar losses about to be differentiated and tell the tracer; only the
        outermost call (reentrant checkpointing differentiates inside a backward)."""
        if self._depth:
            return differentiate()
        for t in _tensors(losses):
            if t.numel() == 1:
                scaled = self._scaled.get(id(t))
                t = scaled[1] if scaled is not None and scaled[0] is t else t
                self._pending.append(t)
                self._backwarded.append(t)
        hooks = self._hooks
        if hooks and hooks.before_backward:
            hooks.before_backward()
        self._depth += 1
        try:
            return differentiate()
        finally:
            self._depth -= 1
            if hooks and hooks.after_backward:
                hooks.after_backward()

    def _pre_step(self, optimizer, args, kwargs):
        if self._gate is None:
            return None                 # a step outside nanaudit's call: not ours to check
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            # The closure computes the loss and gradients inside step(): check after its first
            # evaluation, before the optimizer changes anything.
            checked = self._checked_closure(optimizer, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": checked}
            return (args[0], checked, *args[2:]), kwargs
        self._check(optimizer)
        return None

    def _checked_closure(self, optimizer, closure):
        first = [True]

        def checked():
            loss = closure()
            if first[0]:
                first[0] = False
                self._check(optimizer)
            return loss
        return checked

    def _check(self, optimizer) -> None:
        """The gate before one update; raises Halt to stop the call there."""
        run = self._run
        if run.halted is not None:
            raise Halt()                # a bare `except:` in the step swallowed the first one
        name = self._by_optimizer.get(id(optimizer), type(optimizer).__name__)
        count = len(self._pending)
        start = len(self._backwarded) - count
        names = [self._loss_name(start + i, name) for i in range(count)]
        point = UpdatePoint(run.updates, name, optimizer, list(self._pending), names)
        self._pending = []
        self._gated.append(point)
        if not self._gate(point):
            run.halted = point
            raise Halt()
        # Only the call's first update of each optimizer is copied: a trip puts the call's
        # updates back to the state before the call, whatever came between.
        if id(optimizer) not in self._snapshotted and (
                self._snapshot_all or self.hold_weights or self._updates_per_call is None
                or run.updates + 1 < self._updates_per_call):
            self._snapshotted.add(id(optimizer))
            run.undo.append(_undo_for(optimizer))
        run.updates += 1

    def _loss_name(self, position: int, optimizer_name: str) -> str | None:
        """A differentiated loss's name, learnt from the dicts earlier calls returned: by its
        place in the call, else the loss this optimizer stepped on."""
        if position < len(self._names_at) and self._names_at[position]:
            return self._names_at[position]
        return self._loss_of.get(optimizer_name)

    def _named_losses(self, returned) -> dict:
        """The floating scalar tensors the call returned, by name (logits, counts and Python
        floats beside them are not losses); a loss no check saw is detached for the loop."""
        if isinstance(returned, Mapping):
            items = [(str(k), v) for k, v in returned.items()]
        elif isinstance(returned, (list, tuple)):
            items = [(f"[{i}]", v) for i, v in enumerate(returned)]
        else:
            items = [("loss", returned)]
        losses = {n: v for n, v in items if isinstance(v, torch.Tensor)
                  and v.is_floating_point() and v.numel() == 1}
        if len(losses) == 1 and not isinstance(returned, Mapping):
            losses = {"loss": next(iter(losses.values()))}
        self._returned = losses
        checked = [t for point in self._gated for t in point.losses]
        ids = {id(t) for t in checked}
        out, self._named = {}, {}
        for n, t in losses.items():
            seen = t if id(t) in ids else _alias_of(t, checked)
            if seen is not None:
                self._named[id(seen)] = n
            out[n] = seen if seen is not None else t.detach()
        return out

    def _learn_names(self) -> None:
        ids = {**{id(t): n for n, t in self._returned.items()}, **self._named}
        if not ids:
            return
        for i, t in enumerate(self._backwarded):
            name = ids.get(id(t))
            if name:
                self._names_at += [None] * (i + 1 - len(self._names_at))
                self._names_at[i] = name
        for point in self._gated:
            for t in point.losses:
                if id(t) in ids:
                    self._loss_of[point.name] = ids[id(t)]

    def _abandon_scalers(self) -> None:
        for scaler in self._scalers:
            _forget_optimizers(scaler, self.session.optimizers.values())

    def replay(self, state: StepState, batch: Any = None,
               hooks: ReplayHooks | None = None) -> torch.Tensor:
        """The user's step again from the pre-step state, stopped where it tripped (the whole
        call when a returned loss tripped after it); returns the last bad loss it
        differentiated or returned, else the last one (the sink of a loss trip)."""
        state.rewind()
        halt_at = state.halt_at
        seen: list = []

        def gate(point: UpdatePoint) -> bool:
            seen.extend(point.losses)
            return halt_at is None or point.index < halt_at
        self._snapshot_all = True
        try:
            run = self.run(state.batch if batch is None else batch, gate, hooks)
        finally:
            self._snapshot_all = False
        for put_back in reversed(run.undo):
            put_back()              # the replay's own updates: state as before
        seen.extend(self._pending)
        if run.halted is None:
            seen.extend(self._returned.values())
        if not seen:
            raise UserCodeError(f"step `{self.session.loss_label}`",
                                RuntimeError("the step backpropagated no loss"))
        bad = [t for t in seen if not bool(torch.isfinite(t.detach()).all())]
        return (bad or seen)[-1]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _tensors(value) -> list:
    """The tensors of what autograd takes: one tensor or a sequence of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _alias_of(tensor: torch.Tensor, checked: list):
    """The checked loss a returned `loss.detach()` shares its storage with (no read needed)."""
    try:
        where = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        for t in checked:
            if (t.untyped_storage().data_ptr(), t.storage_offset()) == where:
                return t
    except (RuntimeError, NotImplementedError):
        return None
    return None


def _forget_optimizers(scaler, optimizers) -> None:
    """A GradScaler whose step was stopped (or replayed) must not remember the optimizers as
    unscaled or stepped: its `update()` never ran, and the next call unscales again."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        for optimizer in optimizers:
            states.pop(id(optimizer), None)


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
