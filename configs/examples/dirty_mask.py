"""Seed 000: dirty data. The preprocessing normalises a segmentation mask with mask / mask.max();
an all-black mask gives 0 / 0 = NaN before the model ever runs."""
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1))


def batches():
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        image = torch.rand(4, 1, 8, 8, generator=g)
        mask = (torch.rand(4, 1, 8, 8, generator=g) > 0.5).float() * 255
        if step == 2:
            mask[1] = 0               # an all-black mask
        mask = mask / mask.amax(dim=(1, 2, 3), keepdim=True)
        yield {"image": image, "mask": mask}


def loss(model, batch):
    return nn.functional.binary_cross_entropy_with_logits(model(batch["image"]), batch["mask"])
