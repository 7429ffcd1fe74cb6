"""Holding back the update of a step `nanaudit run --keep-going` skips, from inside the
optimizer's own `step()` call (the check runs in its pre-hook, or when its closure returns).

PyTorch's step pre-hooks cannot cancel the call, so the update is made a no-op instead: every
parameter of the optimizer is shown without a gradient for that one call (torch's optimizers
leave a parameter whose `.grad` is None untouched: no moment, no step count, no weight decay;
LBFGS sees a zero gradient and returns before it moves). After the call, in the post-hook, the
gradients are put back (the script's own `zero_grad()` clears them, as after any step: nanaudit
does not do that for it) and the optimizer's state is put back from a shallow copy taken when
the step was held (a per-step counter an optimizer bumps before it looks at the gradients,
LBFGS's `func_evals`, is restored with it; its tensors were not touched).

Under a GradScaler the scaler has already decided to step; its record of this optimizer is
marked as an overflow, so the script's `scaler.update()` works (it needs the record) and leaves
the scale as the scaler leaves it after any skipped step (backed off, the growth count reset):
one rule for every skipped step under a scaler, the scaler's own. Nothing here runs on a clean
step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class _Held:
    """An optimizer whose update is held back: its parameters' gradients and its state."""

    optimizer: Any
    params: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    state: dict[Any, dict]


def _mark_overflow(scaler: Any, optimizer: Any) -> None:
    """The scaler's record of `optimizer` this step says inf, as after an overflow."""
    record = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if record is None:
        return
    for found_inf in record.get("found_inf_per_device", {}).values():
        found_inf.fill_(1.0)


class HeldUpdates:
    """The optimizers whose update this step holds back. `active`: a step was skipped and no
    forward came since, so every other optimizer stepped before the next forward (several
    optimizers, one step) is held back too; False whenever nothing is held (a clean step's
    callers read it and call nothing)."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}
        self.active = False

    def hold(self, optimizer: Any, scaler: Any = None) -> None:
        """Make `optimizer`'s running (or next) `step()` a no-op (see the module docstring)."""
        self.active = True
        if id(optimizer) in self._held or not hasattr(optimizer, "param_groups"):
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state = getattr(optimizer, "state", {})
        self._held[id(optimizer)] = _Held(optimizer, params, [p.grad for p in params],
                                          {p: dict(s) for p, s in state.items()})
        for p in params:
            p.grad = None
        if scaler is not None:
            _mark_overflow(scaler, optimizer)

    def holds(self, optimizer: Any) -> bool:
        return id(optimizer) in self._held

    def release(self, optimizer: Any) -> bool:
        """After `optimizer`'s held step: its gradients and state put back. False: not held."""
        held = self._held.pop(id(optimizer), None)
        if held is None:
            return False
        for p, g in zip(held.params, held.grads):
            p.grad = g
        state = optimizer.state
        for p in [p for p in state if p not in held.state]:
            del state[p]
        for p, saved in held.state.items():
            now = state[p]
            now.clear()
            now.update(saved)
        return True

    def next_step(self) -> None:
        """The next step began (its first module call, or its first backward: a script that
        calls its layers' `forward` itself calls no module): whatever is still held (an
        optimizer whose step never ran, DeepSpeed's own skip) is released, and the next step
        is checked again."""
        for held in list(self._held.values()):
            self.release(held.optimizer)
        self.active = False
