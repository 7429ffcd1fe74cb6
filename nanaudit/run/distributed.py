"""Runs under torchrun: the process group, DDP, sharded data, and ranks that never hang.

Under `torchrun` (WORLD_SIZE > 1 in the environment) each rank audits its own shard:
  - Every step, each rank's row of flags (check/rank_row.py: its batch, weights, loss, own
    gradients before averaging (parallelism.py), out of data...) goes into one small
    all-reduce (MAX) of a world x row table, read with the step's one host sync. Every rank
    sees the same table, so every rank stops at the same step, and the row says which rank's
    batch made the value.
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
import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from nanaudit.config.schema import Config, DistributedOptions
from nanaudit.errors import ConfigError, NanauditError, Problem
from nanaudit.exitcodes import ExitCode
from nanaudit.report.sections import DistributedRun, ErrorInfo
from nanaudit.run.parallelism import Parallelism
from nanaudit.run.sharded import PreReduceFlags

_ERROR_KEY = "nanaudit/error"
_EXIT_KEY = "nanaudit/exit"
_LEFT_KEY = "nanaudit/left"     # the ranks past the exit barrier, but rank 0
_CURRENT: Coordinator | None = None


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
        if isinstance(candidate, (DistributedError, getattr(dist, "DistError", ()))):
            return True
        text = str(candidate)
        if any(mark in text for mark in ("Connection closed by peer", "Connection reset",
                                         "Timed out", "gloo", "NCCL", "ProcessGroup",
                                         "Watchdog", "watchdog")):
            return True
    return False


@dataclass(frozen=True)
class Placement:
    """Where a rank runs: the backend, its device (None: the config's device as resolved), and
    why, when it is not what `auto` would give on a machine with a GPU per rank."""

    backend: str
    device: torch.device | None
    note: str | None = None


def choose_placement(backend: str, device: str, local_rank: int, local_world: int,
                     gpus: int) -> Placement:
    """NCCL only when every local rank has a GPU of its own (LOCAL_WORLD_SIZE <= GPUs), each
    on cuda:LOCAL_RANK; otherwise gloo on the CPU, or a config error when CUDA was asked for.
    Ranks sharing one GPU under NCCL never finish joining; ranks of a node decide alike."""
    fits = gpus > 0 and local_rank < gpus and local_world <= gpus
    lacking = (f"local rank {local_rank} of {local_world} on this node has no GPU of its own "
               f"({gpus} visible)")
    if device == "cpu":
        if backend == "nccl":
            raise ConfigError([Problem("distributed.backend", "nccl needs CUDA tensors, but "
                                       "`device: cpu` was asked for; use gloo (or auto)")])
        return Placement("gloo" if backend == "auto" else backend, torch.device("cpu"))
    if device.startswith("cuda") or backend == "nccl":
        if not fits:
            key = "device" if device.startswith("cuda") else "distributed.backend"
            raise ConfigError([Problem(key, f"`{device if key == 'device' else 'nccl'}` asked "
                                       f"for under torchrun, but {lacking}: run at most {gpus} "
                                       f"process(es) per node, or use `device: cpu` (gloo)")])
        return Placement("nccl" if backend == "auto" else backend,
                         torch.device("cuda", local_rank))
    if device != "auto":                              # mps and the like: as resolved
        return Placement("gloo" if backend == "auto" else backend, None)
    if fits:
        return Placement("nccl" if backend == "auto" else backend,
                         torch.device("cuda", local_rank))
    note = f"{lacking}: every rank runs on the CPU with gloo" if gpus else None
    return Placement("gloo" if backend == "auto" else backend, torch.device("cpu"), note)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def current() -> Coordinator | None:
    return _CURRENT


class Coordinator:
    """One rank's view of the run: its rank, the process group, and the store."""

    def __init__(self, options: DistributedOptions, rank: int, world_size: int, local_rank: int):
        self.options = options
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.backend = ""
        self.placement: Placement | None = None
        self.store: Any = None           # the rendezvous store (torch.distributed.Store)
        self.parallel = Parallelism(options, rank, world_size)   # DDP or FSDP2, data shards
        self.failed = False
        self.terminated = False           # torchrun sent SIGTERM (it is stopping the group)
        self.gathers = 0                  # exchanges through the store so far (their keys)

    @classmethod
    def start(cls, config: Config, device_name: str) -> Coordinator:
        """Initialise the process group from torchrun's environment variables."""
        global _CURRENT
        import torch.distributed as dist
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        coord = cls(config.distributed, rank, world, local_rank)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        coord.placement = choose_placement(config.distributed.backend, device_name, local_rank,
                                           local_world, gpus)
        coord.backend = coord.placement.backend
        if coord.backend == "nccl":
            torch.cuda.set_device(coord.local_rank)
            # torchrun asks NCCL's watchdog to kill the process on a collective timeout
            # (SIGABRT, no report). Abort the communicators only: the timed-out collective
            # then raises here, and a stalled peer is exit 8 like under gloo.
            if os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") in ("1", "3"):
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        timeout = datetime.timedelta(seconds=config.distributed.timeout_s)
        try:
            if not dist.is_initialized():
                dist.init_process_group(coord.backend, timeout=timeout)
        except Exception as exc:
            raise DistributedError(f"cannot join the process group (backend {coord.backend}, "
                                   f"rank {rank} of {world}): {exc}") from None
        coord.store = dist.distributed_c10d._get_default_store()
        coord._catch_sigterm()
        _CURRENT = coord
        return coord

    @classmethod
    def adopt(cls) -> Coordinator | None:
        """The process group an unmodified script under torchrun initialised itself (`nanaudit
        run`): its checks exchange flags over it, and its ranks leave together through its
        store. None when the script joined none (its ranks then run apart)."""
        global _CURRENT
        import torch.distributed as dist
        if _CURRENT is not None:
            return _CURRENT
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        coord = cls(DistributedOptions(), dist.get_rank(), dist.get_world_size(),
                    int(os.environ.get("LOCAL_RANK", "0")))
        coord.backend = str(dist.get_backend())
        coord.store = dist.distributed_c10d._get_default_store()
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

        def note(signum: int, frame: object) -> None:
            self.terminated = True
        signal.signal(signal.SIGTERM, note)

    def device(self, resolved: torch.device) -> torch.device:
        """Each rank on its own GPU (cuda:LOCAL_RANK) under NCCL; CPU ranks share the CPU."""
        if self.placement is not None and self.placement.device is not None:
            return self.placement.device
        if resolved.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return resolved

    # --- model and data (parallelism.py) ---------------------------------------------------

    @property
    def sharded(self) -> bool:
        """FSDP2: each rank holds its own shard of the weights (sharded.py)."""
        return self.parallel.sharded

    @property
    def pre_reduce(self) -> PreReduceFlags | None:
        """FSDP2: the flags of this rank's reduce-scatter inputs (None: not sharded)."""
        return self.parallel.pre_reduce

    # --- the per-step exchange -------------------------------------------------------------

    def exchange(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's row of flags, by one all-reduce (MAX) of a world x len(row) table."""
        import torch.distributed as dist
        table = torch.zeros(self.world_size, row.numel(), dtype=torch.float64, device=row.device)
        table[self.rank] = row
        try:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        except Exception as exc:
            raise DistributedError(f"rank {self.rank}: the step's exchange of flags failed: "
                                   f"{exc}") from None
        return table

    def confirmed(self, weights_finite: bool, reduced_finite: bool, device: torch.device
                  ) -> dict[str, list[bool]]:
        """Every rank's shards of the weights and reduced gradients as each confirmed them
        element by element (FSDP2, ZeRO: each rank's are its own), by one more exchange: only on
        a step whose rank table flags some rank's, which every rank's identical table says
        alike, so every rank makes it. Keyed as RankTable.verdict takes them."""
        row = torch.tensor([float(not weights_finite), float(not reduced_finite)],
                           dtype=torch.float64, device=device)
        table = self.exchange(row).tolist()
        return {"weights_finite": [not r[0] > 0 for r in table],
                "reduced_finite": [not r[1] > 0 for r in table]}

    def read(self, values: torch.Tensor) -> list[float]:
        """The step's one host read, which is where a failed NCCL collective shows."""
        try:
            return values.tolist()
        except Exception as exc:
            raise DistributedError(f"rank {self.rank}: reading the step's exchanged flags "
                                   f"failed: {exc}") from None

    def gather(self, payload: Any) -> list:
        import torch.distributed as dist
        out: list = [None] * self.world_size
        dist.all_gather_object(out, payload)
        return out

    # --- failure and exit --------------------------------------------------------------------

    def fail(self, error: ErrorInfo) -> None:
        """Tell the peers this rank failed. The CLI then ends this process at once (rank 0
        after writing the report): only a closed connection frees a peer blocked in one of
        DDP's collectives, and destroying the group does not close it while DDP holds it."""
        self.failed = True
        try:
            # Pickled like all_gather_object's payloads: the peers are ranks of this same job.
            self.store.set(_ERROR_KEY, pickle.dumps(error))
            self.store.add(_EXIT_KEY, 1)
            if self.rank != 0:
                self.store.add(_LEFT_KEY, 1)    # it leaves now: rank 0 waits for it no more
        except Exception:
            pass

    def peer_error(self, wait_s: float = 5.0) -> ErrorInfo | None:
        """The error a failed peer left in the store (waits briefly: it writes, then closes)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.store.check([_ERROR_KEY]):
                    return pickle.loads(self.store.get(_ERROR_KEY))
            except Exception:
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
            self._leave_last()
        except Exception:
            pass

    def _leave_last(self) -> None:
        """Rank 0 (which hosts the store, launched without torchrun's agent) leaves after every
        peer read the barrier's count: one polling it when rank 0 left had its store call fail,
        and printed the failure's C++ frames on its stderr."""
        if self.rank != 0:
            self.store.add(_LEFT_KEY, 1)
            return
        deadline = time.monotonic() + 5.0
        while self.store.add(_LEFT_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)

    def describe(self) -> DistributedRun:
        """The report's `distributed` section, before the ranks meet."""
        note = self.placement.note if self.placement is not None else None
        return DistributedRun(rank=self.rank, world_size=self.world_size, backend=self.backend,
                              host=socket.gethostname(), local_rank=self.local_rank,
                              note=note or None)
