"""What the script auditor makes of an exception the script raised: a non-finite tensor in its
frames is an error trip (a library refusing a NaN), except in a collective a dead peer failed,
whose output buffers were never filled (torch.empty garbage may read as NaN): that is the peer's
death, exit 8 on every rank, never a finding (a 4-rank mesh test met it as exit 1 under load)."""

from __future__ import annotations

import pytest
import torch

from nanaudit.report.vocabulary import Check
from nanaudit.script.auditor import ScriptAuditor


def _raised(message: str) -> RuntimeError:
    buffer = torch.full((4,), float("nan"))     # what the frame holds when it raises  # noqa: F841
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


@pytest.mark.parametrize("message", [
    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:51914",
    "Timed out waiting 1800000ms for recv operation to complete",
])
def test_a_collective_a_dead_peer_failed_is_no_error_trip(message):
    assert ScriptAuditor(rank=None).after_error(_raised(message)) is None


def test_a_library_refusing_a_nan_in_its_frame_is_an_error_trip():
    trip = ScriptAuditor(rank=None).after_error(
        _raised("probability tensor contains either `inf`, `nan` or element < 0"))
    assert trip is not None and (trip.check, trip.step) == (Check.ERROR, 0)
