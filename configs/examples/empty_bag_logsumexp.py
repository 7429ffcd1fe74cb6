"""Multiple-instance learning with log-sum-exp pooling over a padded bag of instances (weakly
supervised detection and histopathology MIL): padded instances are masked with -inf before
`torch.logsumexp`. One bag arrives with no valid instance at all (every tile filtered out): the
logsumexp over nothing but -inf is -inf, and BCE-with-logits turns it into NaN. The -inf is the
mask's, on purpose; the bug is the empty bag, not an overflow."""
import torch
import torch.nn.functional as F
from torch import nn


class LSEPoolingMIL(nn.Module):
    def __init__(self, features: int = 6):
        super().__init__()
        self.score = nn.Linear(features, 1)

    def forward(self, tiles, valid):
        scores = self.score(tiles).squeeze(-1)                    # (bags, tiles)
        scores = scores.masked_fill(~valid, float("-inf"))
        return torch.logsumexp(scores, dim=1)


def build_model():
    torch.manual_seed(0)
    return LSEPoolingMIL()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        tiles = torch.randn(6, 5, 6, generator=g)
        valid = torch.rand(6, 5, generator=g) < 0.7
        valid[:, 0] = True
        if step == 2:
            valid[4] = False                   # a slide whose tiles were all filtered out
        yield {"tiles": tiles, "valid": valid, "label": torch.tensor([0., 1., 0., 1., 0., 1.])}


def loss(model, batch):
    logits = model(batch["tiles"], batch["valid"])
    return F.binary_cross_entropy_with_logits(logits, batch["label"])
