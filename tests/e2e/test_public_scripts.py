"""`nanaudit run` on the shapes of well-known public training scripts, unmodified.

Each script under tests/e2e/scripts/ rebuilds, in miniature, the loop of a public script that
was run under `nanaudit run` as-is (README, "`nanaudit run`"): karpathy/nanoGPT's train.py,
pytorch/examples word_language_model/main.py (no optimizer: a hand-written SGD update) and
time_sequence_prediction/train.py (LBFGS). Faults are injected only through each script's own
arguments or data, as a user would. More shapes are kept beside this file: gat/main.py
(test_public_gat.py), vae/main.py (test_public_vae.py), mnist_forward_forward/main.py
(test_public_layers.py) and pytorch/tutorials' seq2seq translation (test_public_seq2seq.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import plain, run_cli

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.localize.events import Trace
from nanaudit.report.model import TimelineEntry
from nanaudit.run.watch import timeline_warnings
from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.step_values import window_loss
from nanaudit.script.target import ScriptOptions, ScriptTarget

SCRIPTS = Path(__file__).parent / "scripts"
NANOGPT, WORD_LM, LBFGS, MNIST, DCGAN = (str(SCRIPTS / n) for n in
                                         ("nanogpt_loop.py", "word_lm_loop.py", "lbfgs_fit.py",
                                          "mnist_loop.py", "dcgan_loop.py"))


@pytest.fixture
def data(tmp_path, monkeypatch):
    """nanoGPT's prepared tokens (uint16 .bin files), a small text corpus, and (x, y) pairs."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    rng.integers(0, 32, size=2000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 32, size=500).astype(np.uint16).tofile(tmp_path / "val.bin")
    words = "the a cat dog sat on mat ran fast slow big red".split()
    (tmp_path / "corpus.txt").write_text(" ".join(words[i] for i in rng.integers(0, 12, 400)))
    x = torch.linspace(-2, 2, 32, dtype=torch.float64)[:, None]
    torch.save(torch.cat([x, 3 * torch.sin(x)], 1), tmp_path / "fit.pt")
    images = torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    torch.save((images, torch.arange(64) % 10), tmp_path / "digits.pt")
    return tmp_path


def audited(script: str, *args: str, **options):
    # These tests pin the re-run from the start (`--rerun`); the in-process replay at the
    # trip is tested on the example scripts (tests/commands/test_run_inprocess.py).
    options.setdefault("force_rerun", True)
    return run_script(ScriptTarget(path=script, args=args), ScriptOptions(**options))


def printed(pattern: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(pattern, text)]


# --- nanoGPT's train.py -------------------------------------------------------------------------

def test_nanogpt_clean_run_prints_what_python_prints_and_times_the_micro_batches_mean(
        data, capsys):
    args = (f"--data_dir={data}", "--gradient_accumulation_steps=2")
    plain(NANOGPT, *args)
    alone = capsys.readouterr().out
    report = audited(NANOGPT, *args)
    under = capsys.readouterr().out
    assert exit_code(report) == 0 and report.status == "clean"
    assert under == alone                       # the script's own output is unchanged
    # The loss reaches backward divided by the 2 micro-steps: the timeline counts it undivided,
    # the mean of the micro-batches' losses, not half of it.
    means = printed(r"mean (\S+),", alone)
    assert len(means) == report.steps_run == 7
    assert [e.loss for e in report.timeline] == pytest.approx(means, rel=1e-5)
    assert [e.step for e in report.timeline] == list(range(7))
    assert report.warnings == []
    # One read per optimizer step (the evaluations' `.item()` are the script's) and the last.
    assert report.run.first_run.host_reads == 8


