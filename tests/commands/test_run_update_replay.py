"""`nanaudit run` explains an update trip (finite gradients, the optimizer's step made a weight
non-finite) at the trip, from the optimizer's state after the step: the element, the rows and
the rule that made it, with no re-run and nothing copied on clean steps."""

from __future__ import annotations

import pytest
from helpers import ROOT
from test_run_inprocess import audit

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "update_trip.py"


@pytest.mark.parametrize(("case", "said"), [
    # Embedding rows no batch reached: Adam's second moment is 0 there, and eps is 0.
    ("adam-eps", "at 0.weight[1, 0] (rows [1, 4, 5, 6, 7, 8, 9] of 0.weight's 10 hold "
                 "non-finite values): Adam's update (t = 1) divides exp_avg 0 by sqrt(exp_avg_sq "
                 "0) / sqrt(1 - beta2^t) + eps 0 = 0: 0/0 = NaN"),
    ("adam-inf-lr", "at 0.weight[0, 0] (rows [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] of 0.weight's 10 "
                    "hold non-finite values): the learning rate is inf"),
    # SGD's momentum buffer after the step is its update: lr x buffer past float32's range.
    ("sgd-overflow", "at 0.weight[0, 0] (rows [0, 2, 3] of 0.weight's 10 hold non-finite "
                     "values): lr 1e+38 x momentum buffer -15.4689: the update -1.54689e+39 "
                     "overflows float32"),
])
def test_an_update_trip_is_explained_from_the_optimizers_state(tmp_path, case, said):
    log = tmp_path / "log.txt"
    report = audit(SCRIPT, case, str(log))
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause, f.tensor) == (0, "optimizer", "optimizer-update",
                                                    "0.weight")
    assert said in f.explanation
    assert f.localized_by == "in-process" and report.run.rerun is None
    assert report.run.replay.status == "reproduced" and report.run.replay.steps == 1
    assert log.read_text() == "step 0\n"        # the script's own log, once


def test_adams_default_eps_in_a_float16_model_is_the_zero_it_divided_by():
    # 1e-8 rounds to 0 in float16, where torch adds it: the rule is evaluated in the state's
    # dtype (in float64 it gave a finite update, and the replay named nothing).
    f = audit(SCRIPT, "adam-half").finding
    assert (f.step, f.where, f.cause, f.localized_by) == (0, "optimizer", "optimizer-update",
                                                          "in-process")
    assert ("+ eps 1e-08 = 0: 0/0 = NaN (the second moment is 0 where no gradient reached the "
            "element since the state was made, and eps 1e-08 is 0 in float16)") in f.explanation
    assert f.fix.startswith("keep Adam's state in float32")
    assert "float16's smallest normal, 6.10352e-05" in f.fix


@pytest.mark.parametrize(("name", "step", "rule"), [
    ("RMSprop", 0, "RMSprop's update divides the gradient by sqrt(square_avg 0) + eps 0 = 0"),
    ("Adagrad", 0, "Adagrad's update (t = 1) divides the gradient by sqrt(sum 0) + eps 0 = 0"),
    ("Adamax", 0, "Adamax's update (t = 1) divides exp_avg 0 by exp_inf 0 (the running max "
                  "of |grad| + eps 0)"),
    ("NAdam", 0, "NAdam's update (t = 1) divides the gradient and exp_avg by "
                 "sqrt(exp_avg_sq 0 / (1 - beta2^t)) + eps 0 = 0"),
    # RAdam divides only once the variance is tractable (rho_t > 5: its sixth step).
    ("RAdam", 5, "RAdam's update (t = 6) divides exp_avg 0 by sqrt(exp_avg_sq 0) + eps 0 = 0"),
    ("Adadelta", 0, "by sqrt(square_avg 0 + eps 0) = 0"),
])
def test_eps_zero_in_each_adaptive_optimizer_is_the_zero_it_divided_by(name, step, rule):
    """The gradient a rule divides is gone by the check, but the denominator it divided by is
    in the state: 0 over an element no gradient reached, with eps 0, and the fix names the
    optimizer's own default eps."""
    f = audit(SCRIPT, f"{name}-eps").finding
    assert (f.step, f.where, f.cause, f.localized_by) == (step, "optimizer", "optimizer-update",
                                                          "in-process")
    assert "at 0.weight[1, 0] (rows [1, 4, 5, 6, 7, 8, 9] of 0.weight's 10" in f.explanation
    assert f"{rule}: 0/0 = NaN" in f.explanation
    default = {"Adagrad": "1e-10", "Adadelta": "1e-06"}.get(name, "1e-08")
    assert f.fix.startswith(f"give {name} a positive eps (its default {default})")


def test_an_update_whose_rule_is_not_evaluated_keeps_the_first_runs_finding(tmp_path):
    """SGD without momentum: its update is the gradient, overwritten by the check."""
    report = audit(SCRIPT, "sgd-plain")
    f = report.finding
    assert (f.step, f.where, f.cause, f.localized_by) == (0, "optimizer", "optimizer-update",
                                                          None)
    assert report.run.replay.status == "skipped" and report.run.rerun is None
    assert report.run.replay.note.startswith("the update rule of SGD is not evaluated")
    # --no-rerun: not evaluated either.
    assert audit(SCRIPT, "adam-eps", rerun=False).run.replay is None


GAN = '''
import torch
from torch import nn

torch.manual_seed(0)
generator = nn.Sequential(nn.Linear(16, 64))
critic = nn.Sequential(nn.Linear(64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
opt_g = torch.optim.Adam(generator.parameters(), lr=float("inf"))
opt_d = torch.optim.Adam(critic.parameters(), lr=2e-4)
bce = nn.BCEWithLogitsLoss()
for step in range(4):
    real, z = torch.randn(16, 64), torch.randn(16, 16)
    fake = generator(z)
    d_loss = bce(critic(real), torch.ones(16, 1)) + bce(critic(fake.detach()),
                                                         torch.zeros(16, 1))
    opt_d.zero_grad(); d_loss.backward(); opt_d.step()
    g_loss = bce(critic(fake), torch.ones(16, 1))
    opt_g.zero_grad(); g_loss.backward(); opt_g.step()
'''


def test_another_optimizers_update_that_a_later_step_read_is_the_update_trip(tmp_path):
    # The generator's update (step 1) leaves its weights non-finite; only the critic's next
    # step (2), whose own weights are finite, reads them, in its forward. Before: a loss trip at
    # step 2, `aten.t` of the generator's weight, cause unknown, "created outside torch ops".
    path = tmp_path / "gan.py"
    path.write_text(GAN)
    report = run_script(ScriptTarget(path=str(path)), ScriptOptions())
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause, f.tensors) == (1, "optimizer", "optimizer-update",
                                                     ["0.weight", "0.bias"])
    assert "the learning rate is inf" in f.explanation
    assert report.run.rerun is None
    # One read a check (steps 0 to 2), and the trip's read of the weights every optimizer's
    # last update left.
    assert report.run.first_run.host_reads == 4
