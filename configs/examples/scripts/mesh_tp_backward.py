"""A value made in one tensor-parallel rank's column-wise backward, for torchrun (gloo on CPU).

    torchrun --nproc-per-node 4 -m nanaudit run mesh_tp_backward.py --layout fsdp-tp

A hand-written ReLU (`h * (h > 0)`) under a square root: sqrt at exactly 0 is finite in
forward, but its derivative there is infinite, and the mask's backward multiplies it by 0:
NaN, with every loss finite (the sqrt-at-zero reports in causes.md). Here h is the output of a
`ColwiseParallel` projection, so each tp rank holds its own columns of it, and only tp rank
1's columns 8-15 go negative (their weight on feature 0 is 0.5, the others' 0.001), so only
that rank's own backward makes the NaN. Column-wise's backward then all-reduces the
gradient of its input over the tp group: the NaN reaches its tp peer, and the gradient of
`stem` (before the block) on both, although the peer made none of it.

Layouts:
  fsdp-tp  ("dp", "tp") = (2, 2): `parallelize_module` on the tp sub-mesh, then `fully_shard`
           on the dp sub-mesh; the two tp ranks of a dp group share its batch
  tp       tensor parallel alone over ("tp",) of 2 ranks, one batch for both

Fault (--fault backward): row 5 of the last dp group's batch at step 2 holds -10 in feature 0
(global rank 3 under fsdp-tp, rank 1 under tp, made it; --fault none: a clean run).
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

WIDTH = 8


class Gate(nn.Module):
    def __init__(self, width):
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
    def __init__(self, width=WIDTH):
        super().__init__()
        self.stem = nn.Linear(width, width)    # before the tp block: its gradient is reduced
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


def build(layout: str, world: int) -> tuple[nn.Module, int, int]:
    """The model laid out on its mesh; (this rank's data-parallel group, how many there are)."""
    torch.manual_seed(0)
    model = Model()
    if layout == "tp":
        tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    for block in model.blocks:
        parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout == "tp":
        return model, 0, 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["fsdp-tp", "tp"], default="fsdp-tp")
    parser.add_argument("--fault", default="backward", choices=["none", "backward"])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, group, groups = build(args.layout, dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(group)       # one batch per data-parallel group
    for step in range(args.steps):
        x = torch.rand(8, WIDTH, generator=g) + 0.5
        if group == groups - 1 and step == 2 and args.fault == "backward":
            x[5, 0] = -10.0
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
