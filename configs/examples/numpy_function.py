"""A von Mises-Fisher loss on the unit sphere (hyperspherical VAEs, face-recognition heads) whose
normalising constant needs the Bessel function I0, computed in numpy inside a custom
`torch.autograd.Function` (as s-vae-pytorch does with scipy). numpy's i0 overflows for a
concentration above ~713: the Function hands back inf, which torch never computed, and log(inf)
makes the loss inf. No torch op made the value: nanaudit must say so, not call it an overflow of
the op that received it."""
import numpy as np
import torch
from torch import nn


class BesselI0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kappa):
        ctx.save_for_backward(kappa)
        value = np.i0(kappa.detach().cpu().numpy()).astype(np.float32)
        return torch.from_numpy(value).to(kappa.device)

    @staticmethod
    def backward(ctx, grad):
        (kappa,) = ctx.saved_tensors
        i1 = np.i0(kappa.detach().cpu().numpy()).astype(np.float32) * 0.5   # a rough I1
        return grad * torch.from_numpy(i1).to(grad.device)


class VMFHead(nn.Module):
    def __init__(self, features: int = 6, dim: int = 3):
        super().__init__()
        self.direction = nn.Linear(features, dim)
        self.concentration = nn.Linear(features, 1)

    def forward(self, x, target):
        mu = nn.functional.normalize(self.direction(x), dim=-1)
        kappa = nn.functional.softplus(self.concentration(x)).squeeze(-1)
        # negative log-likelihood of a 2-sphere vMF up to constants, with I0 from numpy
        return torch.log(BesselI0.apply(kappa)) - kappa * (mu * target).sum(-1)


def build_model():
    torch.manual_seed(0)
    return VMFHead()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        x = torch.randn(8, 6, generator=g)
        if step == 1:
            x[2] = torch.tensor([900.0, -900.0, 900.0, -900.0, 900.0, -900.0])
        target = nn.functional.normalize(torch.randn(8, 3, generator=g), dim=-1)
        yield x, target


def loss(model, batch):
    x, target = batch
    return model(x, target).mean()
