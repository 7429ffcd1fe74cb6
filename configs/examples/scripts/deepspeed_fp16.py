"""A DeepSpeed ZeRO loop under fp16 with a dynamic loss scale, for torchrun (2 ranks, gloo on
CPU), with the model of fsdp_faults.py (tests/e2e/test_deepspeed.py).

`"fp16": {"enabled": true, "initial_scale_power": 30}`: the first 14 steps' scaled gradients
overflow float16, so DeepSpeed prints OVERFLOW, skips them and backs the scale off (its
hysteresis keeps it once, then halves it each time) to 2**17, where it trains: a healthy run.

On a CPU DeepSpeed refuses fp16 before it builds anything: its CPU accelerator reports fp16
supported only where oneDNN has float16 kernels (`torch.ops.mkldnn._is_mkldnn_fp16_supported()`,
False on this machine's CPUs), and `DeepSpeedEngine._do_sanity_check` raises "Type fp16 is not
supported on your device.". The flag gates nothing else: torch runs float16 ops on the CPU
(slowly), so this script claims the support to run DeepSpeed's own fp16 optimizer and loss
scaler (stage_1_and_2.py, fp16/loss_scaler.py), the code a GPU run steps through.

  --fault forward   rank 1's batch at loop step 20 (after the 14 skips: nanaudit's step 20 too)
                    holds a 0 in row 2: `log` makes -inf in the forward, the loss is not finite
  --fault overflow  the loss is multiplied by 1e30 before backward (finite in float32): its
                    float16 gradients overflow whatever the scale, so every step is skipped
                    (DeepSpeed raises once the scale reaches its minimum, 1, at skip 32)
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from fsdp_faults import Model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="none", choices=["none", "forward", "overflow"])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    type(get_accelerator()).is_fp16_supported = lambda self: True     # see the docstring
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage},
              "fp16": {"enabled": True, "initial_scale_power": 30},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=Model(), config=config)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        x = torch.rand(8, 8, generator=g) + 0.5
        if rank == 1 and step == 20 and args.fault == "forward":
            x[2, 0] = 0.0
        loss = engine(x.half(), torch.ones(8, 1).half()).float().pow(2).mean()
        if args.fault == "overflow":
            loss = loss * 1e30
        engine.backward(loss)
        engine.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
