"""An overflow that reads no grown parameter, only an activation an op reading one made (a GAN's
discriminator overflowing on the fake images of a diverged generator), is `divergence` when,
with those weights at their first size, the op that made the activation could not have made
it large enough to overflow (localize/weight_growth.grown_upstream), through ops that cannot
enlarge a value (an activation, a view). Where the overflow needs no growth (the critic's own
weights are huge) or the growth was small, it stays `dtype-overflow`. Through `nanaudit run`
in-process, `scan` and Sentinel (given every optimizer of the loop)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import scan
from test_run_inprocess import audit, in_process, line_of, write

from nanaudit.commands.common import exit_code
from nanaudit.localize.diagnose import overflow_reason
from nanaudit.localize.tracer import OpTracer
from nanaudit.localize.weight_growth import WeightUpdate

# pytorch/examples dcgan's order (the discriminator's step on real and detached fake, then the
# generator's through it), a one-layer generator of flat "images" with no squashing output
# its Adam's learning rate from the command line.
# An Adam step moves each weight by about lr along the sign of its gradient, which is the
# discriminator's weights' direction: the next fake images line up with them, finite near
# float32's top, and the discriminator's first Linear sums 784 such terms past it.
GAN = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(16, 784))
    discriminator = nn.Sequential(nn.Linear(784, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=float(sys.argv[1]))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    for step in range(6):
        real, z = torch.randn(16, 784), torch.randn(16, 16)
        fake = generator(z)
        d_loss = bce(discriminator(real), torch.ones(16, 1)) + \\
            bce(discriminator(fake.detach()), torch.zeros(16, 1))
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = bce(discriminator(fake), torch.ones(16, 1))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
"""


def test_a_discriminator_overflowing_on_a_diverged_generators_images_is_divergence(tmp_path):
    # Step 0 is the discriminator's update, step 1 the generator's, to weights of 2e37; at step
    # 2 the fake images are finite (up to 2.9e38) and the discriminator's first Linear, whose
    # weights are at their size, overflows on them: it reads no grown parameter.
    path = write(tmp_path, GAN)
    report = audit(path, "2e37")
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.module, f.cause) == (2, "forward", "aten.addmm.default",
                                                          "discriminator.0", "divergence")
    assert f.source.line == line_of(path, "bce(discriminator(fake.detach())")
    assert "its mat1 (largest |value| " in f.explanation
    assert f"was made by addmm at train.py:{line_of(path, 'fake = generator(z)')}" \
        in f.explanation
    assert ("that op read the parameter generator.0.weight" in f.explanation
            and "Adam(lr=2e+37, " in f.explanation
            and "last updated it at step 1, at lr 2e+37 for its group" in f.explanation)
    # the fix is the generator's optimizer's, not the discriminator's whose loss tripped
    assert "the optimizer whose update grew these weights: Adam(lr=2e+37, " in f.fix
    assert "for the group of generator.0.weight" in f.fix
    in_process(report)


@pytest.mark.slow
def test_the_rerun_weighs_the_generators_growth_as_the_in_process_replay_does(tmp_path):
    report = audit(write(tmp_path, GAN), "2e37", force_rerun=True)
    f = report.finding
    assert (f.step, f.module, f.cause, f.localized_by) == (2, "discriminator.0", "divergence",
                                                           "re-run")
    assert "that op read the parameter generator.0.weight" in f.explanation


def _sentinel_gan(layers: int, lr: float):
    """A GAN in a loop of the user's with a Sentinel given both optimizers, the
    discriminator's first; the Sentinel checks the discriminator's step (its loss_fn)."""
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    hidden = [torch.nn.Linear(16, 16)] if layers == 2 else []
    gan = torch.nn.ModuleDict({"g": torch.nn.Sequential(*hidden, torch.nn.Linear(16, 784)),
                               "d": torch.nn.Sequential(torch.nn.Linear(784, 32),
                                                        torch.nn.LeakyReLU(0.2),
                                                        torch.nn.Linear(32, 1))})
    opt_d = torch.optim.Adam(gan["d"].parameters(), lr=2e-4)
    opt_g = torch.optim.Adam(gan["g"].parameters(), lr=lr)
    bce = torch.nn.BCEWithLogitsLoss()

    def d_loss_fn(model, batch):
        real, z = batch
        return bce(model["d"](real), torch.ones(16, 1)) + \
            bce(model["d"](model["g"](z).detach()), torch.zeros(16, 1))

    sentinel = Sentinel(gan, [opt_d, opt_g], loss_fn=d_loss_fn)
    for step in range(4):
        batch = (torch.randn(16, 784), torch.randn(16, 16))
        d_loss = d_loss_fn(gan, batch)
        opt_d.zero_grad()
        d_loss.backward()
        try:
            sentinel.micro_batch(batch, d_loss)
            sentinel.check_update(step, optimizer=opt_d)
        except NonFiniteError as error:
            return error.report.finding
        opt_d.step()
        g_loss = bce(gan["d"](gan["g"](batch[1])), torch.ones(16, 1))
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    return None


