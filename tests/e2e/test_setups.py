"""The training steps people really run: schedulers, accumulation windows, several optimizers
and the user's own step, each scanned end to end (examples in configs/examples) and by small
cases that pin one rule each."""

import json

import pytest
import torch
from helpers import LINEAR_CASE, ROOT, run_cli, scan

EXAMPLES = ROOT / "configs" / "examples"

SETUPS = {
    "accumulate_poisoned": dict(step=1, batch_index=6, micro_batch=2, where="forward",
                                op="aten.log1p.default", module="accumulate_poisoned.py:loss",
                                samples=[3], cause="log-domain"),
    "gan_log_zero": dict(step=4, batch_index=4, where="forward", op="aten.log.default",
                         module="gan_log_zero.py:train_step", samples=[11], cause="log-domain",
                         optimizer="d", loss_name="d_loss"),
    "onecycle_divergence": dict(step=6, where="forward", cause="divergence", samples=None),
    "lr_negative": dict(step=21, batch_index=21, where="optimizer", value="negative",
                        cause="optimizer-update", tensors=["weight", "bias"]),
}
SETUPS_CLEAN = {"ema_clean"}


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_setup_example_is_localized(name, tmp_path):
    result = scan(EXAMPLES / f"{name}.yaml", tmp_path=tmp_path)
    assert result.code == 1, result.report
    finding = result.finding
    for key, value in SETUPS[name].items():
        assert finding[key] == value, (key, finding)
    if finding["where"] == "forward":
        assert finding["reproduced"] is True
        assert finding["source"]["file"].endswith(f"{name}.py")


@pytest.mark.parametrize("name", sorted(SETUPS_CLEAN))
def test_setup_example_is_clean(name, tmp_path):
    result = scan(EXAMPLES / f"{name}.yaml", tmp_path=tmp_path)
    assert result.code == 0 and result.report["status"] == "clean"
    timeline = result.report["timeline"]
    assert len(timeline) == 24
    lrs = [e["lr"] for e in timeline]
    assert lrs[0] == pytest.approx(3e-3) and lrs == sorted(lrs, reverse=True), \
        "the timeline's lr is the scheduler's, as the update used it"


def test_scheduler_lr_in_timeline_and_named_in_finding(tmp_path):
    result = scan(EXAMPLES / "lr_negative.yaml", tmp_path=tmp_path)
    f = result.finding
    assert "scheduler `scheduler` (LambdaLR" in f["explanation"]
    assert "lr=-0.0025" in f["explanation"] and "not applied" in f["explanation"]
    lrs = [e["lr"] for e in result.report["timeline"]]
    assert lrs[0] == pytest.approx(0.05) and lrs[20] == pytest.approx(0.0)
    assert result.report["config"]["scheduler"] == {"entrypoint": "lr_negative.py:linear_decay"}


def test_onecycle_divergence_shows_the_rising_lr(tmp_path):
    result = scan(EXAMPLES / "onecycle_divergence.yaml", tmp_path=tmp_path)
    lrs = [e["lr"] for e in result.report["timeline"]]
    assert lrs == sorted(lrs) and lrs[-1] > 5 * lrs[0]


def test_accumulation_bundle_replays_the_micro_batch(tmp_path):
    result = scan(EXAMPLES / "accumulate_poisoned.yaml", "--repro", tmp_path / "bundle",
                  tmp_path=tmp_path)
    assert result.code == 1
    meta = json.loads((tmp_path / "bundle" / "meta.json").read_text())
    assert (meta["batch_index"], meta["micro_batch"], meta["window"]) == (6, 2, 4)
    replayed = run_cli("replay", tmp_path / "bundle", "--json", tmp_path / "again.json")
    assert replayed.code == 1
    again = json.loads((tmp_path / "again.json").read_text())["finding"]
    assert (again["op"], again["samples"], again["cause"]) == (
        "aten.log1p.default", [3], "log-domain")


