"""A tiny training run for `scan --keep-going`: Linear, BatchNorm and Dropout, with bad batches
of three kinds at known steps (forward: a NaN input; backward: sqrt(0) whose gradient is
infinite; loss: log(0) in the loss code). `BUILT` keeps each model built, so a test can compare
the model a scan trained with a reference loop's."""

from __future__ import annotations

import torch
from torch import nn

BAD = {2: "forward", 4: "backward", 6: "loss"}
BUILT: list[nn.Module] = []


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU(),
                          nn.Linear(8, 1))
    BUILT.append(model)
    return model


def batch(index: int, kind: str | None = None):
    gen = torch.Generator().manual_seed(100 + index)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)
    gate, scale = torch.ones(()), torch.ones(())
    if kind == "forward":
        x[3, 1] = float("nan")
    elif kind == "backward":
        gate = torch.zeros(())
    elif kind == "loss":
        scale = torch.zeros(())
    return {"x": x, "y": y, "gate": gate, "scale": scale}


def batches(count: int = 10, bad: dict | None = None, every: str | None = None,
            noise: bool = False):
    """`bad`: data index -> kind (default BAD); `every`: every batch is of that kind (a
    corrupt shard); `noise`: each batch's inputs jittered from the global torch RNG, as an
    augmentation in the data pipeline draws between steps."""
    kinds = BAD if bad is None else {int(k): v for k, v in bad.items()}
    for index in range(count):
        made = batch(index, every or kinds.get(index))
        if noise:
            made["x"] = made["x"] + 0.01 * torch.randn(made["x"].shape)
        yield made


def compute_loss(model: nn.Module, batch) -> torch.Tensor:
    out = model(batch["x"])
    return (((out - batch["y"]) ** 2).mean() + torch.sqrt(batch["gate"] * out.pow(2).mean())
            - torch.log(batch["scale"]))


def train_step(model: nn.Module, batch, optimizer) -> torch.Tensor:
    """The same training as the user's own step (`step:`)."""
    optimizer.zero_grad()
    loss = compute_loss(model, batch)
    loss.backward()
    optimizer.step()
    return loss


OPTIMIZERS: list[torch.optim.Optimizer] = []


def fused_adam(model: nn.Module) -> torch.optim.Optimizer:
    """A fused Adam (it takes `found_inf`, so the deferred read can skip its update on the
    device); kept in OPTIMIZERS, so a test can compare its state."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    OPTIMIZERS.append(optimizer)
    return optimizer
