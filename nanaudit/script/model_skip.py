"""The cheap re-run of an input trip: the batch of step N was already non-finite when the model
got it, so only the script's data code made it, and the steps before N need not compute the
model. Each training call of a model before step N is stood in for by the output of the first
real call with the same signature (module, mode, the arguments' structure, shapes, dtypes and
devices): the script's loss code, logging and backward run on that copy, the model's weights
get no gradients, and its optimizers' steps update nothing.

This is sound only when the data code does not depend on what the model computed. Two ways it
can, and how each is caught:

* the data reads the model's output or weights (hard-example mining from the last loss, RL, a
  curriculum on the loss): the batch of step N is not the first run's; the parent compares the
  fingerprint of step N's bad input (data_window.same_batch) and falls back to the full
  re-run;
* the model draws from a global RNG stream (dropout) that the data code draws from too (its
  own `torch.rand`, a DataLoader's shuffle seeded from the global generator at each epoch): a
  stood-in call did not draw, so every later draw of the data code is shifted. Detected as it
  happens (the global generators' states before and after each real call and each stretch of
  data code), and the re-run is abandoned at once rather than traced to the end.

Anything else that breaks on the stand-in (the script raises, a check trips before step N) also
abandons it; the parent then re-runs in full and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler
from torch.utils._pytree import tree_flatten, tree_map_only

from nanaudit.errors import delegates
from nanaudit.run.compiled import dynamo_context
from nanaudit.run.step_record import RngStates, rng_states

Signature = tuple


def same_states(a: RngStates, b: RngStates) -> bool:
    """Two reads of the generators (step_record.rng_states) found them where they were."""
    return (torch.equal(a[0], b[0]) and len(a[1]) == len(b[1])
            and all(map(torch.equal, a[1], b[1])))


def signature(module: torch.nn.Module, args: tuple, kwargs: dict) -> Signature:
    """What decides the form of a call's output: the module, its mode, and its arguments'
    structure with each tensor's shape, dtype and device (other leaves by value)."""
    leaves, spec = tree_flatten((args, kwargs))
    return (id(module), module.training, repr(spec), tuple(
        (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
        else (type(x).__name__, x if isinstance(x, (int, float, bool, str, type(None)))
              else None) for x in leaves))


def trains(module: torch.nn.Module) -> bool:
    """A call that is the model's training forward (as the hooks tell it: autograd on, the
    module holds parameters)."""
    return torch.is_grad_enabled() and next(module.parameters(), None) is not None


def compiled(module: torch.nn.Module) -> bool:
    """A module whose calls are compiled (`torch.compile(model)`, `model.compile()`, Lightning's
    `from_compiled`): computed, never stood in for (the module a wrapper holds is then called at
    depth 1, computed too)."""
    return dynamo_context(module) is not None


class ModelSkip:
    """Stands in for the model's training calls before step `step` (see the module docstring);
    `current` tells the script's step. install() / remove() patch `nn.Module.__call__`."""

    def __init__(self, step: int, current: Callable[[], int]):
        self.step, self.current = step, current
        self.forms: dict[Signature, Any] = {}    # the first real call's output, detached
        self.drawing: set[Signature] = set()     # signatures whose real call drew from the RNG
        self.stood_in = 0                # calls not computed
        self.computed = 0                # calls computed (the first of each signature)
        self.shifted = False             # a stood-in call would have drawn from the RNG
        self.abandoned: str | None = None
        self._depth = 0
        self._stretch: RngStates | None = None
        self._original: Any = None
        self._unscale: Any = None

    def install(self) -> ModelSkip:
        original, skip = torch.nn.Module.__call__, self
        self._original = original

        @delegates
        def call(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if (skip._depth or skip.current() >= skip.step or not trains(module)
                    or compiled(module)):
                return original(module, *args, **kwargs)
            return skip._call(module, args, kwargs)
        torch.nn.Module.__call__ = call  # type: ignore[method-assign]
        self._unscale = _scaler_checks_stood_in_steps()
        return self

    def remove(self) -> None:
        if self._original is not None:
            torch.nn.Module.__call__ = self._original  # type: ignore[method-assign]
            self._original = None
        if self._unscale is not None:
            GradScaler._unscale_grads_ = self._unscale  # type: ignore[method-assign]
            self._unscale = None

    def _call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        key = signature(module, args, kwargs)
        form = self.forms.get(key)
        self._depth += 1
        try:
            if form is None:
                return self._computed(module, key, args, kwargs)
            self.stood_in += 1
            self.shifted = self.shifted or key in self.drawing
            # The hooks (nanaudit's and the script's) still run: only `forward` is replaced.
            saved = module.__dict__.get("forward")
            module.forward = lambda *a, **k: stand_in(form)
            try:
                return self._original(module, *args, **kwargs)
            finally:
                if saved is None:
                    del module.forward
                else:
                    module.forward = saved
        finally:
            self._depth -= 1

    def _computed(self, module: torch.nn.Module, key: Signature, args: tuple,
                  kwargs: dict) -> Any:
        before = rng_states()
        out = self._original(module, *args, **kwargs)
        if not same_states(before, rng_states()):
            self.drawing.add(key)
        self.forms[key] = tree_map_only(
            torch.Tensor, lambda t: Kept(t.detach().clone(), t.requires_grad), out)
        self.computed += 1
        return out

    def stretch_started(self) -> None:
        """A stretch of the script's data code starts (before its tracer is armed)."""
        self._stretch = rng_states() if self.shifted else None

    def stretch_ended(self) -> bool:
        """The stretch ends: False when it drew from a generator a stood-in call left behind
        (the data from here on is not the first run's: the re-run is to be abandoned)."""
        before, self._stretch = self._stretch, None
        if before is None or same_states(before, rng_states()):
            return True
        self.abandoned = (
            "the model draws from the global random stream (dropout) and so does the data code "
            "(its own random draws, or a DataLoader's shuffle seeded from it): without the "
            "model the data code's draws would differ")
        return False


@dataclass(frozen=True)
class Kept:
    """A tensor of a stored output (a pytree leaf), and whether the real one required grad."""

    tensor: torch.Tensor
    grad: bool


def _scaler_checks_stood_in_steps() -> Any:
    """Patch GradScaler's unscaling so that a step whose weights got no gradient (every call
    stood in for) still records its inf check, a finite one: else `scaler.step` asserts "No
    inf checks were recorded for this optimizer" and the cheap re-run of every AMP script
    failed. The optimizer's step then updates nothing, as without a scaler. Returns the
    original to put back (None: this torch has no such method)."""
    original = getattr(GradScaler, "_unscale_grads_", None)
    if original is None:
        return None

    def unscale_grads(scaler: Any, optimizer: Any, inv_scale: torch.Tensor,
                      found_inf: torch.Tensor, allow_fp16: bool) -> Any:
        found = original(scaler, optimizer, inv_scale, found_inf, allow_fp16)
        return found or {found_inf.device: found_inf}     # `found_inf` is a zero
    GradScaler._unscale_grads_ = unscale_grads  # type: ignore[method-assign,assignment]
    return original


def stand_in(form: Any) -> Any:
    """A fresh copy of a stored output: its tensors as new leaves (those that required grad
    require it), so that the loss code and backward run on them and reach no weight."""
    return tree_map_only(Kept, lambda k: k.tensor.clone().requires_grad_(k.grad), form)
