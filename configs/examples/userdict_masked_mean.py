"""Issue 15: tokenizer-style batches (a `collections.UserDict`, the shape of Hugging Face's
`BatchEncoding`) with one all-padding row. The pooled sentence vector is a masked mean,
sum(hidden * mask) / sum(mask): 0 / 0 for a row whose attention mask is all zeros."""
import collections

import torch
from torch import nn


class Encoded(collections.UserDict):
    """What a tokenizer returns: input_ids, attention_mask (and here the labels)."""


class MaskedMean(nn.Module):
    def forward(self, hidden, mask):
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1)


class Classifier(nn.Module):
    def __init__(self, vocab=50, width=16, classes=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pool = MaskedMean()
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids, attention_mask):
        return self.head(self.pool(self.embed(input_ids), attention_mask))


def build_model():
    torch.manual_seed(0)
    return Classifier()


def batches(empty_row=(3, 4), steps=6, size=8, length=10):
    """Padded token batches; `empty_row` (step, row) is a sequence with no tokens at all (a
    blank line the tokenizer turned into padding only); None for a clean run."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        lengths = torch.randint(1, length + 1, (size,), generator=g)
        if empty_row is not None and step == empty_row[0]:
            lengths[empty_row[1]] = 0
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, 50, (size, length), generator=g) * mask
        yield Encoded(input_ids=ids, attention_mask=mask,
                      labels=torch.randint(0, 3, (size,), generator=g))


def loss(model, batch):
    logits = model(batch["input_ids"], batch["attention_mask"])
    return nn.functional.cross_entropy(logits, batch["labels"])
