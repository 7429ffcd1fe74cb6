"""Fixtures shared by every test folder (helpers that are not fixtures live in helpers.py)."""

from __future__ import annotations

import gc
import os
import textwrap
from pathlib import Path

import pytest
import yaml

# The suite computes single-threaded, in its workers and in every process they start (the
# variable is inherited; read at torch's import, which comes later). Its models are tiny, so a
# second intra-op thread buys nothing, while with more busy processes than cores (CI: 3 workers
# on 2 cores, each starting ranks) OpenMP's threads spin waiting for each other and burn the
# CPU the other tests need: `scripts/bench.py --quick` took 47 s of CPU with the default
# threads on a busy 2-core machine and 7 s with one. A run that sets it keeps its own value.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _scratch_cwd(tmp_path, monkeypatch):
    """Run every test in its own folder: default outputs (./nanaudit-reports) land there."""
    monkeypatch.chdir(tmp_path)



@pytest.fixture
def host_reads(monkeypatch):
    """Counts of `Tensor.tolist()` and `Tensor.item()` calls (host reads of device values)."""
    import torch
    calls = {"tolist": 0, "item": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls



@pytest.fixture
def case(tmp_path):
    """Write `case.py` (dedented code) and `config.yaml` (keys given) in tmp_path."""
    def write(code: str, **config) -> Path:
        (tmp_path / "case.py").write_text(textwrap.dedent(code))
        # The cases' code builds CPU tensors (torch.full, torch.from_numpy) as written: pin the
        # device, or `device: auto` takes CUDA on a GPU machine and the case raises there.
        lines = {"model": "case:build_model", "data": "case:batches", "loss": "case:loss",
                 "device": "cpu"}
        lines.update(config)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(lines, sort_keys=False))
        return path
    return write


# The suite's running order under pytest-xdist: the long tests first. Under `-n 3 --dist load
# --maxschedchunk 2` (CI, the README) the workers take the collected tests in order, two at a
# time, so a 4-rank torchrun launch collected last would run alone at the end while the other
# workers sit idle. Started first, the long tests overlap each other and the short ones fill
# the gaps. "Long" is what the tests say of themselves: the `distributed` and `slow` marks.


def _rank(item: pytest.Item) -> int:
    """0 for a multi-process launch, 1 for another slow test, 2 for the rest."""
    if item.get_closest_marker("distributed") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a stable sort: within a rank, the collected (file) order, so every xdist worker, which
    # collects on its own, arrives at the same list
    items.sort(key=_rank)


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collection imported (torch, Lightning, transformers: some 600k objects) lives to
    # the end: moved to the permanent generation, no collection walks it again. Each test's
    # objects are collected as before. On an in-process subset (tests/run, tests/integrations
    # and three run files) a worker's CPU fell from 36.5 to 26.7 s; the whole suite's, in
    # which other processes do most of the work, by far less.
    gc.collect()
    gc.freeze()
