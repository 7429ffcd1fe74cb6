"""Gradient accumulation with a poisoned sample: counts are regressed in log space
(`log1p`, an RMSLE loss) and one record carries the missing-value marker -1 as its count, so
log1p(-1) = -inf. Four micro-batches make one optimizer step; the bad record is row 3 of the
data's batch 6: step 1, micro-batch 2."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def batches():
    g = torch.Generator().manual_seed(1)
    for index in range(16):
        x = torch.rand(8, 4, generator=g)
        counts = torch.poisson(torch.full((8,), 3.0), generator=g)
        if index == 6:
            counts[3] = -1.0         # "missing" written as -1 by the export job
        yield {"features": x, "count": counts}


def loss(model, batch):
    predicted = torch.relu(model(batch["features"]).squeeze(1))
    return ((torch.log1p(predicted) - torch.log1p(batch["count"])) ** 2).mean()
