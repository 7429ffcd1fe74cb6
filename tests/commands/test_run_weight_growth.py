"""An overflow that an optimizer's update made is `divergence`, named with the parameter, the
optimizer, its step and its learning rate, even where another optimizer's check tripped (a
GAN): the overflowing op's own inputs are the evidence (localize/weight_growth.py). An overflow
of inputs large in themselves, with the weights at their size, stays `dtype-overflow`."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, scan
from test_run_inprocess import audit, in_process, line_of, write

from nanaudit.commands.common import exit_code
from nanaudit.localize.overflow import overflow_bound
from nanaudit.localize.weight_growth import WeightUpdate, grown_weight

# A plain two-optimizer GAN loop (pytorch/examples dcgan/main.py's order: the discriminator's
# step on real and detached fake, then the generator's through it), the generator's optimizer
# and learning rate from the command line.
GAN = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    make = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[sys.argv[1]]
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = make(generator.parameters(), lr=float(sys.argv[2]))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=2e-4)
    bce = nn.BCEWithLogitsLoss()
    for step in range(6):
        real, z = torch.randn(16, 8), torch.randn(16, 4)
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


@pytest.mark.parametrize(("optimizer", "lr", "described"), [
    ("adam", "1e20", "Adam(lr=1e+20"),
    ("sgd", "1e30", "SGD(lr=1e+30"),
])
def test_a_gan_generators_huge_learning_rate_is_divergence_of_its_weights(tmp_path, optimizer,
                                                                          lr, described):
    # Step 0 is the discriminator's, step 1 the generator's update to weights of 1e20 or more
    # (finite); at step 2 the generator's forward overflows in its second linear, and the
    # discriminator's check trips on the NaN loss: it read none of the generator's weights.
    path = write(tmp_path, GAN)
    report = audit(path, optimizer, lr)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.module, f.cause) == (2, "forward", "aten.addmm.default",
                                                          "2", "divergence")
    assert f.source.line == line_of(path, "fake = generator(z)")
    assert ("its mat2 is the parameter generator.2.weight" in f.explanation
            and f"{described}, " in f.explanation and "last updated it at step 1, at lr "
            f"{float(lr):.4g} for its group" in f.explanation)
    # the fix is the optimizer's that grew them, not the tripping one's (the discriminator's)
    assert (f"the optimizer whose update grew these weights: {described}, " in f.fix
            and "for the group of generator.2.weight" in f.fix)
    assert ("clipping the gradients does not shrink an Adam update" in f.fix) == (
        optimizer == "adam")
    in_process(report)


def test_the_rate_named_is_the_one_the_update_ran_with_not_the_schedulers_next(tmp_path):
    # A scheduler steps after the update and cuts the rate 1e30-fold: the update that grew the
    # weights ran at 1e20, which the finding says (Ledger.update_rates), not 1e-10.
    code = GAN.replace("        opt_g.step()\n", "        opt_g.step()\n        cut.step()\n")
    code = code.replace("    bce = nn", "    cut = torch.optim.lr_scheduler.LambdaLR(opt_g, "
                                        "lambda s: 1e-30 ** s)\n    bce = nn")
    report = audit(write(tmp_path, code), "adam", "1e20")
    f = report.finding
    assert (f.step, f.cause) == (2, "divergence")
    assert "Adam(lr=1e+20, " in f.explanation and "at lr 1e+20 for its group" in f.explanation
    assert "Adam(lr=1e+20, " in f.fix


@pytest.mark.slow
def test_the_rerun_names_the_same_divergence(tmp_path):
    report = audit(write(tmp_path, GAN), "adam", "1e20", force_rerun=True)
    f = report.finding
    assert (f.step, f.op, f.cause, f.localized_by) == (2, "aten.addmm.default", "divergence",
                                                       "re-run")
    assert report.run.rerun.status == "reproduced"
    # the re-run's tracer names the script's models as the in-process replay does
    assert "its mat2 is the parameter generator.2.weight" in f.explanation
    assert "Adam(lr=1e+20, " in f.explanation and "at step 1," in f.explanation


@pytest.mark.slow
def test_lightnings_gan_template_at_a_huge_learning_rate_is_divergence():
    pytest.importorskip("lightning")
    # Lightning's template: the generator's step first. Its update at step 0 makes its weights
    # 1e20; at step 1 the discriminator's part calls the generator again, which overflows,
    # while `toggle_optimizer` has switched the generator's weights' requires_grad off.
    script = ROOT / "tests" / "e2e" / "scripts" / "lightning_gan.py"
    report = audit(script, "--lr", "1e20")
    f = report.finding
    assert (f.step, f.op, f.module, f.cause) == (1, "aten.addmm.default",
                                                 "model.generator.model.2", "divergence")
    assert "the parameter model.generator.model.2.weight" in f.explanation
    assert "Adam(lr=1e+20, " in f.explanation and "at step 0," in f.explanation
    in_process(report)


def test_an_overflow_the_script_raised_on_is_the_divergence_of_the_weights_it_read():
    # pytorch/examples dcgan's shape at lr 1e30: the discriminator's update at step 0 makes its
    # weights 1e30; at step 1 its forward overflows and BCELoss raises on the NaN (an error
    # trip, replayed in-process from the frames).
    report = audit(ROOT / "tests" / "e2e" / "scripts" / "dcgan_loop.py", "--lr=1e30")
    f = report.finding
    assert (f.step, f.op, f.module, f.cause) == (1, "aten.addmm.default", "2", "divergence")
    assert "its mat2 is the parameter netD.2.weight" in f.explanation
    assert "Adam(lr=1e+30, " in f.explanation and "at step 0," in f.explanation
    assert f.explanation.endswith("the script then raised RuntimeError: all elements of input "
                                  "should be between 0 and 1")
    assert "the optimizer whose update grew these weights: Adam(lr=1e+30" in f.fix


HUGE_BATCH = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 1))
    nn.init.constant_(model[0].weight, 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(5):
        x = torch.full((8, 16), 1e38 if step == 2 else 1.0)    # finite, raw, never scaled
        loss = model(x).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def test_a_linear_overflowing_on_huge_inputs_with_its_weights_at_their_size_stays_dtype_overflow(
        tmp_path):
    # The op reads a weight an optimizer updated, but the weight is its first size: the input
    # made the overflow, and no learning rate is blamed.
    report = audit(write(tmp_path, HUGE_BATCH))
    f = report.finding
    assert (f.step, f.op, f.module, f.cause) == (2, "aten.addmm.default", "0", "dtype-overflow")
    assert "the parameter" not in f.explanation and "too large for any dtype" in f.fix


class _History:
    """A WeightHistory holding one parameter, updated at step 4 from a first norm `first`."""

    def __init__(self, parameter: torch.Tensor, first: float):
        self.parameter, self.first = parameter, first

    def update_of(self, parameter):
        if parameter is not self.parameter:
            return None
        return WeightUpdate("w", "SGD(lr=1e+10)", 4, 1e10, self.first)


class _Event:
    def __init__(self, x: torch.Tensor, w: torch.Tensor):
        self.op, self.func = "aten.mm.default", torch.ops.aten.mm.default
        self.args, self.kwargs, self.arg_names = (x, w.t()), {}, ("self", "mat2")


@pytest.mark.parametrize(("x_size", "w_size", "first", "cause"), [
    (1e10, 1e30, 1.0, "divergence"),     # at its first size (1) the product stays 1e10 x 4
    (1e38, 1e30, 1.0, None),             # the inputs alone overflow: not the weight's growth
    (1e36, 1e2, 1.0, None),              # 100x its first size is no divergence
    (1e10, 1e30, 0.0, "divergence"),     # grown from a zero initialization
    (1e10, 1e30, float("inf"), None),    # a first read that overflowed says nothing
])
def test_the_weight_rule_weighs_the_first_size_against_the_range(x_size, w_size, first, cause):
    w = torch.nn.Parameter(torch.full((3, 4), w_size))
    event = _Event(torch.full((2, 4), x_size), w)
    bound = overflow_bound(event.op, event.args, event.kwargs, None)
    assert bound is not None and bound.bound > bound.limit
    found = grown_weight(event, bound, None, _History(w, first))
    assert (found.cause if found is not None else None) == cause
    assert grown_weight(event, bound, None, None) is None          # no history, no claim


# `scan` and Sentinel share the diagnosis: a config's GAN whose user step trains D, then G.
SCAN_GAN = """
import torch
from torch import nn

