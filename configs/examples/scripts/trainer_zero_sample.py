"""A Hugging Face `transformers.Trainer` script: a small classifier on L2-normalized features.

Planted bug: one sample of the data set (--poison-sample) is all zeros (a failed feature
extraction); normalizing it divides 0 by its norm 0, and that row's features become NaN.
(The fix: `x / x.norm().clamp(min=eps)` or `F.normalize`.) --poison-sample -1 is the clean run.
"""

import argparse
import tempfile

import torch
from torch import nn
from transformers import Trainer, TrainingArguments


class L2Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)


class FeatureClassifier(nn.Module):
    def __init__(self, features: int = 12, width: int = 24, classes: int = 4):
        super().__init__()
        self.normalize = L2Normalize()
        self.body = nn.Sequential(nn.Linear(features, width), nn.GELU(), nn.Linear(width, classes))

    def forward(self, features, labels=None):
        logits = self.body(self.normalize(features))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class FeatureDataset(torch.utils.data.Dataset):
    def __init__(self, size: int, poison: int):
        generator = torch.Generator().manual_seed(3)
        self.features = torch.randn(size, 12, generator=generator)
        self.labels = torch.randint(0, 4, (size,), generator=generator)
        if poison >= 0:
            self.features[poison] = 0.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"features": self.features[index], "labels": self.labels[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--poison-sample", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=8,
            learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0)
        trainer = Trainer(model=FeatureClassifier(), args=training_args,
                          train_dataset=FeatureDataset(64, args.poison_sample))
        trainer.train()


if __name__ == "__main__":
    main()
