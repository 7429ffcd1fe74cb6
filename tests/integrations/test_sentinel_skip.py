"""Sentinel(on_finding="skip"): three bad steps of different kinds are skipped and leave no
trace: the final weights and buffers equal those of the same loop that leaves those steps'
updates out and puts the buffers back, and each bad step is a finding of its own."""

from __future__ import annotations

import pytest
import torch

from nanaudit.integrations.sentinel import NonFiniteError, Sentinel
from nanaudit.report.vocabulary import BadStepAction, StopReason, Where

BAD = {2: "forward", 4: "backward", 6: "loss"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 1, generator=gen)
    gate, scale = torch.ones(()), torch.ones(())
    kind = BAD.get(step)
    if kind == "forward":
        x[3, 1] = float("nan")
    elif kind == "backward":
        gate = torch.zeros(())       # sqrt(0): finite forward, non-finite gradient
    elif kind == "loss":
        scale = torch.zeros(())      # log(0) in the loss code
    return x, y, gate, scale


def compute_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y, gate, scale = batch
    out = model(x)
    return ((out - y) ** 2).mean() + torch.sqrt(gate * out.pow(2).mean()) - torch.log(scale)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(7)
    for step in range(steps):
        saved = [b.clone() for b in model.buffers()]
        loss = compute_loss(model, _batch(step))
        loss.backward()
        if step in BAD:
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
        else:
            opt.step()
        opt.zero_grad()
    return _state(model)


def test_skipped_steps_leave_no_trace():
    steps = 9
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sentinel = Sentinel(model, opt, loss_fn=compute_loss, on_finding="skip")
    torch.manual_seed(7)
    applied = []
    for step in range(steps):
        batch = _batch(step)
        loss = compute_loss(model, batch)
        loss.backward()
        if sentinel.check(step, batch, loss):
            opt.step()
            applied.append(step)
        opt.zero_grad()
    assert applied == [s for s in range(steps) if s not in BAD]
    expected = _reference(steps)
    got = _state(model)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    report = sentinel.report
    assert report is not None and report.bad_steps is not None
    assert [f.step for f in report.findings] == sorted(BAD)
    assert all(f.action == BadStepAction.SKIPPED for f in report.findings)
    assert [f.where for f in report.findings] == [Where.INPUT, Where.BACKWARD, Where.FORWARD]
    assert [f.cause.value for f in report.findings] == ["nonfinite-input", "sqrt-domain",
                                                        "log-domain"]
    assert report.findings[0].samples == [3]
    assert report.findings[2].op == "aten.log.default"
    assert report.bad_steps.skipped == 3 and report.bad_steps.stopped is None


def test_max_bad_steps_stops_and_is_a_finding():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = Sentinel(model, opt, loss_fn=compute_loss, on_finding="skip", max_bad_steps=2)
    with pytest.raises(NonFiniteError) as raised:
        for step in range(5):
            batch = _batch(6)                     # the same bad shard every step
            loss = compute_loss(model, batch)
            loss.backward()
            if sentinel.check(step, batch, loss):
                opt.step()
            opt.zero_grad()
    report = raised.value.report
    assert [f.step for f in report.findings] == [0, 1, 2]
    assert report.findings[-1].action == BadStepAction.STOPPED
    assert report.findings[-1].stop_reason == StopReason.MAX_BAD_STEPS
    assert report.bad_steps is not None and report.bad_steps.persistent


def test_nonfinite_weight_stops_at_once():
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")      # as loaded from a bad checkpoint
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = Sentinel(model, opt, loss_fn=compute_loss, on_finding="skip")
    batch = _batch(0)
    loss = compute_loss(model, batch)
    loss.backward()
    with pytest.raises(NonFiniteError) as raised:
        sentinel.check(0, batch, loss)
    report = raised.value.report
    assert [f.step for f in report.findings] == [0]
    assert report.findings[0].stop_reason == StopReason.NONFINITE_STATE


def _accumulated(skip_with_sentinel: bool) -> tuple[dict[str, torch.Tensor], Sentinel | None]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sentinel = Sentinel(model, opt, loss_fn=compute_loss, on_finding="skip") \
        if skip_with_sentinel else None
    torch.manual_seed(3)
    for step in range(4):
        saved = [b.clone() for b in model.buffers()]
        for micro in range(2):
            # micro-batch 1 of step 1 is bad in its loss code; micro-batch 0 was fine
            batch = _batch(6 if (step, micro) == (1, 1) else 10 + 2 * step + micro)
            loss = compute_loss(model, batch) / 2
            loss.backward()
            if sentinel is not None:
                sentinel.micro_batch(batch, loss)
        if sentinel is not None:
            apply = sentinel.check_update(step)
        else:
            apply = step != 1
            if not apply:
                for b, s in zip(model.buffers(), saved):
                    b.copy_(s)
        if apply:
            opt.step()
        opt.zero_grad()
    return _state(model), sentinel


def test_one_bad_micro_batch_skips_its_whole_step():
    got, sentinel = _accumulated(True)
    expected, _ = _accumulated(False)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    assert sentinel is not None and sentinel.report is not None
    (finding,) = sentinel.report.findings
    assert (finding.step, finding.micro_batch) == (1, 1)
    assert finding.cause.value == "log-domain"
