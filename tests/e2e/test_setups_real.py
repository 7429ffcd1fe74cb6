"""Training setups as users really write them: a `step:` with torch.autograd.grad, a
GradScaler, an LBFGS closure, n_critic discriminator steps, a dict of logits and floats, a
metric computed after the update; accumulation and schedulers in the config; `bisect` over a
user's step. Each case pins what a PyTorch user would expect the scan to say."""

import json

import pytest
import torch
from helpers import run_cli, scan

# A small regression model and data whose batch 3 has x[1, 0] = -5: `log(x0 + 3)` in the loss
# is NaN for that row while every gradient stays finite (the log's input needs no gradient).
USER = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def batches(n=6, bad=3):
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        if i == bad:
            x[1, 0] = -5.0
        yield x, y


def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean() + 0.01 * torch.log(x[:, 0] + 3).mean()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def grad_step(model, batch, optimizer):
    optimizer.zero_grad()
    value = loss(model, batch)
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(value, params)):
        p.grad = g
    optimizer.step()
    return value


def grad_of_parameters_step(model, batch, optimizer):
    optimizer.zero_grad()
    value = loss(model, batch)
    for p, g in zip(model.parameters(), torch.autograd.grad(value, model.parameters())):
        p.grad = g
    optimizer.step()
    return value


def two_halves(model):
    return [torch.optim.SGD(model[0].parameters(), lr=0.1),
            torch.optim.SGD(model[2].parameters(), lr=0.1)]


def careless_step(model, batch, optimizer):
    x, y = batch
    # Here the log's NaN reaches every gradient too.
    value = ((model(x) - y) ** 2).mean() + (model(x).squeeze(1) * torch.log(x[:, 0] + 3)).mean()
    for opt in optimizer:
        opt.zero_grad()
    value.backward()
    for opt in optimizer:
        try:
            opt.step()
        except:  # noqa: E722 - a bare except, as careless code has
            pass
    return value


SCALER = {}


def scaler_step(model, batch, optimizer):
    scaler = SCALER.setdefault("s", torch.amp.GradScaler("cpu", init_scale=256.0))
    optimizer.zero_grad()
    value = loss(model, batch)
    scaler.scale(value).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    return value


def plain_step(model, batch, optimizer):
    optimizer.zero_grad()
    value = loss(model, batch)
    value.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return value


def lbfgs(model):
    return torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)


def lbfgs_step(model, batch, optimizer):
    def closure():
        optimizer.zero_grad()
        value = loss(model, batch)
        value.backward()
        return value
    return optimizer.step(closure)


def logits_step(model, batch, optimizer):
    x, y = batch
    optimizer.zero_grad()
    out = model(x)
    value = ((out - y) ** 2).mean()
    value.backward()
    optimizer.step()
    return {"loss": value, "logits": out, "count": torch.tensor(len(x)), "lr": 0.1}


def metric_step(model, batch, optimizer):
    x, y = batch
    optimizer.zero_grad()
    value = ((model(x) - y) ** 2).mean()
    value.backward()
    optimizer.step()
    with torch.no_grad():
        err = (model(x) - y).abs().squeeze(1)
        big = err[x[:, 0] > 100].mean()        # an empty selection: mean of nothing is NaN
    return {"loss": value, "big_error": big}


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
        self.d = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))


def build_gan():
    return GAN()


def gan_optimizers(model):
    return {"d": torch.optim.Adam(model.d.parameters(), lr=1e-3, betas=(0.0, 0.9)),
            "g": torch.optim.Adam(model.g.parameters(), lr=1e-3, betas=(0.0, 0.9))}


def real(n=5, bad=None, row=3, value=-1.0):
    g = torch.Generator().manual_seed(1)
    for i in range(n):
        batch = torch.rand(8, 2, generator=g) + 0.1
        if i == bad:
            batch[row, 0] = value
        yield batch