@pytest.mark.slow
def test_nanogpt_huge_learning_rate_is_divergence_at_the_op_through_the_cli(data, tmp_path):
    out = tmp_path / "report.json"
    result = run_cli("run", "--quiet", "--rerun", "--json", out, NANOGPT, f"--data_dir={data}",
                     "--learning_rate=1e6", "--warmup_iters=0", "--eval_interval=1")
    report = json.loads(out.read_text())
    f = report["finding"]
    assert result.code == 1 and report["status"] == "nonfinite" and report["command"] == "run"
    assert (f["step"], f["where"], f["cause"], f["reproduced"]) == (1, "forward", "divergence",
                                                                      True)
    assert f["op"] == "aten.native_layer_norm.default" and f["module"] == "ln_f"
    assert f["source"]["file"] == NANOGPT
    # The weights, not particular rows: every row of the batch went bad.
    assert f["samples"] is None and "not particular rows" in f["sample_search"]["note"]
    assert "lower the learning rate" in f["fix"] and "AdamW(lr=" in f["fix"]
    warning = report["warnings"][0]
    assert (warning["kind"], warning["step"]) == ("update-ratio", 0)
    assert "nanaudit warned at step 0: update-ratio" in f["explanation"]
    rerun = report["run"]["rerun"]
    assert rerun["status"] == "reproduced" and rerun["precision"] == "fp32"


def test_nanogpt_float16_with_a_grad_scaler_times_unscaled_losses(data, capsys):
    args = (f"--data_dir={data}", "--dtype='float16'")
    report = audited(NANOGPT, *args)
    means = printed(r"mean (\S+),", capsys.readouterr().out)
    assert report.status == "clean"
    # `scaler.scale(loss).backward()` reaches backward as loss x 65536: the timeline has loss.
    assert [e.loss for e in report.timeline] == pytest.approx(means, rel=1e-3)


@pytest.mark.slow
def test_nanogpt_float16_overflow_in_a_step_the_grad_scaler_skips(data):
    report = audited(NANOGPT, f"--data_dir={data}", "--dtype='float16'", "--learning_rate=1e5",
                     "--warmup_iters=0")
    f = report.finding
    assert exit_code(report) == 1
    # The weights left float16's range; autocast's cast made inf; the scaler skipped the step,
    # which is no step but still a finding: its loss was NaN before any scaling.
    assert (f.step, f.where, f.cause) == (1, "forward", "dtype-overflow")
    assert f.op == "aten._to_copy.default" and f.module == "h.c_attn"
    assert "GradScaler skipped this step" in f.explanation
    assert report.run.first_run.skipped == 1
    last = report.timeline[-1]
    assert last.skipped and last.scale == 65536.0 and last.step == 1
    assert report.run.rerun.precision == "fp16"


def test_an_evaluation_under_no_grad_is_not_the_training_forward():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    armed = []

    class Tracer:                                   # stands in for the OpTracer
        phase = "forward"
        trace = Trace()                             # what it saw: nothing

        def __init__(self, module, others=None):     # others: the held models' names
            armed.append(module)

        def start_backward(self):
            self.phase = "backward"

        def end_backward(self):
            self.phase = "forward"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    auditor = ScriptAuditor(rerun_step=1, tracer=Tracer).install()
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(5, 3)).sum().backward()
        optimizer.step()
        with torch.no_grad():                       # estimate_loss between two steps
            model(torch.full((2, 3), float("nan")))
        assert auditor.window.armed is None
        model(torch.ones(4, 3)).sum().backward()
    finally:
        auditor.remove()
    assert armed == [model] and auditor.window.armed.batch_size == 4


# --- word_language_model: no optimizer ---------------------------------------------------------

def test_word_lm_without_an_optimizer_is_audited_at_each_backward(data, capsys):
    args = ("--data", str(data / "corpus.txt"))
    plain(WORD_LM, *args)
    alone = capsys.readouterr().out
    report = audited(WORD_LM, *args)
    assert capsys.readouterr().out == alone
    losses = printed(r"batch \d+ loss (\S+)", alone)
    assert exit_code(report) == 0 and report.steps_run == len(losses) == 26
    assert [e.loss for e in report.timeline] == pytest.approx(losses, rel=1e-5)
    assert all(e.lr is None for e in report.timeline)