@pytest.mark.parametrize(("layers", "lr", "module", "parameter", "subject"), [
    # the generator's second Linear reads its own grown weights and overflows
    (2, 1e20, "g.1", "g.1.weight", "its mat2 is the parameter g.1.weight"),
    # the discriminator's Linear overflows on the grown generator's images
    (1, 2e37, "d.0", "g.0.weight", "that op read the parameter g.0.weight"),
])
def test_a_sentinel_given_a_gans_optimizers_names_the_generators(layers, lr, module, parameter,
                                                                 subject):
    # The discriminator's check trips at step 1, after the generator's update at step 0: the
    # weights that diverged are the second optimizer's, which the Sentinel was given.
    f = _sentinel_gan(layers, lr)
    assert f is not None
    assert (f.step, f.op, f.module, f.cause) == (1, "aten.addmm.default", module, "divergence")
    assert subject in f.explanation
    assert f"Adam `optimizer[1]` last updated it at step 0, at lr {lr:.4g}" in f.explanation
    assert f"for the group of {parameter}" in f.fix


# `scan`: a config's GAN whose user step trains D on the generator's detached images, then G.
SCAN_GAN = """
import torch
from torch import nn

class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Linear(16, 784)
        self.d = nn.Linear(784, 1)

def build_model():
    return GAN()

def opts(model):
    return {"d": torch.optim.SGD(model.d.parameters(), lr=0.1),
            "g": torch.optim.Adam(model.g.parameters(), lr=2e37)}

def batches():
    torch.manual_seed(1)
    for i in range(4):
        yield torch.randn(8, 16)

def step(model, batch, optimizer):
    d_loss = model.d(model.g(batch).detach()).mean()
    optimizer["d"].zero_grad(); d_loss.backward(); optimizer["d"].step()
    g_loss = -model.d(model.g(batch)).mean()
    optimizer["g"].zero_grad(); g_loss.backward(); optimizer["g"].step()
    return {"d_loss": d_loss, "g_loss": g_loss}
"""


def test_scan_names_the_divergence_a_user_steps_generator_made_in_the_critic(case, tmp_path):
    path = case(SCAN_GAN, loss=None, step="case:step", optimizer="case:opts")
    path.write_text(path.read_text().replace("loss: null\n", ""))
    result = scan(path, tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1, result.report
    assert (f["step"], f["op"], f["module"], f["cause"]) == (1, "aten.addmm.default", "d",
                                                             "divergence")
    assert "that op read the parameter g.weight" in f["explanation"]
    assert "Adam `g` last updated it before this step, at lr 2e+37" in f["explanation"]


class _Grown:
    """A WeightHistory: the generator's parameters, updated at step 3 from a first norm
    `first` (the critic's were never updated)."""

    def __init__(self, generator: torch.nn.Module, first: float):
        self.held, self.first = {id(p): n for n, p in generator.named_parameters()}, first

    def update_of(self, parameter):
        name = self.held.get(id(parameter))
        return WeightUpdate(f"g.{name}", "SGD(lr=1e+36)", 3, 1e36, self.first) \
            if name is not None else None


def _overflow_through(activation: torch.nn.Module, first: float, critic: float):
    """The diagnosis of a critic Linear overflowing on `activation` of a generator Linear
    whose weights are 1e36 (grown from a first norm `first`); the critic's weights `critic`."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(16, 64), activation)
    critic_layer = torch.nn.Linear(64, 1)
    with torch.no_grad():
        generator[0].weight.fill_(1e36)
        critic_layer.weight.fill_(critic)
    model = torch.nn.ModuleDict({"g": generator, "d": critic_layer})
    with OpTracer(model, weights=_Grown(generator, first)) as tracer:
        critic_layer(generator(torch.ones(4, 16)))
    event = next(e for e in tracer.trace.events if e.op == "aten.addmm.default")
    assert event.module == "d"
    return overflow_reason(event, [], tracer.trace.weights)


@pytest.mark.parametrize(("activation", "through"), [
    (torch.nn.ReLU(), " and relu,"), (torch.nn.LeakyReLU(0.2), " and leaky_relu,"),
    (torch.nn.Dropout(0.5), None),        # scales by 1 / (1 - p): no contraction, no claim
    (torch.nn.Identity(), ","),
])
def test_the_growth_is_weighed_through_ops_that_cannot_enlarge_it(activation, through):
    # 16 inputs of 1 x 1e36 = 1.6e37 per image value, x 64 critic weights of 1.0 = 1e39: past
    # float32. With the generator's weights at their first size (norm 1), 16 + its bias.
    reason = _overflow_through(activation, 1.0, 1.0)
    if through is None:
        assert reason.cause != "divergence" and "g.0.weight" not in reason.text
        return
    assert reason.cause == "divergence", reason.text
    assert re.search(rf"was made by addmm at test_run_grown_upstream.py:\d+{through}",
                     reason.text), reason.text
    assert "that op read the parameter g.0.weight" in reason.text
    assert "SGD(lr=1e+36) last updated it at step 3, at lr 1e+36" in reason.text


@pytest.mark.parametrize(("first", "critic"), [
    (1e34, 1.0),       # 100x its first size: no divergence of the generator
    (1.0, 1e36),       # the critic's own weights overflow on images of any first size
])
def test_an_upstream_growth_that_did_not_make_the_overflow_is_not_named(first, critic):
    reason = _overflow_through(torch.nn.ReLU(), first, critic)
    assert reason.cause == "dtype-overflow" and "g.0.weight" not in reason.text
