"""`nanaudit run` under torchrun: the ranks of a script that joined a process group (DDP,
FSDP2) check together, stop together, and name the rank whose own values went bad.

At each check every rank adds one row of flags to a small all-reduce (run/distributed.py's
exchange), read with the step's one host read: its batch, its weights (its own shards under
FSDP), its loss, its own gradients before the reduce-scatter mixed them (FSDP:
run/sharded.PreReduceFlags) and its gradients as reduced. Every rank gets the same table, so
every rank stops at the same step before the update, and the verdict (run/verdict.py, the rule
every checker uses) names the first rank whose own value went bad. The table names no rank for
gradients that are only bad after the reduction (every rank's own were finite), nor, under DDP,
for weights and gradients that every rank shares: the re-run, where each rank's tracer sees
only its own ops, tells those apart.

After the run the ranks gather their statuses and findings, so each rank's report carries the
finding of the rank whose own ops made the value, and every rank's status.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Sequence
from typing import Any

import torch

from nanaudit.config.schema import DistributedOptions
from nanaudit.report.model import Report
from nanaudit.report.sections import RankStatus
from nanaudit.report.vocabulary import RerunStatus, Status
from nanaudit.run.distributed import Coordinator, DistributedError, current
from nanaudit.run.sharded import PreReduceFlags, check_supported, fsdp_modules
from nanaudit.run.verdict import Tripped, tripped_check

INPUT, WEIGHTS, LOSS, OWN_GRADIENTS, GRADIENTS = range(5)    # a rank's row of flags


class ScriptRanks:
    """The script's process group as the checks use it (one per script run)."""

    def __init__(self, coord: Coordinator):
        self.coord = coord
        self.rank = coord.rank
        self.flags = PreReduceFlags()
        self.sharded = False              # FSDP2: each rank holds its own shard of the weights

    @classmethod
    def join(cls) -> ScriptRanks | None:
        """The ranks, once the script initialised a process group of two or more."""
        coord = Coordinator.adopt()
        return cls(coord) if coord is not None else None

    def saw_model(self, module: torch.nn.Module) -> None:
        """The step's outermost module: flag its FSDP modules' own gradients (HSDP refused)."""
        modules = fsdp_modules(module)
        if modules:
            check_supported(modules)
            self.flags.install(modules)
            self.sharded = True

    def with_table(self, values: torch.Tensor) -> torch.Tensor:
        """The step's values [inputs finite, weights' norm, loss, gradients' norm] followed by
        every rank's row of flags, exchanged (no host read here)."""
        bad = (~torch.isfinite(values[1:])).to(torch.float64)      # weights, loss, gradients
        row = torch.stack([1.0 - values[0], bad[0], bad[1], self.flags.take(values.device),
                           bad[2]])
        return torch.cat([values, self.coord.exchange(row).reshape(-1)])

    def verdict(self, step: int, table: Sequence[float], updated_at: int | None) -> Tripped | None:
        """The check that tripped, from every rank's flags (`table`: the read's tail), with
        the first rank whose own value went bad as its part (None: no one rank's)."""
        width = len(table) // self.coord.world_size
        rows = [table[r * width:(r + 1) * width] for r in range(self.coord.world_size)]

        def ok(flag: int) -> list[bool]:
            return [not row[flag] > 0 for row in rows]
        own = ok(OWN_GRADIENTS)
        return tripped_check(step, inputs_ok=ok(INPUT),
                             weights_finite=ok(WEIGHTS) if self.sharded else all(ok(WEIGHTS)),
                             updated_at=updated_at, loss_finite=ok(LOSS),
                             grads_finite=own if not all(own) else all(ok(GRADIENTS)))

    def tracing(self, on: bool) -> None:
        """A re-run's traced window: the flags keep the reduce-scatter inputs, compute none."""
        self.flags.tracing = on

    def merge(self, report: Report, origin: int | None) -> None:
        """Every rank's status, and on every rank the finding of the rank that made the value:
        the one whose re-run traced it to its own op, else `origin` (the rank the first run's
        flags named), else the first rank with a finding."""
        mine = RankStatus(rank=self.rank, status=report.status, steps_run=report.steps_run,
                          device=report.device, host=socket.gethostname(),
                          warnings=len(report.warnings))
        rerun = report.run.rerun if report.run is not None else None
        gathered = gather_by_store(self.coord, "merge", (mine, report.finding, rerun))
        chosen = _origin_entry(gathered, origin)
        if chosen is not None:
            report.finding = chosen[1]
            report.status = Status.NONFINITE     # every rank stops on the value, and says so
            if report.run is not None and chosen[2] is not None:
                report.run.rerun = chosen[2]
        section = self.coord.describe()
        section.ranks = [status for status, _, _ in gathered]
        report.distributed = section


def _origin_entry(gathered: list, origin: int | None) -> Any:
    """(status, finding, rerun) of the rank that made the value: a re-run reproduces only on
    a rank whose own op made it (child.py: a value that arrived from a peer is not)."""
    traced = [entry for entry in gathered if entry[1] is not None and entry[2] is not None
              and entry[2].status == RerunStatus.REPRODUCED]
    if traced:
        return next((e for e in traced if e[0].rank == origin), traced[0])
    if origin is not None and gathered[origin][1] is not None:
        return gathered[origin]
    return next((entry for entry in gathered if entry[1] is not None), None)


def rerun_environment() -> dict | None:
    """Under torchrun, the environment of this rank's re-run: every rank re-runs the script
    together (its collectives need them all), meeting at a fresh port that rank 0 picked, with
    a store of its own (torchrun's agent store and the first run's group stay the first
    run's). None when the ranks run apart or alone."""
    coord = current()
    if coord is None:
        return None
    ports = gather_by_store(coord, "rerun-port", _free_port() if coord.rank == 0 else None)
    env = dict(os.environ)
    env["MASTER_PORT"] = str(ports[0])
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def gather_by_store(coord: Coordinator, key: str, payload: Any,
                    timeout_s: float = DistributedOptions.timeout_s) -> list:
    """Every rank's `payload`, by rank, through the rendezvous store: the script may have
    destroyed its process group already (a clean run ends with `destroy_process_group()`).
    A peer that never answers is a DistributedError after `timeout_s`, never a hang."""
    import datetime
    keys = [f"nanaudit/{key}/{rank}" for rank in range(coord.world_size)]
    try:
        # Pickled like all_gather_object's payloads: the peers are ranks of this same job.
        coord.store.set(keys[coord.rank], pickle.dumps(payload))
        coord.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return [pickle.loads(coord.store.get(k)) for k in keys]
    except Exception as exc:
        raise DistributedError(f"rank {coord.rank}: the ranks could not exchange their "
                               f"{key.replace('-', ' ')} within {timeout_s:g}s: {exc}") from None
