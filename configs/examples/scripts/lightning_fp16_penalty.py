"""A PyTorch Lightning script: a small attention classifier with an activation penalty that
is computed in float16 to save memory.

Planted bug: one sample's features are unnormalized (x1000); the squares of its activations
pass float16's largest value (65504), the penalty overflows to inf and so does the loss.
(The fix: normalize the inputs, or compute the penalty in float32.) --poison-sample -1 is the
clean run.
"""

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)

    def forward(self, x):
        scores = torch.bmm(self.query(x), self.key(x).transpose(1, 2)) / x.shape[-1] ** 0.5
        return torch.bmm(torch.softmax(scores, dim=-1), self.value(x))


class ActivationPenalty(nn.Module):
    """Mean squared activation per sample, in float16 (the activations are large tensors)."""

    def forward(self, h):
        return h.half().pow(2).sum(dim=(1, 2)).float().mean()


class Classifier(L.LightningModule):
    def __init__(self, dim: int = 16, classes: int = 3, lr: float = 1e-3):
        super().__init__()
        self.attention = Attention(dim)
        self.penalty = ActivationPenalty()
        self.head = nn.Linear(dim, classes)
        self.lr = lr

    def forward(self, x):
        h = self.attention(x)
        return self.head(h.mean(dim=1)), self.penalty(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, penalty = self(x)
        loss = nn.functional.cross_entropy(logits, y) + 1e-4 * penalty
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--poison-sample", type=int, default=34)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    x = torch.randn(args.max_steps * args.batch_size, 6, 16)
    y = torch.randint(0, 3, (len(x),))
    if args.poison_sample >= 0:
        x[args.poison_sample] *= 1000.0
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=False)
    trainer = L.Trainer(max_steps=args.max_steps, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Classifier(), loader)


if __name__ == "__main__":
    main()
