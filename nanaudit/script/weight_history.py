"""Who updated each parameter of a `nanaudit run` script, as the overflow rule asks it
(localize/weight_growth.py): the optimizer of the ledger that holds it, the step it last stepped
at, its group's learning rate as that update ran, and its weights' norm at its first check (the
step log's). Read at a trip only, by a walk over the optimizers' groups: nothing here runs on a
clean step."""

from __future__ import annotations

from typing import Any

import torch

from nanaudit.localize.weight_growth import WeightUpdate, group_of, lr_of
from nanaudit.script.ledger import Ledger, describe_optimizer


class LedgerWeights:
    """The script's WeightHistory: what its ledger and step log know of the optimizers."""

    def __init__(self, ledger: Ledger, first_norms: dict[int, float]) -> None:
        self.ledger, self.first_norms = ledger, first_norms

    def update_of(self, parameter: torch.Tensor) -> WeightUpdate | None:
        for optimizer in self.ledger.stepped.values():
            step = self.ledger.updated_at.get(id(optimizer))
            first = self.first_norms.get(id(optimizer))
            group = group_of(optimizer, parameter) if step is not None else None
            if group is not None and first is not None:
                return WeightUpdate(self.ledger.qualified_name(parameter),
                                    describe_optimizer(optimizer, self._rates(optimizer)), step,
                                    self._rate(optimizer, group), first)
        return None

    def _rates(self, optimizer: Any) -> list | None:
        return self.ledger.update_rates.get(id(optimizer))

    def _rate(self, optimizer: Any, group: dict) -> float | None:
        """The group's learning rate as the update ran (a scheduler may have moved it since)."""
        index = next(i for i, g in enumerate(optimizer.param_groups) if g is group)
        ran = lr_of({"lr": self.ledger.update_rate(optimizer, index)})
        return ran if ran is not None else lr_of(group)
