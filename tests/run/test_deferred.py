"""The deferred read on CPU tensors: the device-side skip, the kept buffers, and scans that find
the same thing with the same pre-step state as the synchronous read."""

import textwrap

import pytest
import torch
from helpers import scan

from nanaudit.config.entrypoints import user_import_path
from nanaudit.config.parse import load_config
from nanaudit.run.deferred import BufferKeeper, DeviceSkip, choose_read
from nanaudit.run.loop import run_steps
from nanaudit.run.session import build_session

BN_CASE = textwrap.dedent("""
    import torch
    from torch import nn

    BAD_STEP = {bad_step}
    ZERO_STEP = {zero_step}

    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 1))

    def batches():
        g = torch.Generator().manual_seed(0)
        for step in range(6):
            x = torch.randn(8, 3, generator=g) * {scale}
            if step == BAD_STEP:
                x[5, 0] = float("nan")
            if step == ZERO_STEP:
                x[2] = 0.0
            yield x, torch.randn(8, 1, generator=g)

    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    def huge_loss(model, batch):
        return (model(batch[0]) * 1e20).sum()
""")

FUSED_ADAM = {"class": "torch.optim.Adam", "lr": 0.01, "fused": True}


def _run(path, read, steps=None):
    config = load_config(path, overrides={"sentinel_read": read} if read else None)
    with user_import_path(config.base_dir):
        session = build_session(config)
        outcome = run_steps(session, steps)
    return session, outcome


def _write(case, bad_step=-1, scale=1.0, **config):
    code = BN_CASE.format(bad_step=bad_step, scale=scale, zero_step=-1)
    return case(code, **{"optimizer": FUSED_ADAM, "seed": 0, **config})


def _state(session):
    model = {k: v.clone() for k, v in session.model.state_dict().items()}
    opt = session.optimizer.state_dict()["state"]
    return model, {k: {n: t.clone() for n, t in s.items()} for k, s in opt.items()}


def _same(a, b):
    (ma, oa), (mb, ob) = a, b
    # A skipped first step leaves the optimizer's lazily made state as a fresh one would be
    # (step 0, zero moments): what the sync read has not made yet.
    for k in set(ob) - set(oa):
        assert all(not torch.as_tensor(t).any() for t in ob[k].values()), ob[k]
        del ob[k]
    assert ma.keys() == mb.keys() and oa.keys() == ob.keys()
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k], rtol=0, atol=0, equal_nan=True, msg=k)
    for k in oa:
        for n in oa[k]:
            torch.testing.assert_close(oa[k][n], ob[k][n], rtol=0, atol=0, msg=f"{k} {n}")


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)])
def test_fused_optimizer_skips_its_update_on_the_device(make):
    weights = torch.nn.Parameter(torch.ones(4))
    optimizer = make([weights])
    skip = DeviceSkip("cpu")
    for _ in range(2):                          # state exists: momentum, Adam's moments, step
        weights.grad = torch.full((4,), 0.5)
        skip.step(optimizer, optimizer.step)
    before = weights.detach().clone(), optimizer.state_dict()
    weights.grad = torch.full((4,), float("nan"))
    skip.note(torch.tensor([1.0, float("nan")], dtype=torch.float64))
    skip.step(optimizer, optimizer.step)
    weights.grad = torch.full((4,), 0.5)         # sticky: a finite step after it is skipped too
    skip.step(optimizer, optimizer.step)
    assert torch.equal(weights.detach(), before[0])
    after = optimizer.state_dict()["state"][0]
    for name, value in before[1]["state"][0].items():
        assert torch.equal(torch.as_tensor(after[name]), torch.as_tensor(value)), name
    assert not hasattr(optimizer, "found_inf")
    skip.clear()
    skip.step(optimizer, optimizer.step)
    assert not torch.equal(weights.detach(), before[0])


def test_flag_rises_only_on_a_nonfinite_value():
    skip = DeviceSkip("cpu")
    skip.note(torch.tensor([1.0, 3.0e300, 2.0], dtype=torch.float64))
    assert float(skip.halt) == 0.0
    skip.note(torch.tensor([1.0, float("-inf")], dtype=torch.float64))
    skip.note(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert float(skip.halt) == 1.0


def test_buffer_keeper_puts_batchnorm_back_two_steps_later():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model.register_buffer("table", torch.arange(5.0))
    keeper = BufferKeeper(model)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    saved = keeper.save()                                  # before step 0
    model(torch.randn(8, 3))
    after_0 = {k: v.clone() for k, v in model.state_dict().items()}
    keeper.save()                                          # before step 1
    model(torch.randn(8, 3))
    keeper.restore(saved)
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k
    assert int(model[1].num_batches_tracked) == 0          # the integer buffer too
    assert not torch.equal(after_0["1.running_mean"], start["1.running_mean"])


def test_read_mode_choice():
    fused = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, fused=True)
    foreach = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_read("auto", cuda, fused, None, False).mode == "deferred"
    assert choose_read("auto", cpu, fused, None, False).mode == "sync"
    assert choose_read("deferred", cpu, fused, None, False).mode == "deferred"
    assert choose_read("sync", cuda, fused, None, False).mode == "sync"
    for args, why in [((cuda, foreach, None, False), "fused=True"),
                      ((cuda, fused, object(), False), "GradScaler"),
                      ((cuda, fused, None, True), "torchrun"),
                      ((cuda, None, None, False), "no optimizer")]:
        mode = choose_read("deferred", *args)
        assert mode.mode == "sync" and why in mode.reason


