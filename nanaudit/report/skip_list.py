"""The skip list: the bad batches and rows of a run, as JSON for a training loop to filter from
its data (`bisect --skip-list PATH`, and the bad steps of a run that kept going).

The file is `{"skip": [entry, ...]}`, one entry per bad batch, each a SkipEntry: `batch` (the
data's index of the batch; the step when the run knows no index), `rows` (null: not isolated),
`sample_ids` (the data set's ids of those rows, where the batch carries them),
`sample_indices` (`run`: the data set's indices of those rows, where a DataLoader's sampler gave
them, omitted when unknown), `cause`, and
where they apply `confirmed` (bisect: false when the data gave a different batch when read
again), `step` (the optimizer step of a bad step), `rank` (the rank whose batch it was) and,
where `batch` is the step under gradient accumulation, `micro_batch` (the bad batch's place in
the step's window).
Keys are only ever added, so a reader of bisect's lists reads these too.
"""

from __future__ import annotations

import json

from nanaudit.report.model import Finding, jsonable
from nanaudit.report.sections import SkipEntry


def skip_entry(finding: Finding) -> SkipEntry:
    """The entry of one bad step's finding: its batch, rows, ids, cause, step and rank."""
    producer = finding.producer
    index = finding.batch_index
    return SkipEntry(batch=index if index is not None else finding.step,
                     micro_batch=finding.micro_batch if index is None else None,
                     rows=list(finding.samples) if finding.samples is not None else None,
                     sample_ids=producer.sample_ids if producer is not None else None,
                     sample_indices=producer.sample_indices if producer is not None else None,
                     cause=finding.cause, step=finding.step, rank=finding.rank)


def skip_entries(findings: list[Finding]) -> list[SkipEntry]:
    """The entries of a run's bad steps, one per finding, in step order. A run that kept going
    past more bad steps than its report keeps whole writes its BadStepLog's `skip` instead
    (report/bad_steps.py), which has every bad step's."""
    return [skip_entry(f) for f in findings]


def skip_list_text(entries: list[SkipEntry]) -> str:
    """The file's text."""
    return json.dumps({"skip": jsonable(entries)}, indent=2, allow_nan=False) + "\n"
