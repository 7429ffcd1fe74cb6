"""`nanaudit run` under torchrun: what the script's ranks do together beyond the step's
flags (run/rank_checks.py): the re-run, on every rank at once, and the merge of every rank's
status and finding, so each rank's report names the rank that made the value.
"""

from __future__ import annotations

import os
import socket

from nanaudit.report.model import Report
from nanaudit.report.sections import RankStatus
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
    gathered = gather_by_store(checks.coord, "merge", (mine, report.finding, rerun))
    made = [finding is not None and rerun is not None and rerun.status == RerunStatus.REPRODUCED
            for _, finding, rerun in gathered]
    chosen = origin_entry([entry if entry[1] is not None else None for entry in gathered],
                          made, origin)
    if chosen is not None:
        report.finding = chosen[1]
        name_on_mesh(checks.mesh, report.finding)
        report.status = Status.NONFINITE     # every rank stops on the value, and says so
        if report.run is not None and chosen[2] is not None:
            report.run.rerun = chosen[2]
    for finding in report.findings:      # --keep-going: every bad step's, named alike
        name_on_mesh(checks.mesh, finding)
    section = checks.coord.describe()
    section.ranks = [status for status, _, _ in gathered]
    section.note = checks.note or section.note      # DeepSpeed asked for, dropped
    report.distributed = section


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