def test_clean_run_reads_the_same_values_once_per_step(host_reads, case):
    path = _write(case, watch={"activations": 1}, grad_clip=0.5)
    sync_session, sync = _run(path, "sync")
    calls_sync = dict(host_reads)
    session, deferred = _run(path, "deferred")
    assert deferred.read_mode.mode == "deferred" and sync.read_mode.mode == "sync"
    assert deferred.trip is None and deferred.steps_run == sync.steps_run == 6
    for a, b in zip(sync.timeline, deferred.timeline):
        assert (a.step, a.loss, a.grad_norm, a.param_norm, a.update_ratio, a.act_max) == (
            b.step, b.loss, b.grad_norm, b.param_norm, b.update_ratio, b.act_max)
    assert sync.timeline[0].update_ratio is not None and sync.timeline[5].act_max > 0
    _same(_state(sync_session), _state(session))
    # One host read per step in both modes, plus the final check of the last update.
    assert calls_sync["tolist"] == 6 and host_reads["tolist"] == 12
    assert sync.host_syncs == deferred.host_syncs == 7


@pytest.mark.parametrize("bad_step", [0, 3, 5])
def test_trip_leaves_the_same_pre_step_state_as_the_sync_read(case, bad_step):
    path = _write(case, bad_step=bad_step)
    sync_session, sync = _run(path, "sync")
    session, deferred = _run(path, "deferred")
    for outcome in (sync, deferred):
        assert (outcome.trip.step, outcome.trip.check) == (bad_step, "input")
        assert outcome.state.step == bad_step and outcome.steps_run == bad_step + 1
    assert [repr(e.loss) for e in sync.timeline] == [repr(e.loss) for e in deferred.timeline]
    # Parameters, BatchNorm statistics and Adam's state as the sync read leaves them; the RNG
    # state and the batch are the bad step's.
    _same(_state(sync_session), _state(session))
    assert torch.equal(sync.state.rng.torch_cpu, deferred.state.rng.torch_cpu)
    torch.testing.assert_close(sync.state.batch[0], deferred.state.batch[0], equal_nan=True)
    assert deferred.read_mode.mode == "deferred" and deferred.read_mode.sync_from == bad_step


def test_bad_update_is_blamed_on_the_step_that_made_it(case):
    path = _write(case, optimizer={"class": "torch.optim.SGD", "lr": 1e39, "fused": True})
    _, sync = _run(path, "sync")
    _, deferred = _run(path, "deferred")
    assert (sync.trip.step, sync.trip.check) == (deferred.trip.step, deferred.trip.check) == (
        0, "optimizer")


def test_false_alarm_applies_the_update_and_reads_synchronously_after(case):
    # Gradients of 1e20 overflow the float32 norm while every element is finite: the device
    # skipped the update, the host finds no non-finite element and applies it after all.
    path = _write(case, loss="case:huge_loss",
                  optimizer={"class": "torch.optim.SGD", "lr": 1e-30, "fused": True})
    sync_session, sync = _run(path, "sync")
    session, deferred = _run(path, "deferred")
    assert sync.trip is None and deferred.trip is None and deferred.steps_run == 6
    assert 1e19 < deferred.timeline[0].grad_norm < 1e22
    assert [e.grad_norm for e in sync.timeline] == [e.grad_norm for e in deferred.timeline]
    _same(_state(sync_session), _state(session))
    assert deferred.read_mode.sync_from == 0


def test_backward_finding_and_report_name_the_mode(case, tmp_path):
    code = BN_CASE.format(bad_step=-1, scale=1.0, zero_step=3) + textwrap.dedent("""
        def sqrt_loss(model, batch):
            x, y = batch
            h = x * model[0].weight[0]
            return ((h * h).sum(dim=1).sqrt() - y[:, 0]).pow(2).mean()
    """)
    path = case(code, loss="case:sqrt_loss", optimizer=FUSED_ADAM, seed=0,
                sentinel_read="deferred")
    deferred = scan(path, tmp_path=tmp_path)
    body = path.read_text().replace("sentinel_read: deferred", "sentinel_read: sync")
    path.write_text(body)
    sync = scan(path, tmp_path=tmp_path)
    assert deferred.code == sync.code == 1
    keys = ("step", "where", "forward_op", "cause", "samples")
    assert [deferred.finding[k] for k in keys] == [sync.finding[k] for k in keys]
    assert deferred.finding["forward_op"] == "aten.sqrt.default"
    read = deferred.report["sentinel_read"]
    assert (read["mode"], read["sync_from_step"]) == ("deferred", 3)   # switched at the trip
    assert sync.report["sentinel_read"] == {"mode": "sync", "reason": "sentinel_read: sync"}


def test_an_optimizer_that_cannot_skip_keeps_the_sync_read(case, tmp_path):
    path = _write(case, optimizer={"class": "torch.optim.SGD", "lr": 0.01},
                  sentinel_read="deferred")
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["sentinel_read"]["mode"] == "sync"
    assert "cannot skip its update on the device" in result.report["sentinel_read"]["reason"]


def test_sentinel_read_is_validated(case, tmp_path):
    result = scan(_write(case, sentinel_read="later"), tmp_path=tmp_path)
    assert result.code == 3
    assert "sentinel_read" in result.report["error"]["message"]


@pytest.mark.slow
def test_demo_with_a_fused_optimizer_localizes_the_same_under_the_deferred_read(tmp_path):
    import yaml
    from helpers import ROOT
    body = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    body.update(optimizer={"class": "torch.optim.AdamW", "lr": 1e-3, "fused": True},
                sentinel_read="deferred")
    config = tmp_path / "demo_fused.yaml"
    config.write_text(yaml.safe_dump(body))
    result = scan(config, tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        6, "backward", "aten.sqrt.default", "sqrt-domain", [5])
    assert result.report["sentinel_read"] == {
        "mode": "deferred", "sync_from_step": 6,
        "reason": "AdamW skips a bad update on the device until the host reads the step one "
                  "step later"}
    assert len(result.report["timeline"]) == 7
