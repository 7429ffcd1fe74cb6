"""`Sentinel` in a hand-written FSDP2 loop under torchrun (gloo on CPU), with the model and the
faults of fsdp_faults.py (--fault forward | backward | state | none). Every rank raises
NonFiniteError at the same step; each prints the finding, which names the rank that made it.

    torchrun --nproc-per-node 2 fsdp_sentinel.py --fault backward
"""

import argparse
import json

import torch
import torch.distributed as dist
from fsdp_faults import Model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from nanaudit import NonFiniteError, Sentinel


def compute_loss(model, batch):
    x, mask = batch
    return model(x, mask).pow(2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["none", "forward", "backward", "state"],
                        default="backward")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    g = torch.Generator().manual_seed(rank)
    result = {"rank": rank, "steps": 5}
    try:
        for step in range(5):
            x, mask = torch.rand(8, 8, generator=g) + 0.5, torch.ones(8, 1)
            if rank == 1 and step == 3 and args.fault == "forward":
                x[2, 0] = 0.0
            if rank == 1 and step == 2 and args.fault == "backward":
                mask[5] = 0.0
            loss = compute_loss(model, (x, mask))
            loss.backward()
            sentinel.check(step, (x, mask), loss)     # raises NonFiniteError on every rank
            optimizer.step()
            optimizer.zero_grad()
            if rank == 1 and step == 1 and args.fault == "state":
                state = optimizer.state[model.blocks[0].fc.weight]["exp_avg_sq"]
                state.to_local()[0, 0] = float("nan")
    except NonFiniteError as error:
        f = error.report.finding
        result = {"rank": rank, "step": f.step, "finding_rank": f.rank, "where": f.where,
                  "op": f.op, "forward_op": f.forward_op, "module": f.module,
                  "cause": f.cause, "line": f.source.line if f.source else None,
                  "explanation": f.explanation}
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
