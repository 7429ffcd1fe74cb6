"""The user's own step (`step:` in the config): their `step(model, batch, optimizer)` runs
forward, backward and every optimizer step itself, and nanaudit checks before each update.

The call is seen through the shared interception (intercept.py): the losses it differentiates
(before any loss scaling), and each optimizer's step pre-hook, where the loop's gate reads that
optimizer's gradients and parameters and the losses backpropagated since, and raises
`StepHalted` out of the hook before a bad update. The updates made earlier in the same call are
put back from copies taken just before them (only when a later optimizer step may follow in the
call), so a replay starts from the state before the call.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from nanaudit.config.schema import RunOptions
from nanaudit.errors import UserCodeError, call_user
from nanaudit.run.intercept import LossTap, StepHalted, checked_closure_args
from nanaudit.run.loss_names import LossNames
from nanaudit.run.step import ReplayHooks, StepState


class StepSession(Protocol):
    """What the user's step reads of the run's session (session.Session, which builds its step
    unit and so is not imported here)."""

    @property
    def model(self) -> Any: ...
    @property
    def optimizers(self) -> dict: ...
    @property
    def precision(self) -> Any: ...
    @property
    def step_fn(self) -> Callable | None: ...
    @property
    def loss_label(self) -> str: ...
    @property
    def options(self) -> RunOptions: ...


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

    def __init__(self, session: StepSession):
        self.session = session
        self.hold_weights = False       # bisect over data: every update is put back after the call
        self._gate: Callable[[UpdatePoint], bool] | None = None
        self._run: UserRun | None = None
        self._pending: list = []
        self._backwarded: list = []      # every loss this call differentiated, in order
        self._gated: list = []           # the UpdatePoints this call checked
        self._names = LossNames()        # the returned losses' names, learnt (loss_names.py)
        self._updates_per_call: int | None = None   # the most updates a complete call made
        self._snapshot_all = False       # a replay: every update it makes is put back
        self._snapshotted: set = set()   # ids of the optimizers copied in this call
        self._scalers: list = []         # the GradScalers this call scaled a loss with
        self._hooks: ReplayHooks | None = None
        self._by_optimizer = {id(o): n for n, o in session.optimizers.items()}
        self._trained = {id(p) for o in session.optimizers.values()
                         for g in o.param_groups for p in g["params"]}
        self._handles = [o.register_step_pre_hook(self._pre_step)
                         for o in session.optimizers.values()]

    @property
    def optimizer_argument(self) -> Any:
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
        self._backwarded, self._gated = [], []
        self._names.begin()
        self._snapshotted, self._scalers = set(), []
        saved_scalers: list = []
        step_fn = self.session.step_fn
        assert step_fn is not None, "a UserStep is built for a config's `step:` only"
        tap = self._tap(saved_scalers).install()
        try:
            self.session.model.zero_grad(set_to_none=True)
            with self.session.precision.autocast():
                returned = call_user(f"step `{self.session.loss_label}`", step_fn,
                                     self.session.model, batch, self.optimizer_argument,
                                     **dict(self.session.options.loss_args))
            self._run.losses = self._names.named_losses(returned, self._gated)
            self._names.learn(self._backwarded, self._gated)
            self._updates_per_call = max(self._updates_per_call or 0, self._run.updates)
        except StepHalted:
            self._abandon_scalers()     # stopped inside `scaler.step`: no `update()` followed
        finally:
            tap.remove()
            self._gate = None
        for scaler, state in saved_scalers:       # a replay leaves the user's scaler as it was
            scaler.load_state_dict(state)
            _forget_optimizers(scaler, self.session.optimizers.values())
        if self.hold_weights and self._run.halted is None:
            for put_back in reversed(self._run.undo):
                put_back()
            self._run.undo, self._run.updates = [], 0
        return self._run

    def _tap(self, saved_scalers: list) -> LossTap:
        """What the call differentiates and scales with, seen for the call's duration."""
        hooks = self._hooks

        def on_scale(scaler: Any) -> None:
            if not any(s is scaler for s in self._scalers):
                self._scalers.append(scaler)
                if self._snapshot_all and getattr(scaler, "is_enabled", lambda: False)():
                    saved_scalers.append((scaler, scaler.state_dict()))

        def on_loss(loss: torch.Tensor) -> None:
            self._pending.append(loss)
            self._backwarded.append(loss)
        after = hooks.after_backward if hooks else None
        return LossTap(on_loss, before=hooks.before_backward if hooks else None,
                       after=(lambda raised: after()) if after is not None else None,
                       on_scale=on_scale, trained=self._trained)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._gate is None:
            return None                 # a step outside nanaudit's call: not ours to check
        evaluations = [0]

        def after_closure() -> None:
            # The closure computes the loss and gradients inside step(): check after its first
            # evaluation, before the optimizer changes anything.
            evaluations[0] += 1
            if evaluations[0] == 1:
                self._check(optimizer)
        wrapped = checked_closure_args(args, kwargs, after_closure)
        if wrapped is not None:
            return wrapped
        self._check(optimizer)
        return None

    def _check(self, optimizer: torch.optim.Optimizer) -> None:
        """The gate before one update; raises StepHalted to stop the call there."""
        run, gate = self._run, self._gate
        assert run is not None and gate is not None, "checked only inside run()"
        if run.halted is not None:
            raise StepHalted()                # a bare `except:` in the step swallowed the first one
        name = self._by_optimizer.get(id(optimizer), type(optimizer).__name__)
        count = len(self._pending)
        start = len(self._backwarded) - count
        names = [self._names.name(start + i, name) for i in range(count)]
        point = UpdatePoint(run.updates, name, optimizer, list(self._pending), names)
        self._pending = []
        self._gated.append(point)
        if not gate(point):
            run.halted = point
            raise StepHalted()
        # Only the call's first update of each optimizer is copied: a trip puts the call's
        # updates back to the state before the call, whatever came between.
        if id(optimizer) not in self._snapshotted and (
                self._snapshot_all or self.hold_weights or self._updates_per_call is None
                or run.updates + 1 < self._updates_per_call):
            self._snapshotted.add(id(optimizer))
            run.undo.append(_undo_for(optimizer))
        run.updates += 1

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
            seen.extend(self._names.returned.values())
        if not seen:
            raise UserCodeError(f"step `{self.session.loss_label}`",
                                RuntimeError("the step backpropagated no loss"))
        bad = [t for t in seen if not bool(torch.isfinite(t.detach()).all())]
        return (bad or seen)[-1]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _forget_optimizers(scaler: Any, optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """A GradScaler whose step was stopped (or replayed) must not remember the optimizers as
    unscaled or stepped: its `update()` never ran, and the next call unscales again."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states is not None:
        for optimizer in optimizers:
            states.pop(id(optimizer), None)


def _undo_for(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
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
