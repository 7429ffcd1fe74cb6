"""The library API: `Sentinel` in a hand-written loop (accumulation, several optimizers,
a GradScaler) and the Lightning callback; importing nanaudit pulls no optional dependency."""


import json
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

EXAMPLES = ROOT / "configs" / "examples"


def _sentinel_loop(loss_fn_given: bool, poison_step=5, compiled=False):
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    if compiled:
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def compute_loss(model, batch):
        x, y = batch
        return (torch.sqrt(model(x) - y + 10.0) - 1).pow(2).mean()

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss if loss_fn_given else None)
    g = torch.Generator().manual_seed(0)
    for step in range(10):
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        if step == poison_step:
            y[1] = 100.0
        loss = compute_loss(model, (x, y))
        loss.backward()
        try:
            sentinel.check(step, (x, y), loss)
        except NonFiniteError as error:
            return error, model
        optimizer.step()
        optimizer.zero_grad()
    return None, model


def test_sentinel_raises_before_the_bad_update_with_a_localized_report():
    error, model = _sentinel_loop(loss_fn_given=True)
    assert error is not None
    f = error.report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        5, "forward", "aten.sqrt.default", "sqrt-domain", [1])
    assert all(torch.isfinite(p).all() for p in model.parameters()), "the update did not run"
    assert len(error.report.timeline) == 6 and "sqrt-domain" in str(error)


@pytest.mark.slow
def test_sentinel_on_a_compiled_model_gives_the_eager_finding_in_the_users_names():
    error, _ = _sentinel_loop(loss_fn_given=True, compiled=True)
    assert error is not None
    f = error.report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        5, "forward", "aten.sqrt.default", "sqrt-domain", [1])
    assert f.compiled is not None and f.compiled.outcome == "eager"
    from nanaudit.report.model import report_to_dict
    assert "_orig_mod" not in json.dumps(report_to_dict(error.report), default=str)


def test_sentinel_without_loss_fn_names_the_check():
    error, _ = _sentinel_loop(loss_fn_given=False)
    f = error.report.finding
    assert (f.step, f.where, f.op, f.cause) == (5, "forward", None, "unknown")
    assert "loss_fn=" in f.explanation


def test_sentinel_reads_the_device_once_per_check(host_reads):
    error, _ = _sentinel_loop(loss_fn_given=True, poison_step=None)
    assert error is None and host_reads == {"tolist": 10, "item": 0}


def test_readme_sentinel_example_runs(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- sentinel-example -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "the README has a Sentinel example marked <!-- sentinel-example -->"
    script = tmp_path / "example.py"
    script.write_text(match.group(1))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "step 7" in proc.stdout and "log-domain" in proc.stdout


def test_importing_nanaudit_imports_no_optional_dependency():
    code = ("import sys, nanaudit, nanaudit.integrations; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'matplotlib', 'torch', "
            "'transformers', 'accelerate') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_lightning_callback_stops_before_the_bad_update(tmp_path):
    lightning = pytest.importorskip("lightning")
    from nanaudit import NonFiniteError
    from nanaudit.integrations.lightning import NanauditCallback

    class Regressor(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.log(self.layer(x).abs() * y).mean()   # log(0) where y == 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    x, y = torch.randn(64, 3), torch.rand(64, 1) + 0.5
    y[37] = 0.0                                   # batch 4 (rows 32..39), row 5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False,
                                callbacks=[NanauditCallback(tmp_path / "nan.json")])
    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(Regressor(), loader)
    f = raised.value.report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        4, "forward", "aten.log.default", "log-domain", [5])
    assert json.loads((tmp_path / "nan.json").read_text())["finding"]["step"] == 4


def test_sentinel_lets_a_grad_scaler_skip_but_catches_a_nan_loss():
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)   # too high: early skips

    def compute_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(batch).float().pow(2).mean()

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss, scaler=scaler)
    g = torch.Generator().manual_seed(0)
    skipped = 0
    with pytest.raises(NonFiniteError) as raised:
        for step in range(12):
            batch = torch.randn(8, 16, generator=g)
            if step == 10:
                batch[2, 0] = float("inf")
            loss = compute_loss(model, batch)
            scaler.scale(loss).backward()
            sentinel.check(step, batch, loss)
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            skipped += scaler.get_scale() < before
            optimizer.zero_grad()
    assert skipped >= 1, "the scaler skipped steps without a finding"
    f = raised.value.report.finding
    assert (f.step, f.where, f.tensor, f.samples) == (10, "input", "batch", [2])