def test_word_lm_inf_learning_rate_is_the_scripts_own_update(data):
    report = audited(WORD_LM, "--data", str(data / "corpus.txt"), "--lr", "inf")
    f = report.finding
    assert (f.step, f.where, f.cause) == (0, "optimizer", "optimizer-update")
    assert "the script's own update of step 0" in f.explanation
    assert f.tensors[0] == "encoder.weight"


@pytest.mark.slow
def test_word_lm_exploding_relu_rnn_is_localized_by_the_rerun(data, capsys):
    args = ("--data", str(data / "corpus.txt"), "--model", "RNN_RELU", "--clip", "1e9",
            "--lr", "20")
    plain(WORD_LM, *args)
    first_nan = [math.isnan(v) for v in printed(r"batch \d+ loss (\S+)",
                                                capsys.readouterr().out)].index(True)
    report = audited(WORD_LM, *args)
    f = report.finding
    assert exit_code(report) == 1 and report.run.rerun.status == "reproduced"
    assert (f.step, f.where, f.op, f.module) == (first_nan, "forward", "aten.addmm.default",
                                                 "rnn")
    # An fp32 overflow after a warned update: divergence (as `scan` names it), no rows.
    assert f.cause == "divergence" and "nanaudit warned at step 0: update-ratio" in f.explanation
    assert f.samples is None and report.warnings[0].kind == "update-ratio"


def test_fail_on_warning_exits_7_on_a_clean_run_with_an_early_warning(data, tmp_path):
    # lr 40 on this toy corpus: the first update changes the weights' norm by more than 10%,
    # and training goes on with finite values.
    out = tmp_path / "r.json"
    args = (WORD_LM, "--data", str(data / "corpus.txt"), "--epochs", "1", "--lr", "40")
    result = run_cli("run", "--quiet", "--json", out, "--fail-on", "warning", *args)
    report = json.loads(out.read_text())
    assert result.code == 7 and report["status"] == "clean"
    assert [(w["kind"], w["step"]) for w in report["warnings"]] == [("update-ratio", 0)]
    assert run_cli("run", "--quiet", *args).code == 0


# --- time_sequence_prediction: LBFGS ----------------------------------------------------------

def test_lbfgs_closure_calls_are_one_step(data, capsys):
    report = audited(LBFGS, str(data / "fit.pt"))
    out = capsys.readouterr().out
    assert report.status == "clean" and report.steps_run == 3
    assert [e.step for e in report.timeline] == [0, 1, 2]
    # Each step's entry is its first closure call: the loss before that step's updates.
    firsts = [float(chunk.split("loss: ")[1].split()[0]) for chunk in out.split("fit:")[:3]]
    assert [e.loss for e in report.timeline] == pytest.approx(firsts, rel=1e-6)


@pytest.mark.slow
def test_lbfgs_nan_in_a_later_closure_call_is_traced_in_that_call(data):
    report = audited(LBFGS, str(data / "fit.pt"), "--margin", "3.2")
    f = report.finding
    assert exit_code(report) == 1 and report.run.rerun.status == "reproduced"
    assert (f.step, f.where, f.op, f.cause) == (0, "forward", "aten.log.default", "log-domain")
    assert "call 3 of the step's closure" in f.explanation
    assert f.source.file == LBFGS and "torch.log(args.margin" in f.source.code


# --- the pieces ---------------------------------------------------------------------------------

def test_a_loss_divided_by_the_window_size_counts_undivided():
    losses = [2.0, 4.0]
    assert window_loss(losses, [2.0, 2.0]) == 6.0      # (4 + 8) / 2: the mean, undivided
    assert window_loss(losses, [None, None]) == 3.0    # not divided: their mean
    assert window_loss(losses, [3.0, 3.0]) == 3.0      # divided by something else
    assert window_loss(losses[:1], [4.0]) == 2.0       # one micro-batch: as it is
    assert math.isnan(window_loss([math.inf, -math.inf], [2.0, 2.0]))   # as the device says


