"""A small model for `torchrun --nproc-per-node 4 -m nanaudit scan tp_backward_nan.yaml`: a value
made in one tensor-parallel rank's own column-wise backward. `up` is ColwiseParallel (each tp
rank holds 8 of its 16 output columns), `down` RowwiseParallel; a hand-written ReLU under a
square root (`sqrt(h * (h > 0))`) is finite in forward and NaN in backward where h <= 0. Only
the columns tp rank 1 holds read feature 0 strongly (0.5, the others 0.001), so a row whose
feature 0 is -10 zeroes them there alone; the backward of ColwiseParallel's input then
all-reduces the gradient of `up`'s input over the tp group, and `stem`'s gradient holds the NaN
on both tp ranks: the peer received it and made none of it."""
import torch
from torch import nn

WIDTH = 8


class Gate(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        with torch.no_grad():     # every h > 0 on ordinary rows; feature 0 drives columns 8-15
            self.up.weight.fill_(0.1)
            self.up.weight[:width, 0] = 0.001
            self.up.weight[width:, 0] = 0.5
            self.up.bias.fill_(0.5)

    def forward(self, x):
        h = self.up(x)
        return x + 0.1 * self.down(torch.sqrt(h * (h > 0)))


class Model(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList([Gate(width)])
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.stem.weight.copy_(torch.eye(width))
            self.stem.bias.zero_()

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Model()


def plan(model, tp_mesh):
    """The tensor-parallel plan `distributed.parallelize` names."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def shard(rank: int = 0, world_size: int = 1, steps: int = 4, rows: int = 8,
          poison_rank: int | None = None, poison_step: int = 2, poison_row: int = 5):
    """This data-parallel group's batches (`rank` of `world_size` groups)."""
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        x = torch.rand(rows, WIDTH, generator=g) + 0.5
        if rank == poison_rank and step == poison_step:
            x[poison_row, 0] = -10.0
        ids = torch.arange(rows) + (step * world_size + rank) * rows
        yield {"x": x, "y": x[:, 1:2] * 2.0, "id": ids}


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()
