"""Under torchrun, each step's table of every rank's flags: what lets every rank stop at the same
step and name the rank whose own batch, loss or gradients went bad (distributed.py exchanges it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nanaudit.run.checks import StepReadout
from nanaudit.run.distributed import EXHAUSTED, FLAGS, Coordinator


def rank_row(coord: Coordinator, readout: StepReadout, loss: torch.Tensor,
             exhausted: bool) -> torch.Tensor:
    """This rank's flags for the exchange, in FLAGS order, all on the device (no sync)."""
    bad_loss = (~torch.isfinite(loss.detach())).to(torch.float64).reshape(())
    grad_flag = coord.local_gradient_flag(readout.grad_norm)
    norms = torch.stack([readout.state_norm(), readout.grad_norm()])
    bad_state, bad_grads = (~torch.isfinite(norms)).to(torch.float64)
    return torch.stack([readout.batch_bad(), bad_loss, grad_flag.reshape(()),
                        torch.tensor(float(exhausted), dtype=torch.float64,
                                     device=readout.values.device), bad_state, bad_grads])


@dataclass(frozen=True)
class RankTable:
    """The exchanged table as the host read it: one row of FLAGS per rank (1.0: set)."""

    rows: list[Sequence[float]]

    @classmethod
    def from_read(cls, values: Sequence[float], world_size: int) -> RankTable:
        width = len(FLAGS)
        return cls([values[r * width:(r + 1) * width] for r in range(world_size)])

    @staticmethod
    def size(world_size: int) -> int:
        """How many values the table adds to the step's readout."""
        return world_size * len(FLAGS)

    def ok(self, flag: str) -> list[bool]:
        """Per rank, in rank order: is `flag` unset (its batch, loss or gradients finite)?"""
        index = FLAGS.index(flag)
        return [not row[index] > 0 for row in self.rows]

    def exhausted(self) -> bool:
        """Did any rank run out of data (then all stop after this step)?"""
        return not all(self.ok(EXHAUSTED))
