"""Lightning: mixed precision (the plugin's GradScaler), accumulation windows, clipping,
schedulers and manual optimization with several optimizers, each with a planted bug."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import BLOCK_NANAUDIT, run_cli

lightning = pytest.importorskip("lightning", reason="the lightning extra is not installed")

from nanaudit import NonFiniteError  # noqa: E402
from nanaudit.integrations.lightning import NanauditCallback  # noqa: E402

pytestmark = pytest.mark.slow


class Regressor(lightning.LightningModule):
    """y ~ exp(layer(x)): the loss is a hand-written log-likelihood, log(0) when a target is 0."""

    def __init__(self, loss="log"):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.loss = loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.layer(x).float()
        if self.loss == "log":
            return (pred - torch.log(y)).pow(2).mean()
        # sqrt(0) is finite, its gradient is not: only the backward goes bad.
        return torch.sqrt(y * (y - 0.5) * pred.pow(2)).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2),
                                 "interval": "step"}}


def _loader(bad_row=None, n=64, batch_size=4, scale=1.0):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g) * scale, torch.rand(n, 1, generator=g) + 0.5
    if bad_row is not None:
        y[bad_row] = 0.0
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=batch_size)


def _trainer(callback, **kwargs):
    return lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[callback], **kwargs)


def _fp16_plugin(init_scale=2.0 ** 16):
    from lightning.pytorch.plugins import MixedPrecision
    # Lightning maps "16-mixed" on CPU to bf16; this is its 16-mixed plugin with a GradScaler.
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu",
                                                                        init_scale=init_scale))


def test_16_mixed_with_accumulation_skips_overflow_but_names_the_bad_micro_batch(tmp_path):
    torch.manual_seed(0)
    callback = NanauditCallback(output_dir=tmp_path, echo=False)
    # Rows 24..27 are batch_idx 6: micro-batch 0 of optimizer step 3 (windows of 2).
    trainer = _trainer(callback, plugins=[_fp16_plugin(init_scale=2.0 ** 40)],
                       accumulate_grad_batches=2, gradient_clip_val=1.0)
    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(Regressor(), _loader(bad_row=25))
    f = raised.value.report.finding
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.op, f.cause, f.samples) == (
        3, 6, 0, "forward", "aten.log.default", "log-domain", [1])
    # 2**40 overflows float16 gradients: the scaler skipped steps, none was a finding.
    assert callback.sentinel.skipped >= 1
    assert trainer.global_step == 3, "stopped before the update of step 3"
    body = json.loads((tmp_path / "nanaudit.json").read_text())
    assert body["finding"]["batch_index"] == 6 and body["finding"]["micro_batch"] == 0
    assert (tmp_path / "nanaudit.md").is_file() and (tmp_path / "nanaudit.txt").is_file()
    rows = torch.load(tmp_path / "repro-step3" / "rows.pt", weights_only=True)
    assert float(rows[1][0]) == 0.0
    # Replayed without the Trainer: Regressor(loss=...) was built with arguments nobody
    # recorded, so the bundle asks for a factory (exit 2) ...
    bundle = tmp_path / "repro-step3"
    refused = run_cli("replay", bundle)
    assert refused.code == 2
    assert "constructor takes arguments (loss)" in refused.stderr
    assert "--model" in refused.stderr and "save_hyperparameters" in refused.stderr
    # ... and with one, training_step under the 16-mixed autocast at the step's loss scale
    # names the same op and row.
    out = tmp_path / "replay.json"
    assert run_cli("replay", bundle, "--model", "test_lightning:Regressor", "--json", out,
                   "-q").code == 1
    again = json.loads(out.read_text())["finding"]
    assert (again["step"], again["where"], again["op"], again["cause"], again["samples"]) == (
        3, "forward", "aten.log.default", "log-domain", [1])
    assert again["module"] == "test_lightning:Regressor.training_step"


SAVED_REGRESSOR = """
import lightning
import torch