def test_the_divisor_is_read_from_the_autograd_node():
    from nanaudit.script.step_values import loss_factor
    w = torch.ones(3, requires_grad=True)
    assert loss_factor(w.sum() / 4) == 4.0
    assert loss_factor(w.sum() * 0.25) == 4.0
    assert loss_factor(w.sum() / torch.tensor(8.0)) == 8.0
    assert loss_factor(w.sum()) is None
    assert loss_factor(w.sum() / w.sum().detach().requires_grad_()) is None


def _entry(step, loss, norm):
    return TimelineEntry(step=step, loss=loss, grad_norm=1.0, param_norm=norm, lr=0.1,
                         time_ms=1.0)


def test_update_ratio_warnings_from_the_weights_norms():
    steady = [_entry(i, 2.0 - 0.01 * i, 10.0 + 0.01 * i) for i in range(8)]
    assert timeline_warnings(steady) == []
    jumps = steady[:3] + [_entry(3, 1.9, 30.0), _entry(4, 1.9, 90.0), _entry(5, 1.9, 90.1)]
    warnings = timeline_warnings(jumps)
    # Warned once as the change rises above 0.1 of the norm (step 2's update), not each step.
    assert [(w.kind, w.step) for w in warnings] == [("update-ratio", 2)]
    assert "from 10.02 to 30" in warnings[0].message


def test_hooks_and_wrapped_methods_are_restored(data):
    from torch.amp import GradScaler
    from torch.optim import Optimizer
    methods = (GradScaler.scale, GradScaler.step, Optimizer.__init__, torch.autograd.backward)
    report = audited(WORD_LM, "--data", str(data / "corpus.txt"), "--lr", "inf")
    assert report.status == "nonfinite"
    assert (GradScaler.scale, GradScaler.step, Optimizer.__init__,
            torch.autograd.backward) == methods


def test_backward_calls_before_the_optimizer_is_built_are_not_its_steps(tmp_path):
    # A gradient-based check before training (a warm-up, an init): checked as the steps of a
    # script without an optimizer until one is built, then the steps are the optimizer's.
    path = tmp_path / "warm.py"
    path.write_text(
        "import torch\n"
        "model = torch.nn.Linear(3, 1)\n"
        "for _ in range(2):\n"
        "    model(torch.ones(4, 3)).sum().backward()\n"
        "model.zero_grad()\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    model(torch.ones(4, 3)).pow(2).mean().backward()\n"
        "    optimizer.step()\n")
    report = audited(str(path))
    assert report.status == "clean" and report.steps_run == 3
    assert [e.step for e in report.timeline] == [0, 1, 2]
    assert all(e.lr == 0.1 for e in report.timeline)


# --- pytorch/examples mnist/main.py: a transform module in the DataLoader -----------------------

@pytest.mark.slow
def test_mnist_transform_module_is_not_the_model_so_the_rerun_names_the_models_modules(data):
    # The DataLoader calls the parameterless Normalize module on each sample after every step,
    # before the model: the step's first module call is the model's, whose names the re-run
    # gives (not `<Conv2d>` relative to the transform).
    report = audited(MNIST, f"--data={data / 'digits.pt'}", "--lr=1e30")
    f = report.finding
    assert exit_code(report) == 1 and report.run.rerun.status == "reproduced"
    assert (f.step, f.where, f.cause) == (1, "forward", "divergence")
    assert f.module in ("conv1", "fc1") and f.source.file == MNIST
    assert "conv1.weight" in f.tensors and not any(t.startswith("<") for t in f.tensors)


def test_mnist_nan_pixel_is_a_batch_row_not_the_transforms_sample(data, capsys):
    images, labels = torch.load(data / "digits.pt")
    images[37, 0, 4, 4] = float("nan")
    torch.save((images, labels), data / "dirty.pt")
    report = audited(MNIST, f"--data={data / 'dirty.pt'}", "--epochs=1")
    f = report.finding
    # Stopped before the update of the step whose batch holds sample 37 (the script printed
    # the steps before it), at its one row of the 8, from the model's input, not the sample's.
    steps_printed = len(printed(r"Loss: (\S+)", capsys.readouterr().out))
    assert (f.step, f.where, f.cause) == (steps_printed, "input", "nonfinite-input")
    assert len(f.samples) == 1 and 0 <= f.samples[0] < 8
    assert "shapes [[8, 1, 8, 8]]" in f.explanation
    # Issue 29: the re-run traced the script's data code: no op made the NaN, torch.load read
    # it, and the sampler's indices name the data set's sample.
    assert report.run.rerun.status == "reproduced" and f.producer.made_by == "outside-torch"
    assert f.producer.sample_indices == [37] and "torch.load(path)" in f.explanation


