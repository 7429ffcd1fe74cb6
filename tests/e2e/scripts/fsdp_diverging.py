"""An FSDP2 loop for torchrun (two gloo ranks, CPU) whose learning rate is far too large: step
0's update leaves every shard finite but near 1e30, so each rank's float32 sum of squares of
its shard overflows, and step 1's forward overflows float32 in the loss's square
(tests/e2e/test_fsdp_inprocess.py)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=1e30)
batches = torch.Generator().manual_seed(dist.get_rank())
for _step in range(4):
    x = torch.randn(16, 8, generator=batches)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
