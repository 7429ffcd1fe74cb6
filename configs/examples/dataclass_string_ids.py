"""Issue 15: audio clips in a dataclass batch that carries each clip's file name. The
front end takes the log of each frame's energy; one clip in the data set is pure digital
silence, log(0) = -inf. The finding names the row and, beside it, the file to look at."""
import dataclasses

import torch
from torch import nn


@dataclasses.dataclass
class Clips:
    frames: torch.Tensor          # (batch, frames, samples per frame)
    labels: torch.Tensor
    ids: list                     # the clip's file name, one per row


class LogEnergy(nn.Module):
    def forward(self, frames):
        return torch.log(frames.pow(2).mean(dim=-1))


class Tagger(nn.Module):
    def __init__(self, frames=12, classes=4):
        super().__init__()
        self.frontend = LogEnergy()
        self.head = nn.Linear(frames, classes)

    def forward(self, frames):
        return self.head(self.frontend(frames))


def build_model():
    torch.manual_seed(0)
    return Tagger()


def batches(silent_clip=21, steps=5, size=8):
    """Clips clip_0000.wav, clip_0001.wav, ... in order; `silent_clip` is all zeros (None for
    a clean run)."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        frames = torch.randn(size, 12, 16, generator=g) * 0.1
        ids = [f"clip_{step * size + row:04d}.wav" for row in range(size)]
        if silent_clip is not None and step * size <= silent_clip < (step + 1) * size:
            frames[silent_clip - step * size] = 0.0
        yield Clips(frames, torch.randint(0, 4, (size,), generator=g), ids)


def loss(model, batch):
    return nn.functional.cross_entropy(model(batch.frames), batch.labels)
