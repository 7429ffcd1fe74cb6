"""Runs under torchrun: the process group, DDP, sharded data, and ranks that never hang.

Under `torchrun` (WORLD_SIZE > 1 in the environment) each rank audits its own shard:
  - Every step, each rank's row of flags [bad input, bad loss, bad local gradients, out of
    data] goes into one small all-reduce (MAX) of a world x 4 table, read with the step's one
    host sync. Every rank sees the same table, so every rank stops at the same step, and the
    row says which rank's batch made the value.
  - "Bad local gradients" is measured by a DDP communication hook on each bucket *before* the
    all-reduce averages the ranks' gradients together; after it, every rank's gradients hold
    the NaN and the rank that made it can no longer be told.
  - Each rank fetches its next batch before the flags go out, so a rank that runs out of data
    stops everyone at the same step instead of leaving them waiting in a collective.
  - The rank named by the flags replays the step on the local module (no DDP, no collectives);
    the others wait in the final gather, bounded by `distributed.timeout_s`.
  - A rank whose code raises writes its error to the rendezvous store and closes its process
    group: the peers' pending collectives fail at once (gloo), they read the error from the
    store and exit with the same code. With NCCL, peers notice at the process-group timeout.
  - Rank 0 writes the one merged report; all ranks meet at a store barrier before exiting, so
    torchrun never stops rank 0 while it is still writing.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import socket
import time
from typing import Any

import torch

from nanaudit.config import Config, DistributedOptions
from nanaudit.errors import NanauditError
from nanaudit.exitcodes import ExitCode

FLAGS = ("input", "loss", "gradient", "exhausted")
_ERROR_KEY = "nanaudit/error"
_EXIT_KEY = "nanaudit/exit"
_CURRENT: "Coordinator | None" = None


class DistributedError(NanauditError):
    """A peer rank failed or stopped answering; the process group could not go on."""

    exit_code = ExitCode.DISTRIBUTED


def is_collective_failure(exc: BaseException) -> bool:
    """Did a collective fail (a peer closed its connection or timed out), perhaps while the
    user's code (DDP's forward or backward) was running it?"""
    import torch.distributed as dist
    inner = getattr(exc, "exception", None)          # UserCodeError wraps the original
    for candidate in (exc, inner):
        if candidate is None:
            continue
        if isinstance(candidate, getattr(dist, "DistError", ())):
            return True
        text = str(candidate)
        if any(mark in text for mark in ("Connection closed by peer", "Connection reset",
                                         "Timed out", "gloo", "NCCL", "ProcessGroup")):
            return True
    return False


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current() -> "Coordinator | None":
    return _CURRENT


class Coordinator:
    """One rank's view of the run: its rank, the process group, and the store."""

    def __init__(self, options: DistributedOptions, rank: int, world_size: int, local_rank: int):
        self.options = options
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.backend = ""
        self.store = None
        self.local_grad_bad: torch.Tensor | None = None
        self.failed = False
        self.terminated = False           # torchrun sent SIGTERM (it is stopping the group)

    @classmethod
    def start(cls, config: Config, device_name: str) -> "Coordinator":
        """Initialise the process group from torchrun's environment variables."""
        global _CURRENT
        import torch.distributed as dist
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        coord = cls(config.distributed, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
        coord.backend = coord._backend(device_name)
        if coord.backend == "nccl":
            torch.cuda.set_device(coord.local_rank)
        timeout = datetime.timedelta(seconds=config.distributed.timeout_s)
        try:
            if not dist.is_initialized():
                dist.init_process_group(coord.backend, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - rendezvous failures come in many types
            raise DistributedError(f"cannot join the process group (backend {coord.backend}, "
                                   f"rank {rank} of {world}): {exc}") from None
        coord.store = dist.distributed_c10d._get_default_store()
        coord._catch_sigterm()
        _CURRENT = coord
        return coord

    def _catch_sigterm(self) -> None:
        """torchrun stops every rank with SIGTERM once one exits. Note it instead of dying:
        a rank blocked in a collective with the rank that left is about to get an error and
        write the report; the step loop stops at the next step (a partial report)."""
        import signal
        import threading
        if threading.current_thread() is not threading.main_thread():
            return

        def note(signum, frame):
            self.terminated = True
        signal.signal(signal.SIGTERM, note)

    def _backend(self, device_name: str) -> str:
        if self.options.backend != "auto":
            return self.options.backend
        wants_cuda = device_name.startswith("cuda") or (device_name == "auto"
                                                        and torch.cuda.is_available())
        return "nccl" if wants_cuda else "gloo"

    def device(self, resolved: torch.device) -> torch.device:
        """Each rank on its own GPU (LOCAL_RANK); CPU ranks share the CPU."""
        if resolved.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return resolved

    # --- model and data -------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        if not self.options.ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids,
                                      find_unused_parameters=self.options.find_unused_parameters)
        self.local_grad_bad = torch.zeros((), dtype=torch.float64, device=device)
        ddp.register_comm_hook(self, _flag_then_allreduce)
        return ddp

    def shard(self, data: Any, sharded_by_user: bool) -> Any:
        """This rank's part of the data: the user's own shard, a DistributedSampler for a
        DataLoader, or every world_size-th batch of any other iterable."""
        if sharded_by_user:
            return data
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        if isinstance(data, DataLoader) and data.batch_size is not None:
            sampler = DistributedSampler(data.dataset, num_replicas=self.world_size,
                                         rank=self.rank, shuffle=False, drop_last=data.drop_last)
            return DataLoader(data.dataset, batch_size=data.batch_size, sampler=sampler,
                              collate_fn=data.collate_fn, num_workers=data.num_workers,
                              drop_last=data.drop_last, pin_memory=data.pin_memory)
        return itertools.islice(data, self.rank, None, self.world_size)

    # --- the per-step exchange -------------------------------------------------------------

    def local_gradient_flag(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 when this rank's own gradients (before averaging) held a non-finite value."""
        if self.local_grad_bad is None:      # no DDP: the gradients are the local ones
            return (~torch.isfinite(grad_norm)).to(torch.float64)
        flag, self.local_grad_bad = self.local_grad_bad, torch.zeros_like(self.local_grad_bad)
        return flag

    def exchange(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's row of flags, by one all-reduce (MAX) of a world x len(FLAGS) table."""
        import torch.distributed as dist
        table = torch.zeros(self.world_size, len(FLAGS), dtype=torch.float64, device=row.device)
        table[self.rank] = row
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        return table

    def gather(self, payload: dict) -> list[dict]:
        import torch.distributed as dist
        out: list = [None] * self.world_size
        dist.all_gather_object(out, payload)
        return out

    # --- failure and exit --------------------------------------------------------------------

    def fail(self, error: dict) -> None:
        """Tell the peers this rank failed. The CLI then ends this process at once (rank 0
        after writing the report): only a closed connection frees a peer blocked in one of
        DDP's collectives, and destroying the group does not close it while DDP holds it."""
        self.failed = True
        try:
            self.store.set(_ERROR_KEY, json.dumps({"rank": self.rank, **error}, default=str))
            self.store.add(_EXIT_KEY, 1)
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0; nothing to add
            pass

    def peer_error(self, wait_s: float = 5.0) -> dict | None:
        """The error a failed peer left in the store (waits briefly: it writes, then closes)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check([_ERROR_KEY]):
                    return json.loads(self.store.get(_ERROR_KEY))
            except Exception:  # noqa: BLE001 - the store went away: no error to read
                return None
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Meet every rank at a store barrier (a failed rank only counts itself in), so all
        ranks exit together: torchrun stops the whole group as soon as one rank exits."""
        global _CURRENT
        import torch.distributed as dist
        _CURRENT = None
        if self.failed:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            self.store.add(_EXIT_KEY, 1)
            deadline = time.monotonic() + min(self.options.timeout_s, 60.0)
            while self.store.add(_EXIT_KEY, 0) < self.world_size and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - a peer hosting the store already left: we are done
            pass

    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "backend": self.backend,
                "host": socket.gethostname(), "local_rank": self.local_rank}


def _flag_then_allreduce(coord: Coordinator, bucket):
    """DDP comm hook: note whether this rank's bucket is finite, then average as usual."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buffer = bucket.buffer()
    bad = (~torch.isfinite(buffer)).any().to(torch.float64)
    coord.local_grad_bad = torch.maximum(coord.local_grad_bad, bad.to(coord.local_grad_bad.device))
    return allreduce_hook(None, bucket)
