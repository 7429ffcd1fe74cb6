"""The sentinels: element finiteness without false alarms, and no host read per tensor."""

import torch

from nanaudit.run.checks import StepChecks, finite_norm
from helpers import LINEAR_CASE, scan


def test_norm_is_nonfinite_exactly_when_an_element_is():
    good = [torch.ones(3, 3), torch.full((5,), 2.0, dtype=torch.bfloat16)]
    assert torch.isfinite(finite_norm(good, "cpu"))
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        bad = good + [torch.tensor([1.0, bad_value])]
        assert not torch.isfinite(finite_norm(bad, "cpu"))


def test_huge_finite_gradients_are_not_a_finding(case, tmp_path):
    # Gradients of 1e20 overflow a float32 sum of squares while every element is finite.
    code = LINEAR_CASE + ("\ndef huge_loss(model, batch):\n"
                          "    return (model(batch[0]) * 1e20).sum()\n")
    result = scan(case(code, loss="case:huge_loss"), tmp_path=tmp_path)
    assert result.code == 0, result.report["finding"]
    assert 1e19 < result.report["timeline"][0]["grad_norm"] < 1e22


def test_scan_step_reads_the_device_once(host_reads, case, tmp_path):
    result = scan(case(LINEAR_CASE, optimizer={"class": "torch.optim.SGD", "lr": 0.01}),
                  tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 4
    # One read per step, plus the final parameter check (a __float__, not counted here).
    assert host_reads == {"tolist": 4, "item": 0}


def test_sentinels_keep_no_copies():
    model = torch.nn.Linear(4, 4)
    sentinels = StepChecks(model, "cpu")
    assert all(a is b for a, b in zip(sentinels.params, model.parameters()))
