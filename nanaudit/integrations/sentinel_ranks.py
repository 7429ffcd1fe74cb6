"""`Sentinel` in the user's own FSDP2 loop under torchrun: the ranks check together.

Each `check_update` adds this rank's flags to the step's one read (run/rank_checks.py), so every
rank raises NonFiniteError at the same step, before the update, and the flags name the rank
whose own batch, loss, weights' shard or local gradients went bad. The finding is that rank's:
for a loss or gradient trip every rank replays its own micro-batch under the tracer at once
(localize/sharded_replay.py: the replay's all-gathers and reduce-scatters need every rank), and
the finding of the rank whose own op made the value is every rank's. A DDP model is checked as
before, by each rank alone.
"""

from __future__ import annotations

import math

import torch

from nanaudit.run.rank_checks import RankChecks
from nanaudit.run.sharded import fsdp_modules
from nanaudit.run.step import Trip


def join_ranks(model: torch.nn.Module) -> RankChecks | None:
    """The ranks of an FSDP2 model's run, its reduce-scatters flagged (None: not sharded, or
    one process)."""
    if not fsdp_modules(model):
        return None
    checks = RankChecks.join()
    if checks is not None:
        checks.saw_model(model)
    return checks


def with_rank_flags(checks: RankChecks, values: torch.Tensor, head: int,
                    window: int) -> torch.Tensor:
    """The step's values ([weights' norm, gradients' norm, (scale)], each micro-batch's
    finiteness flag, each one's loss) followed by every rank's flags (no host read). Sentinel
    reads no buffers here: their column is finite."""
    flags, losses = values[head:head + window], values[head + window:]
    one = torch.ones((), dtype=torch.float64, device=values.device)
    summary = torch.stack([flags.min() if window else one, values[0],
                           losses.sum() if window else one - 1, values[1], one - 1])
    return torch.cat([values, checks.table(summary)])


def rank_trip(checks: RankChecks, step: int, table: list, last_step: int | None,
              flags: list, losses: list, gnorm: float) -> tuple[Trip | None, int | None]:
    """(the trip every rank sees, the micro-batch of this rank's window to replay: its first
    with a bad input or loss, else the last)."""
    verdict = checks.verdict(step, table, last_step)
    if verdict is None:
        return None, None
    bad = [i for i, (ok, loss) in enumerate(zip(flags, losses))
           if ok < 1.0 or not math.isfinite(loss)]
    where = bad[0] if bad else (len(losses) - 1 if losses else None)
    loss = losses[where] if where is not None else None
    return Trip.found(verdict, loss, gnorm, rank=verdict.part), where
