"""A small training loop (Dropout and BatchNorm) with bad batches of chosen kinds at chosen
steps, in each step shape `nanaudit run --keep-going` skips (tests/commands/
test_run_keep_going.py). `--reference` runs the same loop doing by hand what a skip must come
to: no update on a bad step (under a GradScaler, the scale backed off as after an overflow) and
the model's buffers put back as they were before the step's first forward.

    python keep_going_loop.py OUT [--shape plain|accumulate|scaler|closure|two]
        [--bad STEP:KIND,...] [--steps N] [--device cpu|cuda] [--autocast] [--init-scale S]
        [--deterministic] [--reference]

KIND: `forward` (log of a negative input in the model), `backward` (sqrt(0) in the loss code:
finite forward, non-finite gradient) or `loss` (log(0) in the loss code). Writes OUT (the model,
optimizers and scale) and OUT.log (one line a step: the step, the learning rate, a draw of the
script's RNG after it). `--device cuda` runs it on the GPU (Dropout then draws from the CUDA
generator, which nanaudit's replay must leave as the script had it); `--autocast` runs the
model's forward under float16 autocast (with the `scaler` shape: a real fp16 GradScaler)."""

import argparse
import json

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--shape", default="plain",
                    choices=["plain", "accumulate", "scaler", "closure", "two"])
parser.add_argument("--bad", default="")
parser.add_argument("--steps", type=int, default=9)
parser.add_argument("--reference", action="store_true")
parser.add_argument("--device", default="cpu")
parser.add_argument("--autocast", action="store_true")
parser.add_argument("--init-scale", type=float, default=1e38)
parser.add_argument("--deterministic", action="store_true")
args = parser.parse_args()
BAD = {int(s): kind for s, kind in (item.split(":") for item in args.bad.split(",") if item)}
DEVICE = torch.device(args.device).type
MICRO = 2 if args.shape == "accumulate" else 1


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


torch.use_deterministic_algorithms(args.deterministic)
torch.manual_seed(0)
model = nn.Sequential(Log(), nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU(),
                      nn.Linear(8, 1)).to(args.device)
if args.shape == "two":
    optimizers = [torch.optim.Adam(model[1].parameters(), lr=0.01),
                  torch.optim.SGD([*model[2].parameters(), *model[5].parameters()], lr=0.05,
                                  momentum=0.9)]
elif args.shape == "closure":
    optimizers = [torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)]
else:
    optimizers = [torch.optim.Adam(model.parameters(), lr=0.01)]
scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], 3, 0.5)
scaler = torch.amp.GradScaler(DEVICE, init_scale=args.init_scale) if args.shape == "scaler" else None


def batch(step, micro):
    gen = torch.Generator().manual_seed(100 + 10 * step + micro)
    x, y = torch.rand(6, 4, generator=gen) + 0.5, 3 * torch.randn(6, 1, generator=gen)
    gate, scale = torch.ones(()), torch.ones(())
    kind = BAD.get(step) if micro == MICRO - 1 else None    # the step's last micro-batch
    if kind == "forward":
        x[3, 1] = -1.0
    elif kind == "backward":
        gate = torch.zeros(())
    elif kind == "loss":
        scale = torch.zeros(())
    return tuple(t.to(args.device) for t in (x, y, gate, scale))


def loss_of(x, y, gate, scale):
    with torch.autocast(DEVICE, dtype=torch.float16, enabled=args.autocast):
        pred = model(x).float()
    return ((pred - y) ** 2).mean() + torch.sqrt(gate * pred.pow(2).mean()) - torch.log(scale)


def closure_of(step):
    def closure():
        optimizers[0].zero_grad()
        loss = loss_of(*batch(step, 0))
        loss.backward()
        return loss
    return closure


with open(args.out + ".log", "w") as log:
    for step in range(args.steps):
        skip = args.reference and step in BAD
        saved = [b.clone() for b in model.buffers()]
        for optimizer in optimizers:
            optimizer.zero_grad()
        if args.shape == "closure":
            if skip:
                closure_of(step)()
            else:
                optimizers[0].step(closure_of(step))
        else:
            for micro in range(MICRO):
                loss = loss_of(*batch(step, micro)) / MICRO
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None and skip:
                # An overflow's skip: no update, the scale backed off.
                scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
            elif scaler is not None:
                scaler.step(optimizers[0])
                scaler.update()
            elif not skip:
                for optimizer in optimizers:
                    optimizer.step()
        if skip:
            with torch.no_grad():
                for b, s in zip(model.buffers(), saved):
                    b.copy_(s)
        scheduler.step()
        line = {"step": step, "lr": scheduler.get_last_lr()[0], "draw": torch.rand(()).item()}
        if DEVICE == "cuda":                 # the GPU's stream too (Dropout draws from it)
            line["cuda_draw"] = torch.rand((), device=args.device).item()
        log.write(json.dumps(line) + "\n")
torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
            "scale": scaler.get_scale() if scaler is not None else None}, args.out)
