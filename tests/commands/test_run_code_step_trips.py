"""`nanaudit run` on a step that calls no module (a model of raw tensors), the trips beyond a
loss or gradient that reached backward: the script's own raise in the step's code (its
`assert torch.isfinite(loss)`, `torch.linalg.cholesky` refusing a NaN matrix) is replayed
in-process as a module step's is, and a loss the step's code computed and skipped before
`backward` (`if not torch.isfinite(loss): continue`) is a finding with its op and line; a
frozen encoder's call under `no_grad` is part of the step (not an evaluation before training),
so its first step is recorded too."""

from __future__ import annotations

import pytest
from helpers import line_of
from test_run_code_step import FROZEN_ENCODER, _run
from test_run_code_step import LOGISTIC as CODE_STEP_LOGISTIC

from nanaudit.commands.common import exit_code

# test_run_code_step.py's logistic regression written by hand: at the bad steps the batch is
# scaled up so that the sigmoid saturates, log(1 - 1) = -inf. GUARD: the script's own check.
LOGISTIC = CODE_STEP_LOGISTIC.replace("        opt.zero_grad()\n",
                                      "        GUARD\n        opt.zero_grad()\n")
ASSERT = "assert torch.isfinite(loss), 'the loss went non-finite'"


def test_the_scripts_assert_in_a_raw_tensor_step_is_localized_in_process(tmp_path):
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(3,)").replace("GUARD", ASSERT))
    f = report.finding
    assert exit_code(report) == 1 and report.error.exception == "AssertionError"
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert report.run.rerun is None


# A Gaussian process's kernel written by hand: at step 2 the length scale is multiplied by 0,
# so the kernel's diagonal is 0/0 and `torch.linalg.cholesky` refuses the NaN matrix (it raises
# in torch's own code: no op of the step's record made the raise, the division made the NaN).
CHOLESKY = """
    import torch

    torch.manual_seed(0)
    log_ls = torch.nn.Parameter(torch.zeros(()))
    alpha = torch.nn.Parameter(torch.zeros(6))
    opt = torch.optim.Adam([log_ls, alpha], lr=1e-2)
    for step in range(4):
        x = torch.randn(6, 2)
        y = torch.randn(6)
        scale = 0.0 if step == 2 else 1.0
        d2 = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
        k = torch.exp(-d2 / (torch.exp(log_ls) * scale) ** 2) + 1e-3 * torch.eye(6)
        chol = torch.linalg.cholesky(k)
        loss = ((chol @ alpha - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_cholesky_error_in_a_raw_tensor_step_is_localized_in_process(tmp_path):
    for keep_going in (False, True):        # an error trip is not skippable: it stops alike
        path, report = _run(tmp_path, CHOLESKY, keep_going=keep_going)
        f = report.finding
        assert exit_code(report) == 1 and "cholesky" in report.error.message
        assert (f.step, f.where, f.op, f.cause) == (2, "forward", "aten.div.Tensor",
                                                    "div-by-zero")
        assert f.source.line == line_of(path, "k = torch.exp(-d2")
        assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
        assert report.run.rerun is None
        if keep_going:
            assert [(g.step, g.action) for g in report.findings] == [(2, "stopped")]


SKIP = "if not torch.isfinite(loss):\n            continue"


def test_a_loss_a_raw_tensor_step_skipped_before_backward_is_a_finding(tmp_path, capsys):
    # Iteration 3's loss is -inf and skipped: the optimizer's step 3 is iteration 4's, and
    # its window's code ran the loss line twice before backward.
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(3,)").replace("GUARD", SKIP))
    f = report.finding
    assert exit_code(report) == 1 and report.error is None
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert "skipped it before backward" in f.explanation
    assert f.sample_search.batch_size == 32 and 0 < len(f.samples) < 32   # the saturated rows


def test_keep_going_names_each_loss_a_raw_tensor_step_skipped(tmp_path, capsys):
    # Iterations 1 and 4 skip their loss: the optimizer's steps 1 and 3 hold them. The guard
    # left the bad losses out already, so those steps' updates (the next batches') apply.
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(1, 4)").replace("GUARD", SKIP),
                        keep_going=True)
    assert exit_code(report) == 1 and report.error is None
    assert "w " in capsys.readouterr().out           # the script went on to its end
    assert [f.step for f in report.findings] == [1, 3]
    for f in report.findings:
        assert (f.op, f.cause, f.action) == ("aten.log.default", "log-domain", "skipped")
        assert f.localized_by == "in-process"
        assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")


def test_a_loss_the_last_pass_of_a_raw_tensor_loop_skipped_is_a_finding(tmp_path):
    # Iteration 5, the last, skips its loss: no backward follows it, the script ends. The
    # script's final `w.sum()` (finite, never differentiated either) is no finding.
    path, report = _run(tmp_path, LOGISTIC.replace("BAD", "(5,)").replace("GUARD", SKIP))
    f = report.finding
    assert exit_code(report) == 1 and report.error is None
    assert (f.step, f.where, f.op, f.cause) == (5, "forward", "aten.log.default", "log-domain")
    assert f.source.line == line_of(path, "loss = -(y * torch.log(p)")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"


# A loss summed over a loop inside the step (a recurrent model's per-time-step terms): its line
# makes a differentiable scalar on each pass, each read by the next term; none was skipped. At
# step 1 a term is log(0): the sum reaching backward is -inf, a loss trip like any other.
SUMMED = """
    import torch

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 3) * 0.1)
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        xs = torch.randn(5, 4, 3)
        h = torch.zeros(4, 3)
        loss = torch.zeros(())
        for t, x in enumerate(xs):
            h = torch.tanh(x + h @ w)
            scale = 0.0 if (step, t) == (1, 2) else 1.0
            loss = loss + torch.log(h.pow(2).mean() * scale)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_loss_summed_over_a_loop_in_the_step_is_no_skipped_loss(tmp_path):
    path, report = _run(tmp_path, SUMMED)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.cause) == (1, "forward", "aten.log.default", "log-domain")
    assert f.source.line == line_of(path, "loss = loss + torch.log(")
    assert f.localized_by == "in-process"
    assert "skipped" not in f.explanation


