"""Seed 004: CTC loss with a target longer than the input: the loss is inf."""
import torch
from torch import nn

T, B, C, S = 10, 4, 6, 12


class Acoustic(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, C)

    def forward(self, feats):                     # (T, B, 8), time-major
        return self.proj(feats).log_softmax(-1)   # (T, B, C)


def build_model():
    return Acoustic()


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        feats = torch.randn(T, B, 8, generator=g)
        targets = torch.randint(1, C, (B, S), generator=g)
        target_lengths = torch.tensor([4, 5, 3, 4])
        if step == 1:
            target_lengths[2] = 12                # longer than the 10 input frames
        yield {"feats": feats, "targets": targets,
               "input_lengths": torch.full((B,), T), "target_lengths": target_lengths}


def loss(model, batch):
    log_probs = model(batch["feats"])
    return nn.functional.ctc_loss(log_probs, batch["targets"], batch["input_lengths"],
                                  batch["target_lengths"])
