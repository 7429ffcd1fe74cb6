"""`Sentinel` in a hand-written FSDP2 + tensor-parallel loop on a 2-D ("dp", "tp") mesh under
torchrun (4 ranks, gloo on CPU), with the model, layouts and faults of mesh_faults.py. Every
rank raises NonFiniteError at the same step; each prints the finding, which names the rank that
made the value and its mesh coordinate.

    torchrun --nproc-per-node 4 mesh_sentinel.py --layout fsdp-tp --fault forward
"""

import argparse
import json

import torch
import torch.distributed as dist
from mesh_faults import WIDTH, build

from nanaudit import NonFiniteError, Sentinel


def compute_loss(model, batch):
    x, mask = batch
    return model(x, mask).pow(2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["hsdp", "fsdp-tp", "tp"], default="fsdp-tp")
    parser.add_argument("--fault", choices=["none", "forward", "backward"], default="forward")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, group, groups = build(args.layout, dist.get_world_size())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    g = torch.Generator().manual_seed(group)
    last = group == groups - 1
    result = {"rank": rank, "steps": 5}
    try:
        for step in range(5):
            x, mask = torch.rand(8, WIDTH, generator=g) + 0.5, torch.ones(8, 1)
            if last and step == 3 and args.fault == "forward":
                x[2, 0] = 1e20
            if last and step == 2 and args.fault == "backward":
                mask[5] = 0.0
            loss = compute_loss(model, (x, mask))
            loss.backward()
            sentinel.check(step, (x, mask), loss)     # raises NonFiniteError on every rank
            optimizer.step()
            optimizer.zero_grad()
    except NonFiniteError as error:
        f = error.report.finding
        result = {"rank": rank, "step": f.step, "finding_rank": f.rank, "mesh": f.mesh,
                  "where": f.where, "op": f.op, "forward_op": f.forward_op,
                  "module": f.module, "cause": f.cause,
                  "line": f.source.line if f.source else None, "samples": f.samples,
                  "explanation": f.explanation}
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