def test_gan_bundle_holds_the_pre_step_state_of_both_optimizers(tmp_path):
    result = scan(EXAMPLES / "gan_log_zero.yaml", "--repro", tmp_path / "bundle",
                  tmp_path=tmp_path)
    assert result.code == 1
    state = torch.load(tmp_path / "bundle" / "state.pt", weights_only=True)
    assert set(state["optimizers"]) == {"d", "g"}
    replayed = run_cli("replay", tmp_path / "bundle", "--json", tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())["finding"]
    assert (again["op"], again["optimizer"], again["loss_name"], again["samples"]) == (
        "aten.log.default", "d", "d_loss", [11])
    assert replayed.code == 1


# --- small cases: one rule each ------------------------------------------------------------------

TWO_OPTIMIZERS = LINEAR_CASE + """
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 1)
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

def build_pair():
    return Pair()

def two(model):
    return [torch.optim.SGD(model.a.parameters(), lr=0.1), torch.optim.Adam(model.b.parameters())]
"""


def test_several_optimizers_from_a_factory_all_step(case, tmp_path):
    path = case(TWO_OPTIMIZERS, model="case:build_pair", optimizer="case:two",
                scheduler={"class": "torch.optim.lr_scheduler.StepLR", "step_size": 1,
                           "gamma": 0.5})
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 0, result.report
    lrs = [e["lr"] for e in result.report["timeline"]]
    assert lrs == pytest.approx([0.1, 0.05, 0.025, 0.0125]), "one StepLR per optimizer"


def test_a_skipped_grad_scaler_step_does_not_step_the_scheduler(monkeypatch):
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import Session
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    overflow = [False, True, False]

    def loss_fn(model, batch):
        out = (model(batch) ** 2).mean()
        return out * 1e36 if overflow.pop(0) else out
    session = Session.for_loop(model, opt, loss_fn, "cpu", [torch.ones(2, 3)] * 3,
                               precision=None)
    session.schedulers = {"scheduler": scheduler}
    session.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    session.precision.scale = 2.0**16
    outcome = run_steps(session, 3)
    assert outcome.trip is None
    assert [e.skipped for e in outcome.timeline] == [False, True, False]
    assert [e.lr for e in outcome.timeline] == [1.0, 0.5, 0.5]


def test_reduce_on_plateau_gets_the_loss(case, tmp_path):
    path = case(LINEAR_CASE, optimizer={"class": "torch.optim.SGD", "lr": 0.1},
                scheduler={"class": "torch.optim.lr_scheduler.ReduceLROnPlateau",
                           "patience": 0, "factor": 0.5, "mode": "max"})
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 0, result.report
    lrs = [e["lr"] for e in result.report["timeline"]]
    # mode max on a falling loss: no improvement after the first step, halved each time.
    assert lrs[0] == 0.1 and lrs[-1] < 0.1


ACCUMULATE_CLEAN = LINEAR_CASE.replace("range(4)", "range(10)")


def test_accumulation_steps_once_per_window_and_drops_a_partial_window(case, tmp_path):
    path = case(ACCUMULATE_CLEAN, optimizer={"class": "torch.optim.SGD", "lr": 0.1},
                accumulate=4)
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["steps_run"] == 2 and result.report["config"]["accumulate"] == 4


def test_accumulated_gradient_equals_the_full_batch_gradient():
    """The window scales each micro-batch's loss by 1/N: the update is the full batch's."""
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import Session

    def loss_fn(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)
    weights = []
    for window, batches in ((1, [(x, y)]), (4, [(x[i:i + 2], y[i:i + 2]) for i in (0, 2, 4, 6)])):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        session = Session.for_loop(model, opt, loss_fn, "cpu", batches, accumulate=window)
        assert run_steps(session).steps_run == 1
        weights.append(model.weight.detach().clone())
    assert torch.allclose(weights[0], weights[1], atol=1e-6)


