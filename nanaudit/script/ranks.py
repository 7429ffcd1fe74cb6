"""`nanaudit run` under torchrun: what the script's ranks do together beyond the step's
flags (run/rank_checks.py): the re-run, on every rank at once, and the merge of every rank's
status and finding, so each rank's report names the rank that made the value.
"""

from __future__ import annotations

import os
import socket

from nanaudit.report.model import Report
from nanaudit.report.sections import RankStatus
from nanaudit.report.skip_list import skip_entry
from nanaudit.report.vocabulary import RerunStatus, Status
from nanaudit.run.distributed import current
from nanaudit.run.mesh import name_on_mesh
from nanaudit.run.rank_checks import RankChecks, gather_by_store, origin_entry


def merge_ranks(checks: RankChecks, report: Report, origin: int | None) -> None:
    """Every rank's status, and on every rank the finding of the rank that made the value:
    one whose re-run reproduced it (a re-run reproduces only on a rank whose own op made it:
    child.py), else `origin` (the rank the first run's flags named)."""
    mine = RankStatus(rank=checks.rank, status=report.status, steps_run=report.steps_run,
                      device=report.device, host=socket.gethostname(),
                      warnings=len(report.warnings),
                      mesh=checks.mesh.coordinate(checks.rank) if checks.mesh else None)
    rerun = report.run.rerun if report.run is not None else None
    gathered = gather_by_store(checks.coord, "merge",
                               (mine, report.finding, rerun, report.findings))
    made = [finding is not None and rerun is not None and rerun.status == RerunStatus.REPRODUCED
            for _, finding, rerun, _ in gathered]
    chosen = origin_entry([entry if entry[1] is not None else None for entry in gathered],
                          made, origin)
    if chosen is not None:
        report.finding = chosen[1]
        name_on_mesh(checks.mesh, report.finding)
        report.status = Status.NONFINITE     # every rank stops on the value, and says so
        if report.run is not None and chosen[2] is not None:
            report.run.rerun = chosen[2]
    _adopt_origins(report, checks.rank, [findings for *_, findings in gathered])
    for finding in report.findings:      # --keep-going: every bad step's, named alike
        name_on_mesh(checks.mesh, finding)
    section = checks.coord.describe()
    section.ranks = [status for status, *_ in gathered]
    section.note = checks.note or section.note      # DeepSpeed asked for, dropped
    report.distributed = section


def _adopt_origins(report: Report, rank: int, by_rank: list[list]) -> None:
    """--keep-going: each bad step a peer's batch made, as that peer found it. A step the
    ranks replayed has the origin's finding on every rank already; a batch that was bad
    before the model got it is not replayed, so only its own rank saw its tensors, rows and
    samples (the others' inputs were finite). The skip list's entries follow."""
    for i, finding in enumerate(report.findings):
        origin = finding.rank
        if origin is None or origin == rank or origin >= len(by_rank):
            continue
        theirs = next((f for f in by_rank[origin] if f.step == finding.step), None)
        if theirs is None or theirs.samples is None or finding.samples is not None:
            continue
        report.findings[i] = theirs
        if report.finding is finding:
            report.finding = theirs
        report.skip_list = [skip_entry(theirs) if e.step == theirs.step else e
                            for e in report.skip_list]


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
