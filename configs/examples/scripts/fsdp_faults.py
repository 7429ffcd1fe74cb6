"""An FSDP2 loop for torchrun (gloo on CPU): `fully_shard` per block and on the root, AdamW, and
one fault planted on rank 1 (--fault none: a clean run).

    torchrun --nproc-per-node 2 -m nanaudit run fsdp_faults.py --fault forward

  forward   row 2 of rank 1's batch at step 3 holds a 0: `log` makes -inf in forward
  backward  row 5 of rank 1's batch at step 2 is masked to zero before `length`: sqrt(0) is
            finite, its gradient is not (every loss finite; the NaN shows after the
            reduce-scatter in both ranks' gradient shards)
  state     after step 1, rank 1's shard of AdamW's `exp_avg_sq` of blocks.0.fc.weight is
            corrupted (as a bad checkpoint would), and the update of step 2 writes NaN
  overflow  with --mp fp16, row 4 of rank 1's batch at step 3 holds 70000: finite in float32,
            past float16's largest value when the policy casts the inputs
  die       rank 1 is killed in the middle of step 2 (its peer must not hang)

--mp bf16 | fp16 shards with MixedPrecisionPolicy(param_dtype=that, reduce_dtype=float32);
--resume first creates the optimizer's state as torch.distributed.checkpoint does on resuming.
"""

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="forward",
                        choices=["none", "forward", "backward", "state", "overflow", "die"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mp", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mp)
    policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if args.resume:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        get_optimizer_state_dict(model, optimizer)       # steps once at lr 0 to make the state
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.rand(8, 8, generator=g) + 0.5
        mask = torch.ones(8, 1)
        if rank == 1 and step == 3 and args.fault == "forward":
            x[2, 0] = 0.0
        if rank == 1 and step == 2 and args.fault == "backward":
            mask[5] = 0.0
        if rank == 1 and step == 3 and args.fault == "overflow":
            x[4] = 70000.0
        loss = model(x, mask).pow(2).mean()
        if rank == 1 and step == 2 and args.fault == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 1 and step == 1 and args.fault == "state":
            state = optimizer.state[model.blocks[0].fc.weight]["exp_avg_sq"]
            state.to_local()[0, 0] = float("nan")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
