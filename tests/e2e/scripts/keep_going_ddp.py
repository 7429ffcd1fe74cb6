"""Two DDP ranks (gloo), rank 1's batch of step 3 bad in its loss code (log(0): an inf loss with
finite gradients), and rank 1's step 4 NaN in backward only (sqrt of its output times 0: a zero
added to the loss, sqrt's infinite derivative at 0 times 0 in its gradients, which DDP's
all-reduce spreads to rank 0), for `nanaudit run --keep-going` under torchrun
(tests/commands/test_run_keep_going.py). `--reference` leaves out steps 3 and 4's updates by
hand on every rank. Each rank writes its model's state_dict to OUT.rank<r>.pt. `--cuda` puts
every rank's model and batches on the one GPU (gloo all-reduces CUDA tensors; NCCL would need a
GPU per rank)."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

out, reference = sys.argv[1], "--reference" in sys.argv
device = "cuda" if "--cuda" in sys.argv else "cpu"
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(),
                                              nn.Linear(8, 1)).to(device))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(6):
    gen = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.rand(8, 4, generator=gen) + 0.5, torch.randn(8, 1, generator=gen)
    scale = torch.zeros(()) if (rank == 1 and step == 3) else torch.ones(())
    x, y, scale = x.to(device), y.to(device), scale.to(device)
    optimizer.zero_grad()
    pred = model(x)
    loss = ((pred - y) ** 2).mean() - torch.log(scale)
    if rank == 1 and step == 4:
        loss = loss + torch.sqrt(pred * 0).sum()
    loss.backward()
    if not (reference and step in (3, 4)):
        optimizer.step()
torch.save(model.module.state_dict(), f"{out}.rank{rank}.pt")
dist.destroy_process_group()
