"""Two DDP ranks (gloo), rank 1's batch of step 3 bad in its loss code (log(0): an inf loss with
finite gradients), for `nanaudit run --keep-going` under torchrun
(tests/commands/test_run_keep_going.py). `--reference` leaves out step 3's update by hand on
every rank. Each rank writes its model's state_dict to OUT.rank<r>.pt."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

out, reference = sys.argv[1], "--reference" in sys.argv
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(6):
    gen = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.rand(8, 4, generator=gen) + 0.5, torch.randn(8, 1, generator=gen)
    scale = torch.zeros(()) if (rank == 1 and step == 3) else torch.ones(())
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean() - torch.log(scale)
    loss.backward()
    if not (reference and step == 3):
        optimizer.step()
torch.save(model.module.state_dict(), f"{out}.rank{rank}.pt")
dist.destroy_process_group()