def _accumulating_loop(bad_batch, accumulation=4, batches=12):
    """A hand-written loop accumulating gradients over `accumulation` micro-batches, with
    sqrt(0) (finite loss, NaN gradient) in row 2 of batch `bad_batch`."""
    from nanaudit import Sentinel
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2),
                                torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def compute_loss(model, batch):
        x, y = batch
        return torch.sqrt(y * model(x).pow(2)).mean()

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    g = torch.Generator().manual_seed(0)
    step = 0
    for index in range(batches):
        x, y = torch.randn(4, 3, generator=g), torch.rand(4, 1, generator=g) + 0.5
        if index == bad_batch:
            y[2] = 0.0
        loss = compute_loss(model, (x, y)) / accumulation
        loss.backward()
        sentinel.micro_batch((x, y), loss, index=index)
        if (index + 1) % accumulation == 0:
            sentinel.check_update(step)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
    return sentinel


def test_sentinel_accumulation_names_the_early_micro_batch_not_a_transient():
    from nanaudit import NonFiniteError
    with pytest.raises(NonFiniteError) as raised:
        _accumulating_loop(bad_batch=4)        # micro-batch 0 of optimizer step 1
    f = raised.value.report.finding
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.forward_op, f.cause, f.samples,
            f.reproduced) == (1, 4, 0, "backward", "aten.sqrt.default", "sqrt-domain", [2], True)
    assert "micro-batch 0 of the 4" in f.explanation


def test_sentinel_accumulation_reads_the_host_once_per_optimizer_step(host_reads):
    sentinel = _accumulating_loop(bad_batch=None)
    assert sentinel.steps_checked == 3 and len(sentinel.timeline) == 3
    assert host_reads == {"tolist": 3, "item": 0}


def test_sentinel_checks_the_gradients_of_the_optimizer_about_to_step():
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    encoder, head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    model = torch.nn.Sequential(encoder, head)
    opt_encoder = torch.optim.SGD(encoder.parameters(), lr=0.1)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.1)
    sentinel = Sentinel(model, [opt_encoder, opt_head])
    x = torch.randn(4, 3)
    model(x).sum().backward()
    head.weight.grad[0, 1] = float("nan")      # only the head's gradient is bad
    sentinel.micro_batch(x, torch.tensor(1.0))
    sentinel.check_update(0, optimizer=opt_encoder)     # the encoder's gradients are finite
    opt_encoder.step()
    with pytest.raises(NonFiniteError) as raised:
        sentinel.check_update(0, optimizer=opt_head)
    f = raised.value.report.finding
    assert (f.step, f.where, f.cause) == (0, "backward", "unknown")
    assert "loss_fn=" in f.explanation


def test_sentinel_blames_the_update_after_the_last_passing_check():
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e38)     # the update overflows
    sentinel = Sentinel(model, optimizer)
    x = torch.randn(4, 3) * 1e3
    with pytest.raises(NonFiniteError) as raised:
        for step in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            sentinel.check(10 + step, x, loss)
            optimizer.step()
            optimizer.zero_grad()
    f = raised.value.report.finding
    assert (f.step, f.where, f.cause) == (10, "optimizer", "optimizer-update")
    assert "SGD.step()" in f.explanation


SENTINEL_CASE = """
import dataclasses

import torch


@dataclasses.dataclass
class Clips:
    audio: torch.Tensor
    target: torch.Tensor
    names: list


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3),
                               torch.nn.Linear(8, 1))


def compute_loss(model, batch):
    return torch.log(model(batch.audio).abs() * batch.target).mean()   # log(0): target 0


def clips(step, poisoned=None):
    g = torch.Generator().manual_seed(step)
    target = torch.rand(6, 1, generator=g) + 0.5
    if poisoned is not None:
        target[poisoned] = 0.0
    return Clips(torch.randn(6, 3, generator=g), target,
                 [f"clip_{step}_{row}.wav" for row in range(6)])
"""


