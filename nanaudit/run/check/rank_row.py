"""Under torchrun, each rank's row of flags in the step's one exchange, and the table every rank
reads back: one layout for `scan`'s step loop, `nanaudit run`'s script auditor and `Sentinel`.

A rank's row says whether its own batch, weights (its own shards under FSDP or ZeRO), loss,
gradients before the reduction mixed them, gradients as reduced, partial sums before tensor
parallel's all-reduce and floating buffers went bad, and whether its data ran out. Every rank
adds its row to one small all-reduce (MAX) read with the step's values, so every rank holds the
same table and decides alike; `RankTable.verdict` turns it into the check that tripped by the
one per-rank rule (verdict.rank_verdict). A front end that has no value for a column (the loop
reads no TP partials, a script's data never runs out under nanaudit) leaves it 0.0: finite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from nanaudit.run.check.verdict import Tripped, rank_verdict
from nanaudit.run.checks import StepReadout, peak
from nanaudit.run.mesh import own_gradients, own_losses


class Column(IntEnum):
    """A rank's flags, in row order (1.0: set, 0.0: finite; PARTIALS: how early, see mesh.py).
    The first five follow the step values `rank_row` reads, so one reduction flags them."""

    INPUT = 0            # its batch holds a non-finite value
    WEIGHTS = 1          # its weights as the step found them (FSDP, ZeRO: its own shards)
    LOSS = 2             # its loss
    GRADIENTS = 3        # its gradients as reduced (FSDP: its shard of them)
    BUFFERS = 4          # its floating buffers as its forward left them
    OWN_GRADIENTS = 5    # its own gradients, before the reduction mixed every rank's (TP:
                         # above 1.0, how early a partial input gradient went bad, mesh.py)
    PARTIALS = 6         # TP: its partial sums before the all-reduce (mesh.PartialFlags)
    EXHAUSTED = 7        # its data ran out: every rank stops after this step


WIDTH = len(Column)


def rank_row(values: torch.Tensor, own_gradients: torch.Tensor,
             partials: torch.Tensor | None = None, exhausted: bool = False) -> torch.Tensor:
    """This rank's row, on the device (no host read), from its step values (float64: [inputs
    finite (1.0), weights' norm, loss, gradients' norm, buffers' peak]), its own gradients'
    flag, its partials' earliness (None: 0.0) and whether its data ran out."""
    bad = (~torch.isfinite(values)).to(torch.float64)     # weights, loss, grads, buffers
    zero = values.new_zeros((), dtype=torch.float64)
    own = torch.stack([own_gradients, partials if partials is not None else zero,
                       zero + 1.0 if exhausted else zero])
    return torch.cat([1.0 - values[:1], bad[1:], own])


def readout_values(readout: StepReadout, loss: torch.Tensor,
                   leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step loop's values for `rank_row` from its readout and its batch's leaves (the state
    norm covers its floating buffers: the buffers' column stays finite)."""
    zero = readout.values.new_zeros((), dtype=torch.float64)
    return torch.stack([inputs_finite(leaves, zero), readout.state_norm(),
                        loss.detach().to(zero).reshape(()), readout.grad_norm(), zero])


def inputs_finite(leaves: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """1.0 when every element of the batch's floating leaves is finite, else 0.0, on `like`'s
    device. From each leaf's peak (checks.peak), not from the readout's batch norm: a float32
    sum of squares overflows on finite values past about 1e19, and a rank's flag is never
    confirmed later the way a single process confirms a non-finite norm (checks.batch_finite)."""
    peaks = [peak(t).to(torch.float64) for t in leaves if t.is_floating_point() and t.numel()]
    if not peaks:
        return like + 1.0
    return torch.isfinite(torch.stack(peaks)).all().to(like)


@dataclass(frozen=True)
class RankTable:
    """The exchanged table as the host read it: one row of `Column`s per rank, in rank order."""

    rows: tuple[Sequence[float], ...]

    @classmethod
    def from_read(cls, values: Sequence[float], world_size: int) -> RankTable:
        """The table from the read's tail (`world_size` rows of WIDTH values)."""
        return cls(tuple(values[r * WIDTH:(r + 1) * WIDTH] for r in range(world_size)))

    @staticmethod
    def size(world_size: int) -> int:
        """How many values the table adds to the step's read."""
        return world_size * WIDTH

    def ok(self, column: Column) -> list[bool]:
        """Per rank, in rank order: is `column` unset?"""
        return [not row[column] > 0 for row in self.rows]

    def exhausted(self) -> bool:
        """Did any rank run out of data (then all stop after this step)?"""
        return not all(self.ok(Column.EXHAUSTED))

    def doubts_state(self) -> bool:
        """Does some rank flag its weights or reduced gradients (a float32 sum of squares
        may have overflowed on finite values: confirmed before it trips)?"""
        return not all(self.ok(Column.WEIGHTS)) or not all(self.ok(Column.GRADIENTS))

    def verdict(self, step: int, *, updated_at: int | None, sharded: bool,
                weights_finite: bool | list[bool] | None = None,
                reduced_finite: bool | list[bool] | None = None) -> Tripped | None:
        """The check that tripped, with the first rank whose own value went bad as its part.

        `sharded`: each rank holds its own shard of the weights and reduced gradients (FSDP,
        ZeRO), so the first rank whose shard went bad is named. Otherwise every rank holds the
        same ones (DDP) and they name no rank: `weights_finite` / `reduced_finite` are this
        rank's confirmed reading of them when the caller has one (the step loop confirms a
        non-finite norm element by element), else any rank's flag decides. Sharded, they are
        every rank's confirmed readings (lists by rank) when the caller exchanged them."""
        own_weights = self.ok(Column.WEIGHTS)
        if sharded:         # by rank: the ranks' confirmed readings when the caller has them
            weights: bool | list[bool] = (weights_finite if isinstance(weights_finite, list)
                                          else own_weights)
        else:
            weights = all(own_weights) if weights_finite is None else _every(weights_finite)
        reduced = (all(self.ok(Column.GRADIENTS)) if reduced_finite is None
                   or (sharded and not isinstance(reduced_finite, list))
                   else _every(reduced_finite))
        partials = [row[Column.PARTIALS] for row in self.rows]
        return rank_verdict(step, inputs_ok=self.ok(Column.INPUT), weights_finite=weights,
                            updated_at=updated_at,
                            loss_finite=own_losses(self.ok(Column.LOSS), partials),
                            own_grads_ok=own_gradients(
                                [row[Column.OWN_GRADIENTS] for row in self.rows]),
                            reduced_ok=reduced,
                            buffers_finite=self.ok(Column.BUFFERS))


def _every(finite: bool | list[bool]) -> bool:
    return all(finite) if isinstance(finite, list) else finite
