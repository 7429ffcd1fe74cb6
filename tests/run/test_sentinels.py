"""The sentinels: element finiteness without false alarms, and no host read per tensor."""

import math

import torch
from helpers import LINEAR_CASE, scan

from nanaudit.run.checks import StepChecks, all_finite, finite_norm, peak


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


def _model():
    # Small tensors (packed on the CPU) next to one above PACK_BELOW (reduced alone).
    return torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 3), torch.nn.LayerNorm(3))


def _readout(model, batch):
    sentinels = StepChecks(model, "cpu")
    sentinels.zero_grad()
    model(batch).square().sum().backward()
    loss = torch.tensor(1.0)
    readout = sentinels.step_readout(loss, [batch])
    return readout, readout.read(readout.values.tolist())


def test_packed_readout_gives_the_norms_of_every_tensor():
    model, batch = _model(), torch.randn(4, 80)
    readout, (batch_norm, state_norm, _, grad_norm) = _readout(model, batch)
    params = list(model.parameters())
    # Fewer reductions than tensors, the same norms as one per tensor.
    assert readout.n_state < len(params) and readout.n_grads < len(params)
    assert abs(state_norm - float(finite_norm(params, "cpu"))) < 1e-4 * state_norm
    assert abs(grad_norm - float(finite_norm([p.grad for p in params], "cpu"))) < 1e-4 * grad_norm
    assert abs(batch_norm - float(batch.norm())) < 1e-4 * batch_norm


def test_packed_readout_sees_one_bad_element_in_a_small_tensor():
    model, batch = _model(), torch.randn(4, 80)
    with torch.no_grad():
        model[3].bias[1] = float("nan")      # 3 elements: packed with the other small ones
    assert math.isnan(_readout(model, batch)[1][1])
    model = _model()
    _readout(model, batch)
    model[2].bias.grad[0] = float("inf")
    readout = StepChecks(model, "cpu").step_readout(torch.tensor(1.0), [])
    assert math.isinf(readout.read(readout.values.tolist())[3])


def test_missing_gradients_are_reduced_one_by_one():
    model, batch = _model(), torch.randn(4, 80)
    model[3].weight.requires_grad_(False)       # no gradient: places no longer line up
    readout, (_, _, _, grad_norm) = _readout(model, batch)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert readout.n_grads == len(grads)
    assert abs(grad_norm - float(finite_norm(grads, "cpu"))) < 1e-4 * grad_norm


def test_update_watch_measures_the_update_of_packed_parameters():
    from nanaudit.run.watch import UpdateWatch
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    watch = UpdateWatch(list(model.parameters()), 1, "cpu")

    def update():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=1e-3)
    watch.measure(0, update, lambda: 1.0)
    step, norm, base = watch.take()
    expected = finite_norm([a - p.detach() for a, p in zip(before, model.parameters())], "cpu")
    assert (step, base) == (0, 1.0)
    assert abs(float(norm) - float(expected)) < 1e-4 * float(expected)


def test_a_peak_is_finite_exactly_when_every_element_is():
    big = torch.full((3, 4), 3e38)                 # its sum of squares overflows; its peak does not
    assert float(peak(big)) == float(peak(-big)) == float(big[0, 0])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for bad in (math.nan, math.inf, -math.inf):
            t = torch.ones(5, dtype=dtype)
            t[3] = bad
            assert not math.isfinite(float(peak(t))), (dtype, bad)
            assert float(all_finite([torch.ones(2), t], "cpu")) == 0.0
    assert not peak(torch.ones(2, requires_grad=True) * 2).requires_grad
    assert float(all_finite([big, torch.zeros(0)], "cpu")) == 1.0
    assert float(all_finite([], "cpu")) == 1.0
