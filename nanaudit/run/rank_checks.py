"""Under torchrun, the flags each rank adds to a step's one read, so that every rank decides
alike at the same step and the rank whose own value went bad is named: for a program that
joined a process group itself (`nanaudit run`'s script, `Sentinel` in the user's FSDP2 loop).

Each rank's row (check/rank_row.py, the one layout of every front end): its batch, its weights
(its own shards under FSDP), its loss, its own gradients before the reduce-scatter mixed them
(FSDP: sharded.PreReduceFlags), its gradients as reduced, its own partial sums before tensor
parallel's all-reduce, forward and backward (mesh.PartialFlags: a rank whose bad partial came
after a tp peer's received it from it) and its buffers, exchanged in one small all-reduce
(distributed.py) and read with the step's values. Every rank gets the same table, so every rank
stops at the same step before the update, and the verdict (the rule every checker uses) names
the first rank whose own value went bad. The table names no rank for gradients that are only
bad after the reduction (every rank's own were finite), nor, under DDP, for the weights and
gradients every rank shares: a replay, where each rank's tracer sees only its own ops, tells
those apart.

After a trip, each rank's finding is gathered through the rendezvous store (the program may
have destroyed its process group) and the origin's chosen by one rule (`origin_entry`).
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch

from nanaudit.config.schema import DistributedOptions
from nanaudit.run.check.rank_row import RankTable, rank_row
from nanaudit.run.check.verdict import Tripped
from nanaudit.run.deepspeed_zero import (
    dropped_deepspeed,
    flag_own_gradients,
    is_engine,
    note_zero,
    zero_optimizer,
    zero_stage,
)
from nanaudit.run.distributed import Coordinator, DistributedError
from nanaudit.run.mesh import MeshView, PartialFlags
from nanaudit.run.pipeline import refuse_pipeline_stage
from nanaudit.run.sharded import PreReduceFlags, fsdp_modules


class RankChecks:
    """One run's process group as its checks use it (see the module docstring)."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self.rank = coord.rank
        self.flags = PreReduceFlags()
        self.sharded = False              # FSDP2: each rank holds its own shard of the weights
        self.fsdp: list = []              # the model's FSDP2 modules (replayed together)
        self.zero_stage = 0               # DeepSpeed ZeRO's stage (0: none)
        self._seen: set[int] = set()      # the outermost modules looked into
        self.mesh: MeshView | None = None # the model's device mesh, once seen (run/mesh.py)
        self.partials = PartialFlags()    # TP: this rank's partial sums before the all-reduce
        self.note: str | None = None      # why the run is not the one asked for (DeepSpeed)
        self._device = torch.device("cpu")  # the step values' device, as the last table's

    @classmethod
    def join(cls) -> RankChecks | None:
        """The ranks, once the program initialised a process group of two or more."""
        coord = Coordinator.adopt()
        return cls(coord) if coord is not None else None

    @classmethod
    def saw(cls, checks: RankChecks | None, module: torch.nn.Module) -> RankChecks | None:
        """`checks`, or the ranks once the program joined a process group, told of the step's
        outermost `module`."""
        checks = checks if checks is not None else cls.join()
        if checks is not None:
            checks.saw_model(module)
        return checks

    def saw_model(self, module: torch.nn.Module) -> None:
        """The step's outermost module: flag its FSDP modules' own gradients; note its mesh."""
        if id(module) in self._seen:
            return
        self._seen.add(id(module))
        refuse_pipeline_stage(module)
        self.note = self.note or dropped_deepspeed(module)
        self.mesh = MeshView.of(module) or self.mesh
        self.partials.install(module)
        if is_engine(module) and zero_optimizer(module) is not None:
            # DeepSpeed ZeRO: each rank's gradients before DeepSpeed reduces them, its own
            # partition of the weights (run/deepspeed_zero.py)
            flag_own_gradients(module, self.flags)
            note_zero(module)
            self.sharded = True
            self.zero_stage = zero_stage(module)
        modules = fsdp_modules(module)
        if modules:
            self.flags.install(modules)
            self.sharded = True
            self.fsdp.extend(modules)

    def table(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's row of flags, exchanged, from this rank's step values [inputs finite,
        weights' norm, loss, gradients' norm, buffers' peak] (no host read here). Each rank
        updates its own buffers' running statistics: the rank whose forward made one bad is
        named."""
        self._device = values.device      # where the exchange's tensors go (gloo: the CPU)
        own = self.partials.take_gradients(self.flags.take(values.device))
        row = rank_row(values, own, self.partials.take(values.device))
        return self.coord.exchange(row).reshape(-1)

    def verdict(self, step: int, table: Sequence[float], updated_at: int | None,
                norms: tuple[float, float] | None = None) -> Tripped | None:
        """The check that tripped, from every rank's flags (`table`: the read's tail), with
        the first rank whose own value went bad as its part (None: no one rank's). `norms`:
        this rank's weights' and reduced gradients' norms as confirmed element-wise, which
        decide for the ones every DDP rank shares (RankTable.verdict): a flag from a float32
        sum of squares that overflowed on finite weights is no trip. Sharded, each rank's
        shard is its own: every rank's confirmed reading is exchanged (Coordinator.confirmed)."""
        weights_ok, reduced_ok = (None, None) if norms is None else map(math.isfinite, norms)
        rows = RankTable.from_read(table, self.coord.world_size)
        if self.sharded and norms is not None and rows.doubts_state():
            return rows.verdict(step, updated_at=updated_at, sharded=True,
                                **self.coord.confirmed(bool(weights_ok), bool(reduced_ok),
                                                       self._device))
        return rows.verdict(step, updated_at=updated_at, sharded=self.sharded,
                            weights_finite=weights_ok, reduced_finite=reduced_ok)

    def tracing(self, on: bool) -> None:
        """A re-run's traced window: the flags keep the reduce-scatter inputs, compute none."""
        self.flags.tracing = self.partials.tracing = on


def origin_entry(entries: Sequence, made_here: Sequence[bool], origin: int | None) -> Any:
    """Of every rank's entry (by rank, None: it has no finding), the one of the rank that
    made the value: one whose own replay traced it to its own op (`made_here`; `origin` first
    among them), else `origin` (the rank the flags named), else the first with a finding."""
    traced = [r for r, made in enumerate(made_here) if made and entries[r] is not None]
    if traced:
        return entries[origin if origin in traced else traced[0]]
    if origin is not None and entries[origin] is not None:
        return entries[origin]
    return next((entry for entry in entries if entry is not None), None)


def gather_by_store(coord: Coordinator, key: str, payload: Any,
                    timeout_s: float = DistributedOptions.timeout_s) -> list:
    """Every rank's `payload`, by rank, through the rendezvous store: the program may have
    destroyed its process group already (a clean script ends with `destroy_process_group()`).
    A peer that failed (its error is in the store) or never answers is a DistributedError at
    once or after `timeout_s`, never a hang."""
    coord.gathers += 1           # every rank gathers in the same order: the same keys
    keys = [f"nanaudit/{key}/{coord.gathers}/{rank}" for rank in range(coord.world_size)]
    deadline = time.monotonic() + timeout_s
    try:
        # Pickled like all_gather_object's payloads: the peers are ranks of this same job.
        coord.store.set(keys[coord.rank], pickle.dumps(payload))
        while not coord.store.check(keys):
            failed = coord.peer_error(wait_s=0.0)
            if failed is not None or time.monotonic() > deadline:
                why = (f"rank {failed.rank} failed" if failed is not None
                       else f"a peer did not answer within {timeout_s:g}s")
                raise DistributedError(f"rank {coord.rank}: the ranks could not exchange "
                                       f"their {key.replace('-', ' ')}: {why}")
            time.sleep(0.02)
        return [pickle.loads(coord.store.get(k)) for k in keys]
    except DistributedError:
        raise
    except Exception as exc:
        raise DistributedError(f"rank {coord.rank}: the ranks could not exchange their "
                               f"{key.replace('-', ' ')}: {exc}") from None