# test_run_code_step.py's frozen encoder called under no_grad (no optimizer holds its weights),
# a head of raw tensors trained by Adam; the loss divides by a count of the batch's positives,
# none at step 0. The encoder's call is part of the step, not an evaluation before training:
# step 0 is recorded from the optimizer's construction like any other.
FROZEN_STEP_0 = FROZEN_ENCODER.replace("step == 2", "step == 0").replace("range(5)", "range(3)")


# ... after an evaluation of the head on the frozen features before training (the call that
# used to end the first step's recording, as an evaluation of a trained model does).
EVALUATED_FIRST = FROZEN_STEP_0.replace(
    "    import torch\n", "    import torch\n    import weakref\n").replace(
    "    for step in range(3):\n", """\
    with torch.no_grad():
        for _ in range(2):
            val = encoder(torch.randn(4, 8)) @ head
            print("val", val.mean().item())
    kept = weakref.ref(val)
    del val
    for step in range(3):
""").replace("        score = ", "        print('evaluation kept', kept() is not None)\n        score = ")


@pytest.mark.parametrize("script", [FROZEN_STEP_0, EVALUATED_FIRST], ids=["plain", "evaluated"])
def test_a_frozen_encoders_first_step_is_localized_in_process(tmp_path, script):
    assert script.count("encoder(") == (1 if script is FROZEN_STEP_0 else 2)
    path, report = _run(tmp_path, script)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.cause) == (0, "forward", "aten.div.Tensor", "div-by-zero")
    assert f.source.line == line_of(path, "loss = ((score - y)")
    assert f.localized_by == "in-process" and report.run.replay.status == "reproduced"
    assert report.run.rerun is None


def test_an_evaluation_of_a_frozen_encoder_before_training_keeps_no_activations(tmp_path, capsys):
    # The first step's window starts again at each call of the frozen encoder: once the step
    # called it, the evaluation's output, which the script let go, is not kept alive by the
    # record.
    _run(tmp_path, EVALUATED_FIRST)
    printed = [line for line in capsys.readouterr().out.splitlines() if "kept" in line]
    assert printed == ["evaluation kept False"]


# A DataLoader over a data set whose row 37 is all zero: without shuffling, step 4's batch
# holds it at row 5, where sqrt's derivative at 0 is inf (x 0 = NaN).
LOADER = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = torch.randn(64, 4)
    data[37] = 0.0
    loader = DataLoader(TensorDataset(data, torch.randn(64)), batch_size=8)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([w], lr=0.01)
    for x, target in loader:
        loss = (torch.sqrt((x @ w) ** 2) - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_raw_tensor_steps_rows_are_counted_in_the_batch_it_read(tmp_path):
    path, report = _run(tmp_path, LOADER)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause) == (4, "backward", "sqrt-domain")
    assert f.source.line == line_of(path, "loss = (torch.sqrt(")
    assert f.localized_by == "in-process"
    assert f.samples == [5] and f.sample_search.batch_size == 8


def test_a_raw_tensor_step_whose_batch_is_not_known_says_so(tmp_path):
    # A constant (3, 1) projection read beside the (8, ...) batch: two leading sizes, which is
    # the batch is not known, so no rows are counted.
    path, report = _run(tmp_path, LOADER.replace(
        "torch.randn(4))", "torch.randn(4, 3))\n    project = torch.ones(3, 1)").replace(
        "(x @ w) ** 2", "(x @ w @ project).squeeze(1) ** 2"))
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause) == (4, "backward", "sqrt-domain")
    assert f.localized_by == "in-process" and f.samples is None
    assert f.sample_search.batch_size is None
    assert "leading sizes 3, 8" in f.sample_search.note
