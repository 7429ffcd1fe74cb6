"""A Hugging Face `transformers.Trainer` script with a DeepSpeed ZeRO config (`deepspeed=`),
on CPU (`use_cpu=True`) under torchrun: the way a user moves a Trainer run to ZeRO.

Planted bug (--fault backward): one row of the data set (row 21: the Trainer's seeded sampler
gives it to rank 1 at its first step, as row 1 of 4) is masked to zero before a `sqrt` (a
norm of an all-zero row): sqrt(0) is finite, its gradient is not, so every loss is finite
and only the backward makes the NaN. --fault none is the clean run. --poison-row 52 plants it
at rank 1's step 2 instead (row 1 of its batch). --trainer-optimizer leaves the optimizer out
of the DeepSpeed config, so the Trainer builds its own AdamW with two param groups (decay /
no-decay), which ZeRO-1/2 step one at a time.
"""

import argparse
import tempfile

import torch
from torch import nn
from transformers import Trainer, TrainingArguments


class Scorer(nn.Module):
    def __init__(self, features: int = 8, width: int = 16):
        super().__init__()
        self.proj = nn.Linear(features, width)
        self.head = nn.Linear(width, 1)

    def forward(self, features, mask, labels=None):
        h = self.proj(features) * mask
        length = torch.sqrt((h * h).sum(-1, keepdim=True))
        score = self.head(h) + length
        loss = (score.squeeze(-1) - labels).pow(2).mean() if labels is not None else None
        return {"loss": loss, "logits": score}


class Rows(torch.utils.data.Dataset):
    def __init__(self, size: int, poison: int):
        generator = torch.Generator().manual_seed(3)
        self.features = torch.rand(size, 8, generator=generator) + 0.5
        self.labels = torch.rand(size, generator=generator)
        self.mask = torch.ones(size, 1)
        if poison >= 0:
            self.mask[poison] = 0.0

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return {"features": self.features[index], "mask": self.mask[index],
                "labels": self.labels[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", default="backward", choices=["none", "backward"])
    parser.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--poison-row", type=int, default=21)
    parser.add_argument("--trainer-optimizer", action="store_true")
    args = parser.parse_args()
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}}}
    if args.trainer_optimizer:
        del config["optimizer"]
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, max_steps=args.max_steps, per_device_train_batch_size=4,
            learning_rate=1e-2, report_to=[], save_strategy="no", logging_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0, deepspeed=config,
            ddp_backend="gloo", dataloader_drop_last=True)
        poison = args.poison_row if args.fault == "backward" else -1
        trainer = Trainer(model=Scorer(), args=training_args, train_dataset=Rows(64, poison))
        trainer.train()


if __name__ == "__main__":
    main()
