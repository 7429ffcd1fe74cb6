"""An FSDP2 loop for torchrun (two gloo ranks, CPU) with two faults planted in rank 1's batches
for `nanaudit run`'s in-process replay and `run --keep-going` (tests/e2e/test_fsdp_inprocess.py):

  step 2  row 5 of the batch is masked to zero before `length`: sqrt(0) is finite, its gradient
          is not (every loss finite; after the reduce-scatter both ranks' shards hold the NaN)
  step 3  row 2 of the batch holds a 0: `log` makes -inf in forward

Each rank appends a line per step to LOG.rank<r> after its update; at the end it saves every
parameter's full tensor and AdamW's step count to LOG.rank<r>.pt. `--reference` leaves out the
updates of steps 2 and 3 by hand (what --keep-going must do); `--clean` plants no fault;
`--assert` plants step 3's alone, and the script asserts its loss is finite (rank 1 raises at
step 3 while rank 0 waits in the backward's reduce-scatter); `--assert-weight` asserts the same
of a loss whose code (not the model) makes the value: row 2 of rank 1's sample weights is 0 at
step 3 and the loss takes their log."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class Length(nn.Module):
    def forward(self, z):
        return torch.sqrt((z * z).sum(-1, keepdim=True))


class Model(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.length = Length()
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask):
        h = torch.log(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + 0.1 * self.length(h * mask)


log, reference, clean = sys.argv[1], "--reference" in sys.argv, "--clean" in sys.argv
asserting = "--assert" in sys.argv or "--assert-weight" in sys.argv
weighted = "--assert-weight" in sys.argv
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = Model()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
torch.manual_seed(10 + rank)        # each rank's own dropout masks
g = torch.Generator().manual_seed(rank)
for step in range(6):
    x, mask = torch.rand(8, 8, generator=g) + 0.5, torch.ones(8, 1)
    if rank == 1 and step == 2 and not clean and not asserting:
        mask[5] = 0.0
    weight = torch.ones(8, 1)
    if rank == 1 and step == 3 and not clean:
        if weighted:
            weight[2] = 0.0
        else:
            x[2, 0] = 0.0
    optimizer.zero_grad()
    if weighted:
        loss = (model(x, mask).pow(2) - torch.log(weight)).mean()
    else:
        loss = model(x, mask).pow(2).mean()
    if asserting:
        assert torch.isfinite(loss), "loss diverged"
    loss.backward()
    if not (reference and step in (2, 3)):
        optimizer.step()
    with open(f"{log}.rank{rank}", "a") as f:
        f.write(f"{step} {loss.item():.6f}\n")
state = {name: p.full_tensor() for name, p in model.named_parameters()}
state.update({f"{name}.step": optimizer.state[p]["step"]
              for name, p in model.named_parameters()})
torch.save(state, f"{log}.rank{rank}.pt")
dist.destroy_process_group()
