"""`nanaudit run`'s error trip under torchrun: one rank's script raised on a non-finite value
(`torch.multinomial` on NaN probabilities, the script's own `assert torch.isfinite(loss)`)
while its peers went on into the step's next collective (DDP's gradient all-reduce, the step
check's exchange), which the raising rank never joins. A peer blocked inside a gloo or NCCL
collective cannot be called back: neither destroying nor aborting the raising rank's group
frees it (tried on gloo, torch 2.13: it stays blocked); only the raising rank's closed
connections do, when its process ends. So the ranks cannot meet again, neither to replay the
step together nor to re-run the script together (the re-run waited for the blocked peers until
the test's bound: issue 35).

What is sound:
  - DDP, and DeepSpeed ZeRO-1/2 (every weight whole on every rank): the raising rank replays
    its window alone, on the wrapped module (error_replay.py): a forward through `.module` runs
    no collective (no buffer broadcast), and the loss code runs none. A window whose replay
    would run a backward (an accumulation window's earlier micro-batches, a raise inside
    backward) is refused: its gradients would reach DDP's reducer, whose all-reduce the peers
    are waiting in.
  - FSDP2, DeepSpeed ZeRO-3, meshes of several dimensions: a forward gathers every rank's weight
    shards, with peers that wait in another collective, so the model is not run again: the
    loss code alone is replayed, from the model's output as the first run recorded it (a
    forward that returned, its output finite, plain tensors: a DTensor output's loss code joins
    collectives), which names a value the loss code made (`log` of a zero weight before the
    script's assert). A value the forward made, or a forward that raised, is refused, saying
    why; the first run's finding (step, rank, the exception, the tensors its frames held) is
    then what every rank reports.
  - Either way, no re-run. The raising rank posts its finding and status to the rendezvous
    store, writes its own report and ends its process at once (coordinator.failed: no exit
    barrier, which the blocked peers could not reach). Its closed connections free the peers,
    whose collective fails; each reads the finding from the store (once, no wait) and reports it as
    its own finding (the origin rank named, exit 1) instead of a peer failure. A peer that finds
    no finding there (the store was the raising rank's own: rank 0 without torchrun's agent
    store) keeps today's verdict: a DistributedError, exit 8.
"""

from __future__ import annotations

import pickle
import socket
from typing import Any

import torch

from nanaudit.report.model import Report
from nanaudit.report.sections import RankStatus
from nanaudit.report.vocabulary import Status
from nanaudit.run.distributed import is_collective_failure
from nanaudit.run.rank_checks import RankChecks
from nanaudit.run.sharded import is_sharded
from nanaudit.script.before_window import tensors_in
from nanaudit.script.rank_replay import not_replayed_here, replayed_together
from nanaudit.script.replayable import NotReplayable

_KEY = "nanaudit/error-trip/{}"


def forward_alone(ranks: RankChecks, calls: list) -> bool:
    """How the raising rank replays its window without its peers: True, the model's forward
    and the loss code (DDP's local module runs no collective); False, the loss code alone from
    the model's recorded output (the forward gathers with the peers). NotReplayable: neither
    (see the module docstring)."""
    if any(call.code.roots for call in calls):
        raise NotReplayable("the window's backward would reach the gradient collectives the "
                            "peers wait in")
    layout = not_replayed_here(ranks)
    if layout is None and replayed_together(ranks):
        layout = ("under FSDP2 or tensor parallel the replay's forward joins collectives "
                  "with every rank, and the peers are blocked in another collective")
    if layout is None:
        return True
    why = _output_refusal(calls[-1].output)
    if why is not None:
        raise NotReplayable(f"{layout}; {why}")
    return False


def _output_refusal(output: Any) -> str | None:
    """Why the loss code cannot be replayed alone from the model's recorded output (None: it
    can). One read of the output, on an error trip only."""
    if output is None:
        return "the model's forward raised, and only the loss code could be run again alone"
    tensors = tensors_in(output)
    if any(is_sharded(t) for t in tensors):
        return "the model's output is a DTensor, whose loss code joins collectives"
    if any(t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())
           for t in tensors):
        return ("the model's output was already non-finite: its forward made the value, and "
                "only the loss code could be run again alone")
    return None


def not_rerun_note(note: str | None) -> str:
    """The finding's clause when an error trip under torchrun was not localized in-process."""
    why = f"not localized in-process ({note}); " if note else ""
    return (f"{why}not re-run: the peer ranks, blocked in a collective the raising rank never "
            f"joins, cannot run the script again with it; run it on one process to name the op")


def _status(rank: int, report: Report, status: Status) -> RankStatus:
    """This rank's line of the `distributed` section, from its report."""
    return RankStatus(rank=rank, status=status, steps_run=report.steps_run,
                      device=report.device, host=socket.gethostname(),
                      warnings=len(report.warnings))


def post_and_leave(ranks: RankChecks, report: Report) -> None:
    """The raising rank: its finding and status to the store for the peers, its report's
    `distributed` section with its own status alone (the peers are still blocked), and the
    process marked to leave without the exit barrier."""
    coord = ranks.coord
    mine = _status(ranks.rank, report, report.status)
    replay = report.run.replay if report.run is not None else None
    try:
        # Pickled like all_gather_object's payloads: the peers are ranks of this same job.
        coord.store.set(_KEY.format(ranks.rank), pickle.dumps((mine, report.finding, replay)))
    except Exception:
        pass        # a store that is gone: the peers report the failure as before
    coord.failed = True
    section = coord.describe()
    section.ranks = [mine]
    report.distributed = section


def adopt_posted(coord: Any, exc: BaseException, report: Report) -> bool:
    """A peer whose collective failed: when a rank posted an error trip, it becomes this
    rank's finding (True); else False (the failure stands)."""
    if not is_collective_failure(exc):
        return False
    posted = _posted(coord)
    if posted is None:
        return False
    status, finding, replay = posted
    report.status, report.error, report.finding = Status.NONFINITE, None, finding
    if report.run is not None:
        report.run.replay = replay
    mine = _status(coord.rank, report, Status.NONFINITE)
    section = coord.describe()
    section.ranks = sorted([status, mine], key=lambda s: s.rank)
    report.distributed = section
    coord.failed = True     # the raising rank has left: no exit barrier to wait at
    return True


def _posted(coord: Any) -> tuple | None:
    """The first rank's posted (status, finding, replay). Read once, without waiting: the
    raising rank posts before its process ends, so the key is there by the time its closed
    connections fail this rank's collective (a rank that died posted nothing, and its peers'
    exit 8 comes as soon as before)."""
    try:
        for rank in range(coord.world_size):
            key = _KEY.format(rank)
            if rank != coord.rank and coord.store.check([key]):
                return tuple(pickle.loads(coord.store.get(key)))
    except Exception:
        pass            # the store went with the raising rank
    return None
