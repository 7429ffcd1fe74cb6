"""Which check tripped: the one decision every checker makes from a step's finiteness flags.

The step loop (one process or a rank table under torchrun), `Sentinel` in the user's loop and
the `nanaudit run` script auditor each read a step's flags their own way, but name what went
bad by the same rule, in step order: the batch (input), the weights as the last update left
them (optimizer, when an update ran since the last read, else parameter), the state the step's
forward changed (a floating buffer, read live by `nanaudit run`), the loss, then the
gradients. Where the step has parts (ranks, micro-batches) the first bad part is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanaudit.report.vocabulary import Check

# One flag for the whole step, or one per part (rank or micro-batch) in order.
Flags = bool | Sequence[bool]


@dataclass(frozen=True)
class Tripped:
    """The check that tripped, the step that made the value (for OPTIMIZER the step of the
    update, not the step whose read saw it), and the part whose own value it was."""

    check: Check
    step: int
    part: int | None = None     # the first bad rank or micro-batch; None: the whole step's
    in_forward: bool = False    # PARAMETER: a buffer this step's forward made non-finite


def tripped_check(step: int, *, inputs_ok: Flags, weights_finite: Flags,
                  updated_at: int | None, loss_finite: Flags,
                  grads_finite: Flags, buffers_finite: Flags = True) -> Tripped | None:
    """The first check that tripped at `step`, or None when all are finite.

    `updated_at`: the step whose update ran since the weights were last read finite (None:
    none ran). Bad weights then blame that update, and otherwise were bad before this step.
    `buffers_finite`: the floating buffers as the step's forward left them (read after it;
    finite at the read before). A flag given per part names the first part that is False."""
    tripped, part = _first_bad(inputs_ok)
    if tripped:
        return Tripped(Check.INPUT, step, part)
    # One flag when the weights are the same on every part (DDP keeps them in step); one per
    # rank when each holds its own shard of them (FSDP): the first bad shard's rank is named.
    tripped, part = _first_bad(weights_finite)
    if tripped:
        if updated_at is not None:
            return Tripped(Check.OPTIMIZER, updated_at, part)
        return Tripped(Check.PARAMETER, step, part)
    tripped, part = _first_bad(buffers_finite)
    if tripped:
        return Tripped(Check.PARAMETER, step, part, in_forward=True)
    for check, flags in ((Check.LOSS, loss_finite), (Check.GRADIENT, grads_finite)):
        tripped, part = _first_bad(flags)
        if tripped:
            return Tripped(check, step, part)
    return None


def rank_verdict(step: int, *, inputs_ok: Sequence[bool], weights_finite: Flags,
                 updated_at: int | None, loss_finite: Flags, own_grads_ok: Sequence[bool],
                 reduced_ok: bool, buffers_finite: Flags = True) -> Tripped | None:
    """The check that tripped under torchrun, from every rank's flags (the same on every rank),
    by the one per-rank rule of the step loop, `nanaudit run` and `Sentinel`: a rank's own
    batch, weights (its shards), buffers, loss or own gradients (before the reduction mixed
    them) name it; gradients that are bad only once reduced (the average overflowed where no
    rank's own did) name no rank."""
    grads: Flags = list(own_grads_ok) if not all(own_grads_ok) else reduced_ok
    return tripped_check(step, inputs_ok=inputs_ok, weights_finite=weights_finite,
                         updated_at=updated_at, loss_finite=loss_finite, grads_finite=grads,
                         buffers_finite=buffers_finite)


def _first_bad(flags: Flags) -> tuple[bool, int | None]:
    """(whether a flag is False, the first False part's index: None for a whole-step flag)."""
    if isinstance(flags, bool):
        return not flags, None
    part = next((i for i, ok in enumerate(flags) if not ok), None)
    return part is not None, part
