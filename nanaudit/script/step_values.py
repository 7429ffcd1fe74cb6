"""What the script's hooks read off a step they do not own: the data among the model's first
call's arguments, the batch size, what a loss was divided by before backward (gradient
accumulation), the loss of one optimizer step, and when two runs' (or a replay's) losses
agree."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def data_inputs(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The data among a forward's arguments: the floating tensors of the first positional
    argument (a tensor, or a batch dict / tuple) and the floating keyword tensors, leaving out
    masks (a float attention mask holds -inf on purpose)."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and not kwargs:      # the common call: `model(x)`
        return [("input[0]", first)] if first.is_floating_point() else []
    leaves = tree_flatten(first)[0] if args else []
    named = [("input[0]" + (f"[{i}]" if len(leaves) > 1 else ""), t)
             for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    named += [(k, t) for k, t in kwargs.items()
              if isinstance(t, torch.Tensor) and "mask" not in k.lower()]
    return [(n, t) for n, t in named if t.is_floating_point()]


def continues_graph(args: tuple) -> bool:
    """Whether a call takes a tensor autograd tracks: another module's output, so the same
    forward goes on (a decoder called on the encoder's output); a micro-batch's first call,
    taking data, does not."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in (args if all(isinstance(a, torch.Tensor) for a in args)
                         else tree_flatten(args)[0]))


def caller_kwargs() -> dict:
    """The keyword arguments of the module call whose global pre-hook calls this
    (`model(**batch)`, as the Trainer calls it): PyTorch passes global pre-hooks only the
    positional ones, and this runs once per step, not per module."""
    frame = sys._getframe(2)
    if frame is not None and frame.f_code.co_name in ("_call_impl", "inner"):
        kwargs = frame.f_locals.get("kwargs")
        return kwargs if isinstance(kwargs, dict) else {}
    return {}


def leading_size(args: tuple, kwargs: dict) -> int | None:
    """The first dimension of the first tensor argument: the batch's rows."""
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def loss_factor(loss: torch.Tensor) -> float | None:
    """The Python number the loss was divided by (or multiplied by the inverse of) just before
    backward, as `loss / accumulation_steps` does; None otherwise. Read from the autograd node's
    saved scalar (a CPU number), never from the device."""
    node = loss.grad_fn
    name = type(node).__name__ if node is not None else ""
    if name not in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        return None
    other: Any = getattr(node, "_saved_other", None)
    if isinstance(other, torch.Tensor):
        if other.numel() != 1 or other.device.type != "cpu" or other.requires_grad:
            return None
        other = float(other)
    if not isinstance(other, (int, float)) or not other or not math.isfinite(other):
        return None
    return float(other) if name.startswith("Div") else 1.0 / float(other)


def window_loss(losses: list[float], factors: list) -> float:
    """The loss of one optimizer step from the losses that reached backward (as read on the
    host): their mean, or, when each was divided by the number of micro-batches in the window
    (gradient accumulation as nanoGPT, Accelerate, Lightning and the Trainer normalize it),
    their sum: the micro-batches' mean loss as the script computed it before dividing."""
    count = len(losses)
    if count == 1:
        return losses[0]
    total = sum(losses)              # not fsum: inf + -inf is NaN here, as on the device
    if all(f is not None and math.isclose(f, count, rel_tol=1e-6) for f in factors):
        return total
    return total / count


def same_value(a: float | None, b: float | None) -> bool:
    """Two runs' losses agree: NaN equals NaN, and 1e-4 relative allows a GPU kernel's
    reduction order (a run seeded differently is off by far more)."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-12)


def loss_mismatch(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why a replay did not reproduce the run: the first (run's, replay's) loss pair that
    differs (None: every one agrees)."""
    for i, (first, again) in enumerate(pairs):
        a, b = float(first.detach()), float(again.detach())
        if not same_value(a, b):
            return (f"the in-process replay of the step made loss {b:.6g} where the run saw "
                    f"{a:.6g} (micro-batch {i}): a non-deterministic op, or state the step "
                    f"reads outside the model's parameters and buffers")
    return None