class SavedRegressor(lightning.LightningModule):
    # Records its constructor's arguments, as Lightning's checkpoints need.

    def __init__(self, loss="log"):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.layer(x)
        if self.hparams.loss == "log":
            return (pred - torch.log(y)).pow(2).mean()
        return torch.sqrt(y * (y - 0.5) * pred.pow(2)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""


def test_a_bundle_of_a_module_with_saved_hyperparameters_replays_alone(tmp_path, monkeypatch):
    project = tmp_path / "project"          # the user's code, importable as in their run
    project.mkdir()
    (project / "saved_regressor.py").write_text(SAVED_REGRESSOR)
    monkeypatch.syspath_prepend(str(project))
    from saved_regressor import SavedRegressor
    torch.manual_seed(0)
    callback = NanauditCallback(output_dir=tmp_path, echo=False)
    with pytest.raises(NonFiniteError) as raised:
        _trainer(callback).fit(SavedRegressor(loss="sqrt"), _loader(bad_row=9))
    monkeypatch.delitem(sys.modules, "saved_regressor")
    f = raised.value.report.finding
    assert (f.step, f.where, f.cause, f.samples) == (2, "backward", "sqrt-domain", [1])
    bundle = tmp_path / "repro-step2"
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["model_recipe"]["hparams"] == {"loss": "sqrt"}
    out = tmp_path / "replay.json"
    assert run_cli("replay", bundle, "--json", out, "-q").code == 1
    again = json.loads(out.read_text())["finding"]
    for key in ("step", "where", "op", "forward_op", "cause", "samples", "module"):
        assert again[key] == getattr(f, key), key
    # repro.py: plain PyTorch and Lightning, no nanaudit, from the bundle's folder.
    proc = subprocess.run([sys.executable, "-c", BLOCK_NANAUDIT], cwd=bundle,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "non-finite gradient of layer.weight" in proc.stdout


def test_accumulation_gradient_bug_in_an_early_micro_batch_is_reproduced():
    torch.manual_seed(0)
    callback = NanauditCallback(echo=False)
    # Row 13 is batch_idx 3: micro-batch 0 of optimizer step 1 (windows of 3).
    trainer = _trainer(callback, accumulate_grad_batches=3)
    with pytest.raises(NonFiniteError) as raised:
        trainer.fit(Regressor(loss="sqrt"), _loader(bad_row=13))
    f = raised.value.report.finding
    assert f.reproduced is True, f.explanation
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.cause, f.samples) == (
        1, 3, 0, "backward", "sqrt-domain", [1])
    assert "non-deterministic" not in f.explanation


def test_fp16_overflow_collapses_the_scale_and_names_the_op():
    torch.manual_seed(0)
    callback = NanauditCallback(echo=False, max_skipped=3)
    trainer = _trainer(callback, plugins=[_fp16_plugin()], accumulate_grad_batches=2)
    with pytest.raises(NonFiniteError) as raised:
        # Unnormalized inputs (|x| ~ 1e4): x^T dL/dy overflows float16 whatever the scale.
        trainer.fit(Regressor(), _loader(scale=1e4))
    f = raised.value.report.finding
    # Every step overflowed: 3 skips in a row (max_skipped) make the finding, replayed at the
    # step's loss scale. The infinity is made where the scaled float32 gradient of the loss is
    # cast back to float16 (autocast's copy, in backward), before `layer`'s matmul turns it
    # into NaN: the walk back names the cast in the user's training_step, not the matmul.
    assert (f.step, f.where, f.op, f.reproduced) == (2, "backward", "aten._to_copy.default", True)
    assert f.module == f"{Regressor.__module__}:Regressor.training_step"
    assert f.cause == "dtype-overflow" and "float16 holds at most 65504" in f.explanation
    assert "reached mm in layer" in f.explanation
    assert "skipped 3 steps in a row" in f.explanation
    timeline = raised.value.report.timeline
    assert [e.skipped for e in timeline] == [True, True, True]
    assert [e.scale for e in timeline] == [65536.0, 32768.0, 16384.0]


def test_bf16_mixed_accumulation_clip_and_scheduler_stay_clean():
    torch.manual_seed(0)
    callback = NanauditCallback(echo=False)
    trainer = _trainer(callback, precision="bf16-mixed", accumulate_grad_batches=2,
                       gradient_clip_val=0.5)
    trainer.fit(Regressor(), _loader())
    assert callback.report is None and callback.sentinel.steps_checked == 8
    assert trainer.global_step == 8
    lrs = [e.lr for e in callback.sentinel.timeline]
    assert lrs[0] == 0.01 and lrs[-1] < 0.01, "the StepLR schedule shows in the timeline"


class TwoOptimizers(lightning.LightningModule):
    """Manual optimization: an encoder and a head, each with its own optimizer."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.encoder = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        opt_encoder, opt_head = self.optimizers()
        x, y = batch
        pred = self.head(torch.tanh(self.encoder(x)))
        self.manual_backward(pred.pow(2).mean() * 0.0, retain_graph=True)   # two backwards
        loss = (pred - torch.log(y.abs() + 0.1 * (batch_idx != 5))).pow(2).mean()
        opt_encoder.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_encoder.step()
        opt_head.step()

    def configure_optimizers(self):
        return (torch.optim.SGD(self.encoder.parameters(), lr=0.01),
                torch.optim.Adam(self.head.parameters(), lr=0.01))


def test_manual_optimization_with_two_optimizers_clean_and_poisoned(tmp_path):
    torch.manual_seed(0)
    callback = NanauditCallback(echo=False)
    _trainer(callback).fit(TwoOptimizers(), _loader())
    assert callback.report is None and callback.sentinel.steps_checked == 32

    torch.manual_seed(0)
    callback = NanauditCallback(echo=False)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    x[10, 2] = float("nan")                     # batch_idx 2, row 2
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    with pytest.raises(NonFiniteError) as raised:
        _trainer(callback).fit(TwoOptimizers(), loader)
    f = raised.value.report.finding
    # Two optimizer steps per batch: trainer.global_step counts both.
    assert (f.where, f.batch_index, f.tensor, f.samples, f.cause) == (
        "input", 2, "batch[0]", [2], "nonfinite-input")
    assert f.step == 4

    torch.manual_seed(0)
    callback = NanauditCallback(echo=False, output_dir=tmp_path)
    y[22] = 0.0                                 # batch_idx 5, row 2: log(0)
    x[10, 2] = 0.0
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    with pytest.raises(NonFiniteError) as raised:
        _trainer(callback).fit(TwoOptimizers(), loader)
    f = raised.value.report.finding
    # The replay ran training_step with the optimizers disabled and took the second
    # manual_backward's loss, as in the step that tripped.
    assert (f.step, f.batch_index, f.where, f.op, f.cause, f.samples) == (
        10, 5, "forward", "aten.log.default", "log-domain", [2])
    # Without the Trainer, a training_step that steps its optimizers has no loss to replay.
    refused = run_cli("replay", tmp_path / "repro-step10")
    assert refused.code == 2 and "manual optimization" in refused.stderr
    assert "--loss" in refused.stderr


class CompiledRegressor(Regressor):
    """The regressor with a forward, as a module `torch.compile` is given compiles it."""

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.sqrt(y * (y - 0.5) * self(x).pow(2)).mean()


def test_a_compiled_module_is_audited_in_its_own_names():
    torch.manual_seed(0)
    callback = NanauditCallback(echo=False)
    compiled = torch.compile(CompiledRegressor(), backend="aot_eager")
    with pytest.raises(NonFiniteError) as raised:
        _trainer(callback).fit(compiled, _loader(bad_row=13))
    f = raised.value.report.finding
    # Row 13 is batch 3, row 1; sqrt(0) is finite, its gradient is not.
    assert (f.step, f.where, f.cause, f.samples) == (3, "backward", "sqrt-domain", [1])
    assert f.forward_op == "aten.sqrt.default" and f.reproduced is True
    assert f.tensors and not [n for n in f.tensors if "_orig_mod" in n]
    assert "layer.weight" in f.tensors
    assert f.compiled.outcome == "eager" and f.compiled.backend == "aot_eager"


class NormedRegressor(lightning.LightningModule):
    """Regressor's log-likelihood behind a BatchNorm (running statistics a skip must put
    back), with Adam (moments and step counts a skip must leave) and a per-step StepLR."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                       torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.net(x) - torch.log(y)).pow(2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2),
                                 "interval": "step"}}