def wgan_step(model, real, optimizer, n_critic=5):
    # Critic iteration k reads row k's first feature through a log: a bad row k trips the
    # k-th update of `d`, after k updates of `d` in the same call.
    for k in range(n_critic):
        fake = model.g(torch.randn(real.shape[0], 2)).detach()
        d_loss = model.d(fake).mean() - model.d(real).mean() + 0.01 * torch.log(real[k, 0])
        optimizer["d"].zero_grad()
        d_loss.backward()
        optimizer["d"].step()
    g_loss = -model.d(model.g(torch.randn(real.shape[0], 2))).mean()
    optimizer["g"].zero_grad()
    g_loss.backward()
    optimizer["g"].step()
    return {"d_loss": d_loss, "g_loss": g_loss}


def every_third_g(model, real, optimizer, counter="buffer", _calls=[0]):
    # D every call, G every third call (the usual WGAN schedule), counted in a buffer of the
    # model (restored by a replay) or in the function's own state (not restored).
    if counter == "buffer":
        model.calls += 1
        due = int(model.calls) % 3 == 0
    else:
        _calls[0] += 1
        due = _calls[0] % 3 == 0
    z = torch.randn(real.shape[0], 2)
    d_loss = model.d(model.g(z).detach()).mean() - model.d(real).mean()
    optimizer["d"].zero_grad()
    d_loss.backward()
    optimizer["d"].step()
    out = {"d_loss": d_loss}
    if due:
        g_loss = -model.d(model.g(z)).mean() + 0.01 * torch.log(real[:, 0] + 0.5).mean()
        optimizer["g"].zero_grad()
        g_loss.backward()
        optimizer["g"].step()
        out["g_loss"] = g_loss
    return out
