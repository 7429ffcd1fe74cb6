"""A DeepSpeed ZeRO loop for torchrun (2 ranks, gloo on CPU), with the model of fsdp_faults.py
and one fault planted on rank 1 (--fault none: a clean run).

    torchrun --nproc-per-node 2 -m nanaudit run deepspeed_faults.py --stage 2 --fault backward

--groups 2 trains two param groups (decay / no-decay, as the HF Trainer builds them).

  forward   row 2 of rank 1's batch at step 3 holds a 0: `log` makes -inf in forward
  backward  row 5 of rank 1's batch at step 2 is masked to zero before `length`: sqrt(0) is
            finite, its gradient is not (every loss finite; DeepSpeed's overflow check
            all-reduces the flag, and its reduction spreads the NaN into every rank's gradients)
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from fsdp_faults import Model


def decay_groups(model: torch.nn.Module) -> list:
    """The model's parameters as two param groups: decay on the matrices, none on the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="backward", choices=["none", "forward", "backward"])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--steps", type=int, default=5)
    # ZeRO-3 steps its torch optimizer once per sub-group of this many elements (30: three)
    parser.add_argument("--sub-group-size", type=int, default=None)
    # 2: weight decay on the matrices, none on the biases, as the HF Trainer builds its groups
    # (ZeRO-1/2 then step the torch optimizer once per group)
    parser.add_argument("--groups", type=int, choices=[1, 2], default=1)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    if args.sub_group_size is not None:
        config["zero_optimization"]["sub_group_size"] = args.sub_group_size
    model = Model()
    groups = decay_groups(model) if args.groups == 2 else None
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=groups)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.rand(8, 8, generator=g) + 0.5
        mask = torch.ones(8, 1)
        if rank == 1 and step == 3 and args.fault == "forward":
            x[2, 0] = 0.0
        if rank == 1 and step == 2 and args.fault == "backward":
            mask[5] = 0.0
        loss = engine(x, mask).pow(2).mean()
        engine.backward(loss)
        engine.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