def _sentinel_bundle(tmp_path, monkeypatch, loss_fn=None):
    """A hand-written loop with Sentinel(output_dir=...): dataclass batches with file names,
    a zero target in row 2 of step 3. Returns (finding, bundle folder)."""
    from nanaudit import NonFiniteError, Sentinel
    project = tmp_path / "project"
    project.mkdir()
    (project / "sentinel_case.py").write_text(SENTINEL_CASE)
    monkeypatch.syspath_prepend(str(project))
    import sentinel_case
    model = sentinel_case.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = loss_fn or sentinel_case.compute_loss
    sentinel = Sentinel(model, optimizer, loss_fn=loss_fn, output_dir=tmp_path / "out")
    with pytest.raises(NonFiniteError) as raised:
        for step in range(6):
            batch = sentinel_case.clips(step, poisoned=2 if step == 3 else None)
            loss = loss_fn(model, batch)
            loss.backward()
            sentinel.check(step, batch, loss)
            optimizer.step()
            optimizer.zero_grad()
    monkeypatch.delitem(sys.modules, "sentinel_case")
    return raised.value.report, tmp_path / "out" / "repro-step3"


def test_sentinel_bundle_replays_with_a_model_factory(tmp_path, monkeypatch):
    from helpers import BLOCK_NANAUDIT, run_cli
    report, bundle = _sentinel_bundle(tmp_path, monkeypatch)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        3, "forward", "aten.log.default", "log-domain", [2])
    assert f.sample_rows[0].values == (("batch.names", "clip_3_2.wav"),)
    assert report.repro == str(bundle)
    assert json.loads((tmp_path / "out" / "nanaudit.json").read_text())["repro"] == str(bundle)
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["loss"] == "sentinel_case:compute_loss"
    assert meta["batch_structure"]["type"] == "sentinel_case:Clips"
    # torch.nn.Sequential(*args): the bundle cannot know the layers; it says what to pass.
    refused = run_cli("replay", bundle)
    assert refused.code == 2
    assert "constructor takes arguments (*args)" in refused.stderr and "--model" in refused.stderr
    # With the factory: the dataclass batch is rebuilt (the loss reads batch.audio), Dropout
    # draws the same mask, and the same op, row and file name come out.
    out = tmp_path / "replay.json"
    os.chdir(tmp_path / "project")
    replayed = run_cli("replay", bundle, "--model", "sentinel_case:build_model", "--json", out,
                       "-q")
    assert replayed.code == 1, replayed.stderr
    again = json.loads(out.read_text())["finding"]
    assert (again["step"], again["where"], again["op"], again["cause"], again["samples"]) == (
        3, "forward", "aten.log.default", "log-domain", [2])
    assert again["module"] == "sentinel_case:compute_loss"
    assert again["sample_rows"][0]["values"] == [["batch.names", "clip_3_2.wav"]]
    proc = subprocess.run([sys.executable, "-c", BLOCK_NANAUDIT, "--model",
                           "sentinel_case:build_model", "--rows"], cwd=bundle,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "non-finite loss" in proc.stdout


def test_sentinel_bundle_with_a_loss_defined_in_a_function_asks_for_it(tmp_path, monkeypatch):
    from helpers import run_cli

    def local_loss(model, batch):
        return torch.log(model(batch.audio).abs() * batch.target).mean()
    _, bundle = _sentinel_bundle(tmp_path, monkeypatch, loss_fn=local_loss)
    refused = run_cli("replay", bundle, "--model", "sentinel_case:build_model")
    assert refused.code == 2
    assert "defined inside a function" in refused.stderr and "--loss" in refused.stderr


@pytest.mark.parametrize("backoff, floor, collapses", [
    (0.25, 1.5, True),      # 4 * 0.25 = 1 < 1.5, though 4 * 0.5 = 2 is not
    (0.9, 3.0, False),      # 4 * 0.9 = 3.6 >= 3, though 4 * 0.5 = 2 is not
])
def test_sentinel_decides_a_scale_collapse_by_the_scalers_own_backoff(backoff, floor, collapses):
    from nanaudit import NonFiniteError, Sentinel
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, backoff_factor=backoff)
    sentinel = Sentinel(model, optimizer, scaler=scaler, scale_floor=floor, max_skipped=100)
    batch = torch.randn(4, 3)
    loss = model(batch).pow(2).mean()
    scaler.scale(loss).backward()
    with torch.no_grad():
        model.weight.grad[0, 0] = float("inf")     # an overflowed gradient: the scaler skips
    if collapses:
        with pytest.raises(NonFiniteError):
            sentinel.check(0, batch, loss)
        trip, _ = sentinel.tripped
        assert trip.check == "gradient"
        assert f"fell to {4.0 * backoff:g}, below scale_floor {floor:g}" in trip.note
    else:
        sentinel.check(0, batch, loss)              # AMP's normal course: a skipped step
        assert sentinel.skipped == 1 and sentinel.timeline[-1].skipped
