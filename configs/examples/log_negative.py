"""Seed 004/000: log of a negative number. A hand-written Poisson likelihood takes log(rate),
and one row's features drive the predicted rate below zero."""
import torch
from torch import nn


def build_model():
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.1)
    return model


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        x = torch.rand(8, 4, generator=g)
        if step == 3:
            x[2] = -5.0          # a sensor fault: negative readings
        yield x, torch.poisson(torch.full((8,), 2.0), generator=g)


def loss(model, batch):
    x, counts = batch
    rate = model(x).squeeze(1)
    return (rate - counts * torch.log(rate)).mean()
