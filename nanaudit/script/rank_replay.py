"""`nanaudit run`'s in-process replay under torchrun (DDP): the rank that made the value replays
its own step on its local module (the DDP wrapper's `.module`: no gradient all-reduce, no peer
waited on), so its gradients are its own, from before the reduction that mixed them into every
rank's; then every rank gets the finding through the rendezvous store, bounded by the
distributed timeout (a peer that died is a DistributedError, exit 8, never a hang).

When the step's flags named no rank (DDP's gradients are checked as reduced: each rank's own
are not flagged), every rank replays its own step, and the one whose replay traced the value to
its own op is the origin (`origin_entry`, the rule scan uses). The decision to fall back to the
re-run is taken from the gathered entries, so every rank takes it alike.

Sharded models (FSDP2, DeepSpeed ZeRO) and tensor-parallel meshes are not replayed here: their
forward's all-gathers need every rank at once, and they keep the re-run together."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from nanaudit.report.model import Finding
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import RerunStatus
from nanaudit.run.rank_checks import RankChecks, gather_by_store, origin_entry

Replayed = tuple[Rerun | None, Finding | None]


def local_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a rank replays: DDP's wrapped module (its forward and backward alone, no
    collective), anything else as it is."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def not_replayed_here(ranks: RankChecks) -> str | None:
    """Why the ranks' step is not replayed in-process (None: it is)."""
    if ranks.sharded:
        return ("the in-process replay is not built for a sharded model (FSDP2, DeepSpeed "
                "ZeRO), whose forward gathers every rank's shards")
    if ranks.mesh is not None:
        return ("the in-process replay is not built for a device mesh (tensor parallel), "
                "whose forward joins its peers' collectives")
    return None


def replayed_on_ranks(ranks: RankChecks, origin: int | None,
                      replay_here: Callable[[], Replayed]) -> Replayed:
    """(the replay's record, the origin's finding) on every rank: replayed by `origin` (every
    rank when None), gathered by all."""
    why = not_replayed_here(ranks)
    if why is not None:
        return Rerun(status=RerunStatus.SKIPPED, note=why), None
    mine: Replayed = replay_here() if origin in (None, ranks.rank) else (None, None)
    if mine[1] is not None:
        mine[1].rank = ranks.rank
    entries = gather_by_store(ranks.coord, "in-process-replay", mine)
    found = [entry if entry[1] is not None else None for entry in entries]
    chosen = origin_entry(found, [entry is not None for entry in found], origin)
    if chosen is not None:
        return chosen
    # No rank's replay named the op: the origin's record says why (the re-run follows).
    record = entries[origin][0] if origin is not None else None
    return record or next((r for r, _f in entries if r is not None), None), None
