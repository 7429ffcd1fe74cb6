"""A training loop on a 2-D device mesh for torchrun (4 ranks, gloo on CPU), the way large models
are trained, with one fault planted on one data-parallel group (--fault none: a clean run).

    torchrun --nproc-per-node 4 -m nanaudit run mesh_faults.py --layout fsdp-tp --fault forward

Layouts (mesh of 4 ranks):
  hsdp     `fully_shard(mesh=init_device_mesh(("dp_replicate", "dp_shard"), (2, 2)))`: each
           rank its own batch; gradients reduce-scattered over dp_shard, all-reduced over
           dp_replicate
  fsdp-tp  torchtitan's: `parallelize_module` (`up` ColwiseParallel, `down` RowwiseParallel)
           on the tp sub-mesh, then `fully_shard` on the dp sub-mesh of ("dp", "tp") = (2, 2);
           the two tp ranks of a dp group see the same batch
  tp       tensor parallel alone over a 1-D mesh ("tp",) of 4 ranks, one batch for all

Faults (on the last dp group: global rank 3 for hsdp, ranks 2 and 3 for fsdp-tp, all for tp):
  forward   row 2 of the batch at step 3 holds 1e20 in feature 0: finite, but the squared ReLU of
            `up`'s output overflows to inf in the output columns 8-15 alone (their weights on
            feature 0 are 0.5, the others' 0.001): under fsdp-tp only tp rank 1 holds those
            columns, so only it makes the value, and the row-wise all-reduce of `down` hands
            it to its tp peer
  backward  row 5 of the batch at step 2 is masked to zero before `length`: sqrt(0) is finite,
            its gradient is not (every loss finite)
  die       global rank 3 is killed in the middle of step 2 (its peers must not hang)
"""

import argparse
import os
import signal

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


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        with torch.no_grad():     # feature 0 reaches the upper half of `up`'s outputs alone
            self.up.weight[:, 0] = 0.001
            self.up.weight[width:, 0] = 0.5

    def forward(self, x):
        return x + 0.1 * self.down(torch.relu(self.up(x)).square())


class Length(nn.Module):
    def forward(self, z):
        return torch.sqrt((z * z).sum(-1, keepdim=True))


class Model(nn.Module):
    def __init__(self, width=WIDTH):
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(width) for _ in range(2)])
        self.length = Length()
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask):
        h = x
        for block in self.blocks:
            h = block(h)
        return self.head(h) + 0.1 * self.length(h * mask)


def build(layout: str, world: int) -> tuple[nn.Module, int, int]:
    """The model laid out on its mesh; (this rank's data-parallel group, how many there are)."""
    torch.manual_seed(0)
    model = Model()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate",
                                                                        "dp_shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, dist.get_rank(), world
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp = mesh
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
    parser.add_argument("--layout", choices=["hsdp", "fsdp-tp", "tp"], default="hsdp")
    parser.add_argument("--fault", default="forward",
                        choices=["none", "forward", "backward", "die"])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, group, groups = build(args.layout, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(group)       # one batch per data-parallel group
    last = group == groups - 1
    for step in range(args.steps):
        x = torch.rand(8, WIDTH, generator=g) + 0.5
        mask = torch.ones(8, 1)
        if last and step == 3 and args.fault == "forward":
            x[2, 0] = 1e20
        if last and step == 2 and args.fault == "backward":
            mask[5] = 0.0
        loss = model(x, mask).pow(2).mean()
        if rank == world - 1 and step == 2 and args.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
