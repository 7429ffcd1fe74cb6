"""A clean mixed-precision loop: float16 autocast with a GradScaler whose initial scale is far
too large, so its first steps' scaled gradients overflow and the scaler skips them (normal AMP
behaviour, not a finding) until the scale has backed off."""

import torch
from torch import nn


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=1000)
    for _ in range(30):
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    print(f"final scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
