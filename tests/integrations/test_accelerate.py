"""Accelerate: Sentinel inside an `accelerator.accumulate(...)` loop (the README's recipe)."""

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="the hf extra is not installed")

from nanaudit import NonFiniteError, Sentinel  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state; each test builds its own Accelerator."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def compute_loss(model, batch):
    x, y = batch
    pred = model(x).float()
    return (pred - torch.log(y)).pow(2).mean() + torch.sqrt(y * (y - 0.5) * pred.pow(2)).mean()


def _data(bug=None, n=48):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.rand(n, 1, generator=g) + 0.6
    if bug == "nan-input":
        x[21, 1] = float("nan")        # batch 5 (rows 20..23), row 1
    elif bug == "log-zero":
        y[21] = 0.0
    elif bug == "sqrt-zero":
        y[21] = 0.5                    # sqrt(0): finite loss, NaN gradient
    return torch.utils.data.TensorDataset(x, y)


def train(bug=None, mixed_precision="no", accumulation=2, steps_seen=None):
    """The README recipe: one added line per micro-batch, one before the optimizer step."""
    from accelerate import Accelerator
    accelerator = Accelerator(gradient_accumulation_steps=accumulation,
                              mixed_precision=mixed_precision, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    loader = torch.utils.data.DataLoader(_data(bug), batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss, scaler=accelerator.scaler)
    step = 0
    for index, batch in enumerate(loader):
        with accelerator.accumulate(model):
            loss = compute_loss(model, batch)
            accelerator.backward(loss)
            sentinel.micro_batch(batch, loss, index=index)         # no host read
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
                sentinel.check_update(step)                        # one host read
                step += 1
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return sentinel


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
@pytest.mark.parametrize("bug, where, cause", [
    ("nan-input", "input", "nonfinite-input"),
    ("log-zero", "forward", "log-domain"),
    ("sqrt-zero", "backward", "sqrt-domain"),
])
def test_accumulate_loop_names_step_batch_and_sample(bug, where, cause, mixed_precision):
    with pytest.raises(NonFiniteError) as raised:
        train(bug, mixed_precision)
    f = raised.value.report.finding
    # Batch 5 is micro-batch 1 of optimizer step 2 (windows of 2).
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.cause, f.samples) == (
        2, 5, 1, where, cause, [1])
    assert f.reproduced in (True, None) and "non-deterministic" not in f.explanation


def test_accumulate_loop_first_micro_batch_gradient_bug_is_not_transient():
    # Windows of 5: batch 5 opens optimizer step 1; four clean micro-batches follow it, so
    # replaying only the last one would find nothing.
    with pytest.raises(NonFiniteError) as raised:
        train("sqrt-zero", accumulation=5)
    f = raised.value.report.finding
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.cause, f.reproduced) == (
        1, 5, 0, "backward", "sqrt-domain", True)


def test_clean_bf16_accumulation_reads_the_host_once_per_optimizer_step(host_reads):
    sentinel = train(None, "bf16", accumulation=3)
    assert sentinel.report is None and sentinel.steps_checked == 4
    # The Sentinel's reads are its tolist() calls; the item() calls counted here are torch's
    # AdamW reading its CPU step counter and the DataLoader drawing its seed, not nanaudit's.
    assert host_reads["tolist"] == 4
    assert sentinel.timeline[0].lr > sentinel.timeline[-1].lr


def test_readme_accelerate_recipe_runs(tmp_path):
    import re
    import subprocess
    import sys

    from helpers import ROOT
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- accelerate-example -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "the README has an Accelerate recipe marked <!-- accelerate-example -->"
    script = tmp_path / "recipe.py"
    script.write_text(match.group(1))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "step 2 batch 5 micro-batch 1: aten.log.default log-domain rows [1]" in proc.stdout
