"""What the step tap decides about the window of a step that calls no module (a model of raw
tensors, whose code is recorded from the step's start: run/step_record.py's `code_window`):
which of its losses the script skipped before `backward`, and whether a module it calls under
`no_grad` in the first step's window is an evaluation before training or part of the step.

A skipped loss is read off the recorded code (run/loss_code.py: a differentiable scalar no op
read), with one host read, only in a step whose code made such a scalar: at its first backward
when its loss line ran again before it (`if not torch.isfinite(loss): continue`), or at the
script's end when the step reached no backward. A non-finite one joins the window's losses
(the step's check reads it, the replay verifies it) and marks the window skipped."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from nanaudit.run.step_record import ModelCall


class Untrained(enum.Enum):
    """What a module call under `no_grad` in the first step's window does to it."""

    KEEP = "keep"           # a parameterless module (a step's own ReLU), or after a backward
    RESTART = "restart"     # a frozen module's: part of the step, the window starts again
    DROP = "drop"           # an evaluation of a model being trained: the window is dropped


def untrained(window: ModelCall | None, module: torch.nn.Module, trained: bool) -> Untrained:
    """A module called under `no_grad` in the window opened at the optimizer's construction
    (`trained`: an optimizer the script built holds its parameters, script/trained.py).
    Of a model an optimizer trains, it is an evaluation before training (Lightning's sanity
    check) whose activations a recording would keep: DROP. Of a module no optimizer holds (a
    frozen encoder whose features a head of raw tensors trains on), it is part of the step:
    the window starts again at its call (until a backward), so an evaluation of it before
    training keeps no more than its last call's activations, and what the step read before the
    call (its batch) is the replay's leaves."""
    if window is None or next(module.parameters(), None) is None:
        return Untrained.KEEP
    if trained:
        return Untrained.DROP
    return Untrained.KEEP if window.code.roots else Untrained.RESTART


def reached(window: ModelCall | None, loss: torch.Tensor, first: bool) -> Sequence[torch.Tensor]:
    """A loss of a step that calls no module reaching backward (`first`: the window's first):
    it joins the window's losses, after the non-finite ones its code skipped before it
    (`earlier_skipped`), which are returned."""
    if window is None:
        return ()
    skipped = earlier_skipped(window) if first else []
    window.losses += [*skipped, loss]
    return skipped


def earlier_skipped(window: ModelCall) -> list[torch.Tensor]:
    """The non-finite losses of earlier passes over the window's code that reached no
    backward (LossCode.earlier_losses), at its first backward."""
    skipped = _nonfinite(window.code.earlier_losses())
    window.skipped = window.skipped or bool(skipped)
    return skipped


def last_skipped(window: ModelCall) -> torch.Tensor | None:
    """The first non-finite differentiable scalar no op read, of a window that reached no
    backward at all (the script ended after its loop's last pass skipped its loss); it joins
    the window's losses."""
    code = window.code
    if window.losses or code.roots or code.overflowed:
        return None
    loss = next(iter(_nonfinite(code.dead_losses())), None)
    if loss is not None:
        window.skipped = True
        window.losses.append(loss)
    return loss


def _nonfinite(losses: list[torch.Tensor]) -> list[torch.Tensor]:
    """Those of `losses` that are non-finite: one host read for all of them (none if none)."""
    if not losses:
        return []
    finite = torch.isfinite(torch.stack([t.detach().float() for t in losses])).tolist()
    return [t for t, ok in zip(losses, finite) if not ok]
