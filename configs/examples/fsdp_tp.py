"""A small model for `torchrun --nproc-per-node 4 -m nanaudit scan fsdp_tp_forward_nan.yaml`:
FSDP2 + tensor parallel as torchtitan trains, `distributed.tp: 2` applying `plan` (each block's
`up` ColwiseParallel, `down` RowwiseParallel) on the tp sub-mesh before FSDP2 shards over the
data-parallel dimensions. Feature 0 reaches the upper half of `up`'s outputs (x1000), so a huge
feature 0 overflows the squared ReLU in the columns tp rank 1 holds, and nowhere else."""
import torch
from torch import nn

WIDTH = 8


class Mlp(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        with torch.no_grad():
            self.up.weight[:, 0] = 0.001
            self.up.weight[width:, 0] = 1000.0

    def forward(self, x):
        return x + 0.1 * self.down(torch.relu(self.up(x)).square())


class Model(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(width) for _ in range(2)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Model()


def plan(model, tp_mesh):
    """The tensor-parallel plan `distributed.parallelize` names: torchtitan's MLP layout."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def shard(rank: int = 0, world_size: int = 1, steps: int = 5, rows: int = 8,
          poison_rank: int | None = None, poison_step: int = 3, poison_row: int = 2):
    """This data-parallel group's batches (`rank` of `world_size` groups): ids are the global
    sample index, for the report."""
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        x = torch.rand(rows, WIDTH, generator=g) + 0.5
        if rank == poison_rank and step == poison_step:
            x[poison_row, 0] = 1e18     # finite (its square too), but not 1000x its square
        ids = torch.arange(rows) + (step * world_size + rank) * rows
        yield {"x": x, "y": x[:, 1:2] * 2.0, "id": ids}


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()