GAN_G_TRIPS = """
import torch
from torch import nn

class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Linear(2, 2)
        self.d = nn.Linear(2, 1)

def build_model():
    return GAN()

def opts(model):
    return {"d": torch.optim.SGD(model.d.parameters(), lr=0.1),
            "g": torch.optim.SGD(model.g.parameters(), lr=0.1)}

def batches():
    for i in range(4):
        yield torch.full((4, 2), float(i))

def step(model, batch, optimizer):
    d_loss = model.d(batch).pow(2).mean()
    optimizer["d"].zero_grad(); d_loss.backward(); optimizer["d"].step()
    fake = model.g(batch)
    if batch[0, 0] == 2:
        fake = fake * torch.sqrt(torch.tensor(-1.0) + fake.detach() * 0)
    g_loss = model.d(fake).mean()
    optimizer["g"].zero_grad(); g_loss.backward(); optimizer["g"].step()
    return {"d_loss": d_loss, "g_loss": g_loss}
"""


def test_user_step_trip_in_the_second_optimizer_puts_the_first_update_back(case, tmp_path):
    path = case(GAN_G_TRIPS, loss=None, step="case:step", optimizer="case:opts")
    text = path.read_text().replace("loss: null\n", "")
    path.write_text(text)
    result = scan(path, "--repro", tmp_path / "bundle", tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert (f["step"], f["optimizer"], f["loss_name"], f["op"], f["cause"]) == (
        2, "g", "g_loss", "aten.sqrt.default", "sqrt-domain")
    # The bundle holds D as it was before step 2's update (the scan put that update back).
    state = torch.load(tmp_path / "bundle" / "state.pt", weights_only=True)
    timeline = result.report["timeline"]
    assert len(timeline) == 3
    replayed = run_cli("replay", tmp_path / "bundle", "--json", tmp_path / "again.json")
    assert replayed.code == 1
    again = json.loads((tmp_path / "again.json").read_text())["finding"]
    assert (again["op"], again["optimizer"]) == ("aten.sqrt.default", "g")
    assert set(state["optimizers"]) == {"d", "g"}


NUMPY_DRAW = LINEAR_CASE.replace("range(4)", "range(3)") + """
import numpy as np

def noisy_loss(model, batch):
    x, y = batch
    keep = float(np.random.rand())              # a NumPy draw decides the step (like LayerDrop)
    scale = torch.tensor(keep - 0.5).clamp(min=0)
    return ((model(x) - y) ** 2).mean() / scale
"""


def test_replay_restores_numpy_rng(case, tmp_path):
    """A NaN that depends on a NumPy draw reproduces on replay (the draw is the same)."""
    path = case(NUMPY_DRAW, loss="case:noisy_loss", seed=3)
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 1, result.report
    f = result.finding
    assert f["reproduced"] is True and f["op"] == "aten.div.Tensor"
    assert f["cause"] == "div-by-zero"


@pytest.mark.parametrize("extra, key, words", [
    ({"step": "case:loss"}, "step", "not both"),
    ({"accumulate": 0}, "accumulate", "integer from 1"),
    ({"accumulate": "4"}, "accumulate", "integer from 1"),
    ({"scheduler": {"class": "torch.optim.SGD"}}, "scheduler.class", "not a learning-rate"),
    ({"scheduler": {"class": "torch.optim.lr_scheduler.StepLR", "gamma": "fast"}},
     "scheduler.gamma", "expected a number"),
    ({"scheduler": {"class": "torch.optim.lr_scheduler.StepLR", "step_sizes": 1}},
     "scheduler", "cannot be called"),
    ({"scheduler": "case:nothing_here"}, "scheduler", "nothing_here"),
])
def test_validate_knows_the_new_keys(case, extra, key, words):
    path = case(LINEAR_CASE, optimizer={"class": "torch.optim.SGD", "lr": 0.1}, **extra)
    result = run_cli("validate", path)
    assert result.code == 3, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert key in out and words in out, out


def test_step_and_accumulate_conflict(case):
    path = case(LINEAR_CASE, step="case:loss", accumulate=2)
    text = path.read_text().replace("loss: case:loss\n", "")
    path.write_text(text)
    result = run_cli("validate", path)
    out = result.stdout + result.stderr
    assert result.code == 3 and "accumulate" in out and "step:" in out, out