class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 2))
        self.d = nn.Linear(2, 1)

def build_model():
    return GAN()

def opts(model):
    return {"d": torch.optim.SGD(model.d.parameters(), lr=0.1),
            "g": torch.optim.Adam(model.g.parameters(), lr=1e20)}

def batches():
    for i in range(4):
        yield torch.randn(4, 2)

def step(model, batch, optimizer):
    d_loss = model.d(batch).pow(2).mean()
    optimizer["d"].zero_grad(); d_loss.backward(); optimizer["d"].step()
    g_loss = model.d(model.g(batch)).mean()
    optimizer["g"].zero_grad(); g_loss.backward(); optimizer["g"].step()
    return {"d_loss": d_loss, "g_loss": g_loss}
"""


def test_scan_names_the_divergence_of_a_user_steps_second_optimizer(case, tmp_path):
    path = case(SCAN_GAN, loss=None, step="case:step", optimizer="case:opts")
    path.write_text(path.read_text().replace("loss: null\n", ""))
    result = scan(path, tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1, result.report
    assert (f["step"], f["op"], f["module"], f["cause"]) == (1, "aten.addmm.default", "g.1",
                                                             "divergence")
    assert "its mat2 is the parameter g.1.weight" in f["explanation"]
    # the user's step decides which optimizer steps when: no step is claimed
    assert "Adam `g` last updated it before this step, at lr 1e+20" in f["explanation"]


def test_a_sentinel_names_the_divergence_its_optimizers_first_update_made():
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e20)

    def compute_loss(model, batch):
        return model(batch).pow(2).mean()

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    error = None
    for step in range(4):
        batch = torch.randn(8, 4)
        loss = compute_loss(model, batch)
        loss.backward()
        try:
            sentinel.check(step, batch, loss)
        except NonFiniteError as raised:
            error = raised
            break
        optimizer.step()
        optimizer.zero_grad()
    # One update made every weight 1e20; the next forward overflows: no timeline growth to see.
    assert error is not None
    f = error.report.finding
    assert (f.step, f.op, f.module, f.cause) == (1, "aten.addmm.default", "1", "divergence")
    assert "the parameter 1.weight" in f.explanation
    assert "Adam `optimizer` last updated it at step 0, at lr 1e+20" in f.explanation


# pytorch/examples word_language_model/main.py's step: `clip_grad_norm_`, then a hand-written
# SGD update (`p.data.add_(p.grad, alpha=-lr)`); `--lr 1e30` diverges at step 1 all the same.
HAND_WRITTEN_CLIPPED = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    lr, clip = float(sys.argv[1]), sys.argv[2] == "clip"
    for step in range(4):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 8, (16,)))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
"""


@pytest.mark.parametrize(("clip", "advice"), [
    ("clip", "the script clips its gradients already (`clip_grad_norm_`), which bounds the "
             "gradient, not the rate times it"),
    ("none", "or clip the gradients (`torch.nn.utils.clip_grad_norm_`)"),
])
def test_a_divergence_advises_clipping_only_to_a_script_that_does_not_clip(tmp_path, clip,
                                                                           advice):
    report = audit(write(tmp_path, HAND_WRITTEN_CLIPPED), "1e30", clip)
    f = report.finding
    assert (f.step, f.cause) == (1, "divergence")
    assert f.fix.startswith("lower the learning rate") and f.fix.endswith(advice)
