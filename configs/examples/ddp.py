"""A small DDP job for `torchrun --nproc-per-node 2 -m nanaudit scan ...`: each rank reads its
own shard (the data callable takes rank and world_size), and one rank's shard can be poisoned."""
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


class WithMagnitude(nn.Module):
    """Features plus their Euclidean length: sqrt has an infinite gradient at an all-zero row."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(9, 1)

    def forward(self, x):
        z = x * self.gain
        length = torch.sqrt((z * z).sum(1, keepdim=True))
        return self.head(torch.cat([z, length], dim=1))


def magnitude_model():
    torch.manual_seed(0)
    return WithMagnitude()


def shard(rank: int = 0, world_size: int = 1, steps: int = 6, rows: int = 8,
          poison_rank: int | None = None, poison_step: int = 3, poison_row: int = 5,
          fail_rank: int | None = None, fail_step: int = 2, zero_row: bool = False):
    """This rank's batches: ids tell the global sample index, for the report."""
    g = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        if rank == fail_rank and step == fail_step:
            raise OSError(f"shard {rank}: cannot read record {step * rows} (corrupt file)")
        x = torch.randn(rows, 8, generator=g)
        y = x[:, :1] * 2.0
        if rank == poison_rank and step == poison_step:
            if zero_row:
                x[poison_row] = 0.0                   # a dead sensor: finite, but all zero
            else:
                x[poison_row, 3] = float("nan")
        ids = torch.arange(rows) + (step * world_size + rank) * rows
        yield {"x": x, "y": y, "id": ids}


def mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def log_loss(model, batch):
    """A loss that takes the log of the prediction: NaN only for the batch that makes it < 0."""
    return torch.log(model(batch["x"]).abs() + 1e-3).mean() + mse(model, batch)


def stalled_shard(rank: int = 0, world_size: int = 1, stall_rank: int = 1, stall_s: float = 8.0):
    """Rank `stall_rank` stops answering for stall_s seconds at step 1 (a stuck file system)."""
    import time
    for step, batch in enumerate(shard(rank, world_size)):
        if rank == stall_rank and step == 1:
            time.sleep(stall_s)
        yield batch


def dying_shard(rank: int = 0, world_size: int = 1, die_rank: int = 1, die_step: int = 1):
    """Rank `die_rank` is killed at step `die_step` (the OOM killer): no error, no goodbye."""
    import os
    import signal
    for step, batch in enumerate(shard(rank, world_size)):
        if rank == die_rank and step == die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        yield batch


def fussy_loss(model, batch, bad_id: int = 40):
    """Raises for the batch that starts at global sample `bad_id` (rank 1, step 2 of 2 ranks):
    an error inside the loss, while the other rank waits in DDP's gradient all-reduce."""
    if int(batch["id"][0]) == bad_id:
        raise ValueError(f"no class weights for the batch starting at sample {bad_id}")
    return mse(model, batch)


def loader(size: int = 64, batch_size: int = 8, nan_index: int = 45):
    """A plain DataLoader that knows nothing of ranks: under torchrun nanaudit gives it a
    DistributedSampler, so sample i goes to rank i % world_size."""
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(7)
    x = torch.randn(size, 8, generator=g)
    x[nan_index, 2] = float("nan")
    y = x[:, :1].nan_to_num() * 2.0
    return DataLoader(TensorDataset(x, y, torch.arange(size)), batch_size=batch_size)


def tuple_mse(model, batch):
    x, y, _ = batch
    return ((model(x) - y) ** 2).mean()