"""


def _step_config(case, step, **extra):
    extra.setdefault("optimizer", "case:sgd")
    return case(USER, loss=None, step=f"case:{step}", seed=0, **extra)


def _bad(n=6, bad=3):
    return {"entrypoint": "case:batches", "args": {"n": n, "bad": bad}}


def _clean(n=6):
    return {"entrypoint": "case:batches", "args": {"n": n, "bad": -1}}


@pytest.mark.parametrize("step, optimizer", [
    ("grad_step", "case:sgd"),          # torch.autograd.grad, no backward()
    ("scaler_step", "case:sgd"),        # scaler.scale(loss).backward(); scaler.step(opt)
    ("lbfgs_step", "case:lbfgs"),       # optimizer.step(closure)
])
def test_a_nan_loss_with_finite_gradients_is_found_before_the_update(case, tmp_path, step,
                                                                     optimizer):
    """Before the fix each of these ran clean (exit 0) or raised (the scaler, exit 4): the
    loss was never seen, or the scaler was left mid-step for the replay."""
    path = _step_config(case, step, optimizer=optimizer, data=_bad())
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert (f["step"], f["batch_index"], f["where"], f["op"], f["cause"]) == (
        3, 3, "forward", "aten.log.default", "log-domain")
    assert (f["optimizer"], f["loss_name"], f["samples"], f["reproduced"]) == (
        "optimizer", "loss", [1], True)
    assert result.report["steps_run"] == 4


def test_autograd_grad_of_a_parameter_generator(case, tmp_path):
    """`torch.autograd.grad(loss, model.parameters())`: the generator is read once, by torch."""
    result = scan(_step_config(case, "grad_of_parameters_step", data=_bad()), tmp_path=tmp_path)
    assert result.code == 1, result.report
    assert (result.finding["step"], result.finding["op"]) == (3, "aten.log.default")


def test_a_bare_except_around_optimizer_step_cannot_let_later_updates_through(case):
    """The check raises out of the first optimizer's step; a bare `except:` swallows it. The
    second optimizer's step must stop too, without a check of its own: the trip stays the
    first one (before the fix the second check ran and its NaN gradients replaced the loss
    trip of `optimizer[0]` by a gradient trip of `optimizer[1]`), and the weights are as they
    were before the call."""
    from pathlib import Path

    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.config.parse import load_config
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import build_session
    path = _step_config(case, "careless_step", optimizer="case:two_halves", data=_bad())
    weights = []
    for steps in (3, None):
        config = load_config(Path(path))
        with user_import_path(config.base_dir):
            session = build_session(config)
            outcome = run_steps(session, steps)
        weights.append([p.detach().clone() for p in session.model.parameters()])
    trip = outcome.trip
    assert (trip.step, trip.check, trip.optimizer) == (3, "loss", "optimizer[0]")
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_a_grad_scaler_in_the_step_shows_the_unscaled_loss(case, tmp_path):
    plain = scan(_step_config(case, "plain_step", data=_clean()), tmp_path=tmp_path)
    scaled = scan(_step_config(case, "scaler_step", data=_clean()), tmp_path=tmp_path)
    assert plain.code == scaled.code == 0
    losses = [[e["loss"] for e in r.report["timeline"]] for r in (plain, scaled)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-4), "the loss, not loss * 256"


def test_torch_autograd_grad_losses_reach_the_timeline(case, tmp_path):
    result = scan(_step_config(case, "grad_step", data=_clean()), tmp_path=tmp_path)
    assert result.code == 0
    assert all(isinstance(e["loss"], float) for e in result.report["timeline"])


def test_lbfgs_clean_run_is_clean(case, tmp_path):
    result = scan(_step_config(case, "lbfgs_step", optimizer="case:lbfgs", data=_clean()),
                  tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 6


def test_a_returned_dict_of_logits_counts_and_floats_is_not_a_config_error(case, tmp_path):
    """Only floating scalars are losses: `{"loss", "logits", "count", "lr"}` scans clean (it
    was exit 3, 'the loss must be a floating-point scalar tensor')."""
    result = scan(_step_config(case, "logits_step", data=_clean()), tmp_path=tmp_path)
    assert result.code == 0, result.report
    assert len(result.report["timeline"]) == 6


def test_a_metric_computed_after_the_update_is_replayed_whole(case, tmp_path):
    """A returned value no pre-update check saw trips after the call; the replay runs the whole
    call (it used to stop at the first update and claim a transient fault)."""
    result = scan(_step_config(case, "metric_step", data=_clean()), tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["loss_name"], f["op"], f["reproduced"], f["cause"]) == (
        0, "big_error", "aten.mean.default", True, "degenerate-reduction")


def test_n_critic_steps_trip_at_the_fourth_update_and_bundle_the_pre_call_state(
        case, tmp_path):
    """Five `d` updates per call: row 3 trips the fourth. The finding names `d` and `d_loss`
    (learnt from the returned dict although only the last d_loss is returned), and the bundle
    holds both networks as they were before the call: every earlier update of the call put
    back (before the fix, `d` after two of its updates)."""
    path = case(USER, loss=None, model="case:build_gan", step="case:wgan_step",
                optimizer="case:gan_optimizers", seed=0,
                data={"entrypoint": "case:real", "args": {"bad": 2}})
    result = scan(path, "--repro", tmp_path / "bundle", tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert (f["step"], f["optimizer"], f["loss_name"], f["op"], f["samples"]) == (
        2, "d", "d_loss", "aten.log.default", [3])
    import importlib.util
    spec = importlib.util.spec_from_file_location("user_gan", tmp_path / "case.py")
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)
    torch.manual_seed(0)
    model = user.build_gan()
    optimizers = user.gan_optimizers(model)
    for batch in list(user.real(bad=2))[:2]:
        model.zero_grad(set_to_none=True)
        user.wgan_step(model, batch, optimizers)
    state = torch.load(tmp_path / "bundle" / "state.pt", weights_only=True)
    for name, value in model.state_dict().items():
        assert torch.allclose(value, state["model"][name]), name
    assert state["optimizers"]["d"]["state"][0]["step"] == 10
    again = run_cli("replay", tmp_path / "bundle", "--json", tmp_path / "again.json")
    assert again.code == 1
    replayed = json.loads((tmp_path / "again.json").read_text())["finding"]
    assert (replayed["optimizer"], replayed["samples"]) == ("d", [3])


@pytest.mark.parametrize("counter, reproduced", [("buffer", True), ("closure", False)])
def test_a_generator_stepped_every_third_call(case, tmp_path, counter, reproduced):
    """G's loss is named `g_loss` although the first call returned only `d_loss`. A counter in
    a buffer is restored for the replay; one in the function's own state is not, and the
    finding says that is the likelier reason the replay came out finite."""
    path = case(USER, loss=None, model="case:build_gan", optimizer="case:gan_optimizers",
                seed=0, step={"entrypoint": "case:every_third_g", "args": {"counter": counter}},
                data={"entrypoint": "case:real", "args": {"n": 6, "bad": 5}})
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert (f["step"], f["optimizer"], f["loss_name"], f["reproduced"]) == (
        5, "g", "g_loss", reproduced)
    if reproduced:
        assert (f["op"], f["samples"]) == ("aten.log.default", [3])
    else:
        assert "state your step function keeps outside the model" in f["explanation"]
        assert "buffer" in f["fix"]


def test_bisect_holds_the_weights_of_a_users_step(case, tmp_path):
    """bisect over data audits every batch against the starting weights: the user's step
    makes its updates, nanaudit puts each back after the call (they used to accumulate)."""
    from pathlib import Path

    from nanaudit.commands.bisect import bisect_data
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.config.parse import load_config
    from nanaudit.run.session import build_session
    config = load_config(Path(_step_config(case, "plain_step", data=_bad())))
    with user_import_path(config.base_dir):
        session = build_session(config)
        before = [p.detach().clone() for p in session.model.parameters()]
        result = bisect_data(session, None)
    assert all(torch.equal(a, b) for a, b in zip(before, session.model.parameters()))
    assert [s.batch for s in result["skip_list"]] == [3]
    assert result["findings"][0].samples == [1]


def test_bisect_skip_list_names_the_data_index_with_accumulation(case, tmp_path):
    path = case(USER, optimizer="case:sgd", accumulate=2, seed=0, data=_bad(n=8, bad=5))
    result = run_cli("bisect", path, "--json", tmp_path / "b.json", "--quiet",
                     "--skip-list", tmp_path / "skip.json")
    report = json.loads((tmp_path / "b.json").read_text())
    assert result.code == 1
    finding = report["bisect"]["bad_batches"][0]
    assert (finding["step"], finding["batch_index"], finding["micro_batch"]) == (2, 5, 1)
    skip = json.loads((tmp_path / "skip.json").read_text())["skip"]
    assert [(s["batch"], s["rows"]) for s in skip] == [(5, [1])], "the data index, not step 2"


def test_accumulate_larger_than_the_data_says_so(case, tmp_path):
    result = scan(case(USER, optimizer="case:sgd", accumulate=16, data=_clean()),
                  tmp_path=tmp_path)
    assert result.code == 5
    message = result.report["error"]["message"]
    assert "fewer batches than one accumulation window" in message
    assert "accumulate: 16" in message


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_accumulation_under_autocast_finds_the_micro_batch(case, tmp_path, precision):
    path = case(USER, optimizer="case:sgd", accumulate=2, precision=precision, grad_clip=0.5,
                scheduler={"class": "torch.optim.lr_scheduler.StepLR", "step_size": 1,
                           "gamma": 0.5}, seed=0, data=_bad(n=8, bad=5))
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert (f["step"], f["batch_index"], f["micro_batch"], f["op"], f["samples"]) == (
        2, 5, 1, "aten.log.default", [1])
    timeline = result.report["timeline"]
    # One StepLR step per applied window (a step the fp16 GradScaler skips does not count).
    for before, after in zip(timeline, timeline[1:]):
        assert after["lr"] == before["lr"] * (1.0 if before["skipped"] else 0.5)
    assert len(timeline) == 3


def test_a_plateau_scheduler_is_not_stepped_without_a_loss():
    """A user's step that differentiated no scalar loss gives no value to plateau on."""
    from nanaudit.run.units import step_schedulers
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    step_schedulers({"scheduler": plateau}, None)
    step_schedulers({"scheduler": plateau}, 1.0)
    assert plateau.best == 1.0
