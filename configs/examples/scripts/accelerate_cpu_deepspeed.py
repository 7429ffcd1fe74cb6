"""An Accelerate loop asked for DeepSpeed ZeRO-2 on CPU (`Accelerator(cpu=True,
deepspeed_plugin=...)`, as `accelerate launch --use_deepspeed --cpu` gives), for torchrun on 2
gloo ranks. Accelerate on CPU drops DeepSpeed without a word and trains with DDP; nanaudit
says so in the ranks' note rather than pretend it audited ZeRO (the run itself is clean).

    torchrun --nproc-per-node 2 -m nanaudit run accelerate_cpu_deepspeed.py
"""

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from torch import nn


def main() -> None:
    accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        x, y = torch.rand(4, 8, generator=g), torch.rand(4, 1, generator=g)
        loss = (model(x) - y).pow(2).mean()
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
    accelerator.end_training()


if __name__ == "__main__":
    main()
