"""A DistributedDataParallel loop for torchrun (gloo on CPU), with the planted log(0) of
plain_log_counts.py in one row of rank 1's batch at step 3 (--poison-step -1: clean).

    torchrun --nproc-per-node 2 -m nanaudit run configs/examples/scripts/ddp_log_counts.py
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class LogModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.proj(torch.log(x))))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--poison-step", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(LogModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.rand(8, 4, generator=g) + 0.5
        if rank == 1 and step == args.poison_step:
            x[2, 0] = 0.0
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
