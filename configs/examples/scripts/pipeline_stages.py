"""A model split into two pipeline stages with `torch.distributed.pipelining` (one stage per
rank, GPipe over 2 micro-batches), for torchrun on 2 gloo ranks. nanaudit refuses it (exit 2,
naming the pipeline stage): each rank holds a different part of the model and only the last
stage computes the loss, so one rank's step says nothing of the others' values.

    torchrun --nproc-per-node 2 -m nanaudit run pipeline_stages.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(world)]
    stage = PipelineStage(layers[rank], rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2,
                             loss_fn=lambda out, target: (out - target).pow(2).mean())
    optimizer = torch.optim.SGD(layers[rank].parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.rand(4, 8, generator=g), torch.rand(4, 8, generator=g)
        optimizer.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
