"""commands/bad_steps.py under torchrun: every rank's log takes the traced finding of each bad
input, whichever rank traced it and in whatever order the ranks' findings are gathered (under
FSDP2 a peer may trace the same step and name nothing: its copy must not replace the named
one)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from nanaudit.commands.bad_steps import BadStepRecorder
from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.model import Finding, InputProducer
from nanaudit.report.vocabulary import BadStepAction, Cause, ProducerKind, Where
from nanaudit.run.step import ScanOutcome

UNTRACED = Finding(step=4, where=Where.INPUT, value="nan", cause=Cause.UNKNOWN,
                   explanation="the batch held NaN", fix="inspect the data code")
NAMED = replace(UNTRACED, op="aten.div.Tensor", cause=Cause.DIV_BY_ZERO,
                producer=InputProducer(ProducerKind.TORCH_OP, "the data code"))
NOT_NAMED = replace(UNTRACED, producer=InputProducer(
    ProducerKind.NOT_LOCALIZED, "the data code", note="read again, the batch differed"))


def _shared(monkeypatch, gathered: list[dict[int, Finding]]) -> Finding:
    """The finding of step 4 in this rank's log once the ranks' traced findings are shared."""
    log = BadStepLog(max_bad_steps=10)
    coord = SimpleNamespace(rank=0, sharded=True, options=SimpleNamespace(timeout_s=5.0))
    recorder = BadStepRecorder(ScanOutcome(bad_steps=log), lambda outcome: None, coord)
    log.record(replace(UNTRACED), BadStepAction.SKIPPED)
    recorder.inputs[7] = ([], log.whole[0])    # noted here, never traced (as when interrupted)
    sent = []

    def gather(coord, key, payload, timeout_s=0.0):
        sent.append(payload)
        return gathered
    monkeypatch.setattr("nanaudit.run.rank_checks.gather_by_store", gather)
    recorder._share_traced()
    assert sent == [{}]         # this rank traced nothing: it sends no untraced copy
    return log.whole[0]


@pytest.mark.parametrize("peer", [UNTRACED, NOT_NAMED])
@pytest.mark.parametrize("named_first", [True, False])
def test_a_peer_copy_of_the_same_step_never_replaces_the_named_trace(monkeypatch, peer,
                                                                      named_first):
    gathered = [{4: NAMED}, {4: peer}] if named_first else [{4: peer}, {4: NAMED}]
    finding = _shared(monkeypatch, gathered)
    assert finding.producer.made_by == ProducerKind.TORCH_OP and finding.op == "aten.div.Tensor"


def test_a_trace_that_named_nothing_is_still_shared_with_its_reason(monkeypatch):
    finding = _shared(monkeypatch, [{}, {4: NOT_NAMED}])
    assert finding.producer.made_by == ProducerKind.NOT_LOCALIZED
    assert finding.producer.note == "read again, the batch differed"
