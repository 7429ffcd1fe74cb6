"""The suite's running order under pytest-xdist: the long tests first.

Under `-n 3 --dist load --maxschedchunk 2` (CI, the README) the workers take the collected
tests in order, two at a time, so a 4-rank torchrun launch (15-100 s on a loaded 2-core
machine) collected last would run alone at the end while the other workers sit idle. Started
first, the long tests overlap each other and the short ones fill the gaps at the end. "Long"
is what the tests say of themselves: the `distributed` and `slow` marks. The hook lives here,
beside the launches that need it most; pytest calls it with the whole session's items."""

from __future__ import annotations

import pytest


def _rank(item: pytest.Item) -> int:
    """0 for a multi-process launch, 1 for another slow test, 2 for the rest."""
    if item.get_closest_marker("distributed") is not None:
        return 0
    return 1 if item.get_closest_marker("slow") is not None else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # a stable sort: within a rank, the collected (file) order, so every xdist worker, which
    # collects on its own, arrives at the same list
    items.sort(key=_rank)
