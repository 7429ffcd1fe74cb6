"""The bundled demo: a sensor regressor whose hand-written magnitude feature breaks on one row.

Batch 6 holds a reading whose sensors all dropped out (a row of zeros). The forward pass stays
finite (sqrt(0) = 0), but the derivative of sqrt at 0 is infinite, so backward turns the
gradients NaN: the case `detect_anomaly` blames on the wrong op and no sentinel on the loss sees."""
from collections.abc import Iterator

import torch
from torch import nn

FEATURES = 8
BATCH = 16
BATCHES = 12
BAD_BATCH, BAD_ROW = 6, 5


class Magnitude(nn.Module):
    """Scales each sensor by a learned gain and appends the row's Euclidean length."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(FEATURES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x * self.gain
        length = torch.sqrt((z * z).sum(dim=1, keepdim=True))
        return torch.cat([z, length], dim=1)


class SensorRegressor(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.features = Magnitude()
        self.mlp = nn.Sequential(nn.Linear(FEATURES + 1, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.features(x)).squeeze(1)


def build_model(hidden: int = 32) -> nn.Module:
    return SensorRegressor(hidden)


def batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    for index in range(BATCHES):
        x = torch.randn(BATCH, FEATURES, generator=generator)
        y = x.sum(dim=1) + 0.1 * torch.randn(BATCH, generator=generator)
        if index == BAD_BATCH:
            x[BAD_ROW] = 0.0   # every sensor dropped out
        yield {"x": x, "y": y}


def clean_batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    for batch in batches(seed):
        batch["x"] = batch["x"] + (batch["x"] == 0).all(dim=1, keepdim=True) * 0.5
        yield batch


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch["x"]), batch["y"])


def poisoned_batches(seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """The demo data with two more faults: a NaN reading (batch 2) and an inf target (batch 9)."""
    for index, batch in enumerate(batches(seed)):
        if index == 2:
            batch["x"][11, 3] = float("nan")
        if index == 9:
            batch["y"][0] = float("inf")
        batch["id"] = torch.arange(index * BATCH, (index + 1) * BATCH)
        yield batch