def test_skip_leaves_the_bad_step_out_and_trains_on(tmp_path):
    # Row 9 has a zero target (log(0)): batch 2 of 16 (rows 8..11).
    model = NormedRegressor()
    callback = NanauditCallback(on_finding="skip", echo=False, output_dir=str(tmp_path))
    trainer = _trainer(callback)
    trainer.fit(model, _loader(bad_row=9))
    assert trainer.global_step == 16                     # went on to the end
    # The same training by hand: no update at batch 2, its BatchNorm statistics put back;
    # the scheduler steps every step, as Lightning runs it.
    ref = NormedRegressor()
    optimizer = torch.optim.Adam(ref.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    for index, batch in enumerate(_loader(bad_row=9)):
        saved = [b.clone() for b in ref.buffers()]
        optimizer.zero_grad()
        ref.training_step(batch, index).backward()
        if index == 2:
            with torch.no_grad():
                for b, s in zip(ref.buffers(), saved):
                    b.copy_(s)
        else:
            optimizer.step()
        scheduler.step()
    for (name, got), (_, want) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(got, want), name
    steps = {int(s["step"]) for s in trainer.optimizers[0].state_dict()["state"].values()}
    assert steps == {15}                                   # one step of 16 skipped
    report = callback.report
    (f,) = report.findings
    assert (f.step, f.batch_index, f.op, f.cause, f.samples, f.action) == (
        2, 2, "aten.log.default", "log-domain", [1], "skipped")
    body = json.loads((tmp_path / "nanaudit.json").read_text())
    assert body["status"] == "nonfinite" and [g["step"] for g in body["findings"]] == [2]


def test_skip_stops_when_skipping_cannot_help():
    model = NormedRegressor()
    callback = NanauditCallback(on_finding="skip", echo=False, max_bad_steps=2)
    loader = _loader(bad_row=0, batch_size=2, n=16)
    loader.dataset.tensors[1][:] = 0.0                   # every target 0: a bad shard
    with pytest.raises(NonFiniteError) as raised:
        _trainer(callback).fit(model, loader)
    report = raised.value.report
    assert [(f.step, f.action) for f in report.findings] == [
        (0, "skipped"), (1, "skipped"), (2, "stopped")]
    assert report.findings[-1].stop_reason == "max-bad-steps"
