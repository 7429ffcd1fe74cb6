"""What the checks read of an optimizer's own state: which state entries of a parameter hold
the non-finite value an update wrote (Adam's `exp_avg_sq`, say, on one rank's shard), and the
zero-gradient step that `torch.distributed.checkpoint` takes to create the state, which is no
training step.

Both run on rare steps only (a trip, a step of an optimizer without state at lr 0): the reads
here are per tensor, which the every-step path never does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nanaudit.run.checks import value_kind
from nanaudit.run.sharded import describe_shard, local_shard, local_shards

_RATE = operator.methodcaller("get", "lr")
_NUMBERS = {float, int}


def creates_state_only(optimizer: Any) -> bool:
    """Is this `optimizer.step()` the one that torch.distributed.checkpoint's
    get/set_optimizer_state_dict take to create the state of an optimizer that has none yet
    (`_init_optim_state`: every gradient zero, lr 0 in every group)? It changes no weight and is
    no training step. Known by what it is: no state, lr 0 everywhere, and every gradient zero
    (one read, on such a step only)."""
    groups = getattr(optimizer, "param_groups", None)
    if getattr(optimizer, "state", True) or not groups:
        return False
    # A stateless optimizer (SGD) asks at every step: rates that are plain numbers are
    # compared in C (no Python call a group); others (a tensor, none) one by one.
    rates = list(map(_RATE, groups))
    if set(map(type, rates)) <= _NUMBERS:
        if rates.count(0) != len(rates):
            return False
    elif any(rate is None or not _is_zero(rate) for rate in rates):
        return False
    grads = local_shards([p.grad for group in groups for p in group["params"]
                          if p.grad is not None])
    if not grads:
        return False
    return not bool(torch.stack([g.count_nonzero() for g in grads]).sum())


def _is_zero(lr: Any) -> bool:
    """Without a host read: a stateless optimizer (SGD) asks this at every step, and a rate
    kept in a device tensor is never DCP's (it sets a CPU one)."""
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        return False
    return float(lr) == 0.0


def nonfinite_state(optimizer: Any, params: list, name: Callable[[Any], str],
                    rank: int | None = None) -> list[str]:
    """For each parameter in `params`, the optimizer-state entries holding NaN or Inf on this
    process (its shard under FSDP): `exp_avg_sq of blocks.0.fc.weight holds nan in rank 1's
    shard (rows 4-7 of 8)`."""
    state = getattr(optimizer, "state", None) or {}
    notes = []
    for p in params:
        entries = state.get(p) or {}
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            shard = local_shard(value).detach()
            if not shard.numel() or bool(torch.isfinite(shard).all()):
                continue
            where = describe_shard(value, rank)
            notes.append(f"the optimizer state `{key}` of {name(p)} holds {value_kind(shard)}"
                         + (f" in {where}" if where else ""))
    return notes


def explain_state(finding: Any, optimizers: Iterable, params: list, names: dict,
                  rank: int | None) -> None:
    """Add to `finding` each optimizer-state entry of `params` holding the value (`names`:
    id(parameter) -> its name)."""
    for optimizer in optimizers:
        for note in nonfinite_state(optimizer, params, lambda p: names.get(id(p), "?"), rank):
            finding.explain(note)