# --- pytorch/examples dcgan/main.py: BCELoss raises on the NaN ---------------------------------

def test_dcgan_inf_learning_rate_is_the_update_not_the_bce_error_it_caused():
    # Adam(lr=inf) makes the discriminator's weights inf at step 0; the generator's step then
    # feeds NaN to BCELoss, which raises before any backward or optimizer check.
    report = audited(DCGAN, "--lr=1e400")
    f = report.finding
    assert exit_code(report) == 1 and report.status == "nonfinite"
    assert (f.step, f.where, f.cause) == (0, "optimizer", "optimizer-update")
    assert "Adam(lr=inf" in f.explanation and "0.weight" in f.tensors
    assert ("the script then raised RuntimeError: all elements of input should be between 0 "
            "and 1") in f.explanation
    assert report.error.exception == "RuntimeError" and report.error.frames[0].line == 45


@pytest.mark.slow
def test_dcgan_overflowing_discriminator_is_localized_by_the_rerun_of_the_step_that_raised():
    # lr 1e30: the weights are finite (1e30), the next forward overflows and BCELoss raises on
    # the NaN: the frames hold it, and the re-run names the op that made it.
    report = audited(DCGAN, "--lr=1e30")
    f = report.finding
    assert exit_code(report) == 1 and report.run.rerun.status == "reproduced"
    assert (f.step, f.where, f.reproduced) == (1, "forward", True)
    assert f.op == "aten.addmm.default" and f.module == "2" and f.source.line == 45
    assert any(s.name == "mat2" and s.max >= 1e29 for s in f.inputs)
    assert f.explanation.endswith("the script then raised RuntimeError: all elements of input "
                                  "should be between 0 and 1")
    assert report.error.exception == "RuntimeError"


def test_a_script_error_without_a_nonfinite_value_stays_exit_4(tmp_path):
    # The script's own check raises on a finite loss: no value to blame, no re-run.
    path = tmp_path / "train.py"
    path.write_text("import torch\nw = torch.nn.Linear(2, 1)\n"
                    "opt = torch.optim.SGD(w.parameters(), lr=0.1)\n"
                    "for step in range(3):\n"
                    "    loss = w(torch.ones(4, 2)).pow(2).mean()\n"
                    "    if step == 2: raise ValueError(f'loss {loss.item()} too high')\n"
                    "    loss.backward(); opt.step(); opt.zero_grad()\n")
    report = audited(str(path))
    assert exit_code(report) == 4 and report.finding is None and report.run.rerun is None
    assert report.error.exception == "ValueError"


def test_a_scripts_own_nan_check_names_the_tensor_and_the_step(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch\nw = torch.nn.Linear(2, 1)\n"
                    "opt = torch.optim.SGD(w.parameters(), lr=0.1)\n"
                    "for step in range(3):\n"
                    "    x = torch.ones(4, 2) if step < 2 else torch.full((4, 2), 1e38)\n"
                    "    loss = w(x).pow(2).mean()\n"
                    "    if not torch.isfinite(loss): raise ValueError('loss is not finite')\n"
                    "    loss.backward(); opt.step(); opt.zero_grad()\n")
    report = audited(str(path), rerun=False)
    f = report.finding
    assert exit_code(report) == 1 and (f.step, f.where, f.value) == (2, "forward", "inf")
    assert f.tensors[0] == "`loss` in <module> (train.py:7)"
    assert "the script raised ValueError: loss is not finite during optimizer step 2" \
        in f.explanation
