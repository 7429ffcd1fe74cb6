"""Hugging Face Trainer: NanauditCallback on tiny models built from configs (no downloads)."""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

from helpers import run_cli  # noqa: E402

from nanaudit import NonFiniteError  # noqa: E402
from nanaudit.integrations.transformers import NanauditCallback  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """The Trainer's accelerator state is process-wide; no test leaves its own behind."""
    yield
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Rows(torch.utils.data.Dataset):
    """Token rows with a float target per row (regression on log-scale targets)."""

    def __init__(self, n=64, length=12, zero_target=None, nan_target=None):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (n, length), generator=g)
        self.y = torch.rand(n, generator=g) + 0.5
        if zero_target is not None:
            self.y[zero_target] = 0.0
        if nan_target is not None:
            self.y[nan_target] = float("nan")

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.y[i]}


def log_target_loss(outputs, labels, num_items_in_batch=None):
    # The model predicts log(y): log(0) for a zero target.
    return ((outputs.logits.squeeze(-1) - torch.log(labels)) ** 2).mean()


def _bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=32, num_labels=1)
    return transformers.BertForSequenceClassification(config)


def _args(tmp_path, **kwargs):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=6,
                report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                disable_tqdm=True, train_sampling_strategy="sequential")
    base.update(kwargs)
    return transformers.TrainingArguments(**base)


def test_trainer_log_zero_in_an_accumulated_micro_batch(tmp_path):
    callback = NanauditCallback(echo=False)
    trainer = transformers.Trainer(
        model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1.0,
                                  lr_scheduler_type="linear"),
        train_dataset=Rows(zero_target=21), compute_loss_func=log_target_loss,
        callbacks=[callback])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(NonFiniteError) as raised:
        trainer.train()
    f = raised.value.report.finding
    # Row 21 is row 1 of batch 5 (rows 20..23): micro-batch 1 of optimizer step 2.
    assert (f.step, f.batch_index, f.micro_batch, f.where, f.op, f.cause, f.samples) == (
        2, 5, 1, "forward", "aten.log.default", "log-domain", [1])
    assert f.source.function == "log_target_loss" and f.reproduced is True
    assert trainer.state.global_step == 2
    after = dict(trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in after.values()), "stopped before the update"
    assert not torch.equal(before["classifier.weight"], after["classifier.weight"])
    folder = tmp_path / "nanaudit"
    body = json.loads((folder / "nanaudit.json").read_text())
    assert body["finding"]["cause"] == "log-domain" and body["finding"]["batch_index"] == 5
    assert body["config"]["gradient_accumulation_steps"] == 2
    assert "log-domain" in (folder / "nanaudit.md").read_text()
    bundle = folder / "repro-step2"
    assert sorted(p.name for p in bundle.iterdir()) == [
        "batch.pt", "meta.json", "nanaudit-bundle.json", "report.json", "repro.py", "rng.pt",
        "rows.pt", "state.pt"]
    assert body["repro"] == str(bundle)
    rows = torch.load(bundle / "rows.pt", weights_only=True)
    assert rows["labels"].tolist() == [0.0]
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["model_class"] == "BertForSequenceClassification"
    assert (meta["model_recipe"]["kind"], meta["loss_recipe"]["compute_loss_func"]) == (
        "transformers", "test_transformers:log_target_loss")
    assert "compute_loss" not in trainer.__dict__, "the wrap is removed after training"
    # The bundle alone (no Trainer): the model from its class and config, the Trainer's loss.
    out = tmp_path / "replay.json"
    replayed = run_cli("replay", bundle, "--json", out, "-q")
    assert replayed.code == 1, replayed.stderr
    again = json.loads(out.read_text())["finding"]
    assert (again["step"], again["where"], again["op"], again["cause"], again["samples"]) == (
        2, "forward", "aten.log.default", "log-domain", [1])
    assert again["source"]["function"] == "log_target_loss"
    assert again["module"] == "Trainer.compute_loss"


def test_trainer_torch_compile_is_audited_in_the_users_names(tmp_path):
    callback = NanauditCallback(echo=False)
    trainer = transformers.Trainer(
        # aot_eager: the Trainer's compile path without inductor's cold C++ builds in CI.
        model=_bert(), args=_args(tmp_path, torch_compile=True,
                                  torch_compile_backend="aot_eager"),
        train_dataset=Rows(zero_target=21), compute_loss_func=log_target_loss,
        callbacks=[callback])
    with pytest.raises(NonFiniteError) as raised:
        trainer.train()
    f = raised.value.report.finding
    # Row 21 is row 1 of batch 5; the compiled model, replayed eagerly, names the user's op.
    assert (f.step, f.where, f.op, f.cause, f.samples) == (
        5, "forward", "aten.log.default", "log-domain", [1])
    assert f.source.function == "log_target_loss" and f.reproduced is True
    assert (f.compiled.backend, f.compiled.outcome) == ("aot_eager", "eager")
    body = (tmp_path / "nanaudit" / "nanaudit.json").read_text()
    assert "_orig_mod" not in body and json.loads(body)["finding"]["compiled"]["outcome"] == "eager"
    state = torch.load(tmp_path / "nanaudit" / "repro-step5" / "state.pt", weights_only=True)
    assert "classifier.weight" in state["model"]


def test_trainer_stop_mode_ends_training_on_a_poisoned_sample(tmp_path):
    callback = NanauditCallback(echo=False, on_finding="stop")
    trainer = transformers.Trainer(
        model=_bert(), args=_args(tmp_path, max_grad_norm=1.0),
        train_dataset=Rows(nan_target=14), compute_loss_func=log_target_loss,
        callbacks=[callback])
    trainer.train()                            # returns: training stopped, no exception
    f = callback.report.finding
    assert (f.step, f.batch_index, f.where, f.tensor, f.samples, f.cause) == (
        3, 3, "input", 'batch["labels"]', [2], "nonfinite-input")
    assert callback.exit_code == 1 and trainer.state.global_step == 4
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2)
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    """Causal LM rows with -100 label padding at the end of each row."""

    def __init__(self, n=48, length=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[-(i % 5) - 1:] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def test_gpt2_bf16_accumulation_cosine_schedule_stays_clean(tmp_path):
    callback = NanauditCallback(echo=False)
    trainer = transformers.Trainer(
        model=_gpt2(), args=_args(tmp_path, bf16=True, gradient_accumulation_steps=3,
                                  max_steps=4, lr_scheduler_type="cosine",
                                  learning_rate=1e-3),
        train_dataset=Tokens(), callbacks=[callback])
    trainer.train()
    assert callback.report is None and callback.exit_code == 0
    assert callback.sentinel.steps_checked == 4
    timeline = callback.sentinel.timeline
    assert all(math.isfinite(e.loss) and math.isfinite(e.grad_norm) for e in timeline)
    assert timeline[0].lr > timeline[-1].lr, "the cosine schedule shows in the timeline"
    body = json.loads((tmp_path / "nanaudit" / "nanaudit.json").read_text())
    assert body["status"] == "clean" and body["steps_run"] == 4


def test_gpt2_bf16_poisoned_embedding_row_is_named(tmp_path):
    """A NaN planted in one embedding row: every sequence using that token goes bad, and the
    finding names the embedding weight before any update (not a transient)."""
    model = _gpt2()
    with torch.no_grad():
        model.transformer.wte.weight[7, 3] = float("nan")
    callback = NanauditCallback(echo=False)
    trainer = transformers.Trainer(
        model=model, args=_args(tmp_path, bf16=True, gradient_accumulation_steps=2),
        train_dataset=Tokens(), callbacks=[callback])
    with pytest.raises(NonFiniteError) as raised:
        trainer.train()
    f = raised.value.report.finding
    assert (f.step, f.where, f.tensor, f.cause) == (
        0, "parameter", "transformer.wte.weight", "nonfinite-parameter")


def _emulate_fp16_on_cpu(trainer, init_scale):
    """What `fp16=True` sets up on a GPU, on the CPU: accelerate runs fp16 there without
    autocast or GradScaler, so give its accelerator both before train() prepares the model
    and optimizer (CPU autocast does float16)."""
    accelerator = trainer.accelerator
    accelerator.state._mixed_precision = "fp16"
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return accelerator.scaler


def test_fp16_grad_scaler_skips_are_not_findings_but_a_later_log_zero_is(tmp_path):
    callback = NanauditCallback(echo=False)
    trainer = transformers.Trainer(
        model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1.0,
                                  max_steps=8),
        train_dataset=Rows(zero_target=53), compute_loss_func=log_target_loss,
        callbacks=[callback])
    scaler = _emulate_fp16_on_cpu(trainer, init_scale=2.0 ** 30)
    with pytest.raises(NonFiniteError) as raised:
        trainer.train()
    assert callback.sentinel.scaler is scaler
    timeline = raised.value.report.timeline
    # 2**30 overflows float16 gradients: the first steps are skipped and back the scale off.
    assert timeline[0].skipped and timeline[0].scale == 2.0 ** 30
    assert timeline[1].scale == 2.0 ** 29
    f = raised.value.report.finding
    # Row 53: batch 13 (rows 52..55), row 1: micro-batch 1 of optimizer step 6.
    assert (f.step, f.batch_index, f.micro_batch, f.op, f.cause, f.samples) == (
        6, 13, 1, "aten.log.default", "log-domain", [1])


def test_bench_trainer_quick_writes_ratios_and_own_time(tmp_path, capsys, monkeypatch):
    import importlib
    import sys

    from helpers import ROOT
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    bench = importlib.import_module("bench_trainer")
    out = tmp_path / "bench.json"
    bench.main(["--quick", "--json", str(out)])         # in-process: no second import of torch
    assert "median optimizer-step time ratio to no callback" in capsys.readouterr().out
    body = json.loads(out.read_text())
    variants = {"Trainer": {"plain", "nanaudit", "debug=underflow_overflow"},
                "Lightning": {"plain", "nanaudit"}}
    for result in body["results"]:
        assert set(result["ratio"]) == variants[result["workload"]]
        assert result["ratio"]["plain"] == 1.0 and result["own_s_per_step"] > 0
        assert all(len(v) == result["rounds"] * result["steps"]
                   for v in result["raw_step_s"].values())
    from nanaudit.integrations.sentinel import Sentinel
    assert not hasattr(Sentinel.check_update, "__wrapped__") and (
        Sentinel.check_update.__name__ == "check_update"), "the timing wrappers are removed"
    sys.modules.pop("bench_trainer", None)


class _Watch(transformers.TrainerCallback):
    """The weights before and after each optimizer step, and the learning rate it used."""

    def __init__(self):
        self.before: dict = {}
        self.after: dict = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before[state.global_step] = {n: p.detach().clone()
                                          for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step - 1] = {n: p.detach().clone()
                                             for n, p in model.named_parameters()}


def test_trainer_skips_a_bad_step_and_trains_on(tmp_path):
    # Row 21 (a zero target: log(0)) is row 1 of batch 5, micro-batch 1 of optimizer step 2.
    callback, watch = NanauditCallback(echo=False, on_finding="skip"), _Watch()
    trainer = transformers.Trainer(
        model=_bert(), args=_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1.0,
                                  lr_scheduler_type="linear"),
        train_dataset=Rows(zero_target=21), compute_loss_func=log_target_loss,
        callbacks=[callback, watch])
    trainer.train()                                   # no raise: it went on
    assert trainer.state.global_step == 6
    # The skipped step changed no weight; the steps around it did.
    for name, value in watch.before[2].items():
        assert torch.equal(value, watch.after[2][name]), name
    assert not torch.equal(watch.before[3]["classifier.weight"],
                           watch.after[3]["classifier.weight"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # AdamW stepped 5 times of 6; the scheduler was not stepped for the skipped step.
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {5}
    assert trainer.lr_scheduler.last_epoch == 5
    report = callback.report
    assert callback.exit_code == 1 and report.status == "nonfinite"
    (f,) = report.findings
    assert (f.step, f.batch_index, f.micro_batch, f.op, f.cause, f.action) == (
        2, 5, 1, "aten.log.default", "log-domain", "skipped")
    body = json.loads((tmp_path / "nanaudit" / "nanaudit.json").read_text())
    assert [g["step"] for g in body["findings"]] == [2]
    assert "compute_loss" not in trainer.__dict__
    from nanaudit.integrations.held_step import HeldStep
    step = trainer.optimizer.__dict__.get("step")
    assert not isinstance(getattr(step, "__self__", None), HeldStep), "its own step is back"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (fp16 training)")
def test_trainer_fp16_on_cuda_skips_a_bad_step_and_the_scaler_trains_on(tmp_path):
    # The Trainer's own fp16 GradScaler (CUDA): the skipped step is marked to the scaler as an
    # overflow, so its `update()` runs; the weights do not move on that step, the run goes on.
    callback, watch = NanauditCallback(echo=False, on_finding="skip"), _Watch()
    trainer = transformers.Trainer(
        model=_bert(), args=_args(tmp_path, use_cpu=False, fp16=True, max_grad_norm=1.0),
        train_dataset=Rows(zero_target=9), compute_loss_func=log_target_loss,
        callbacks=[callback, watch])
    trainer.train()
    assert trainer.state.global_step == 6
    for name, value in watch.before[2].items():       # row 9: row 1 of batch 2 (rows 8..11)
        assert torch.equal(value, watch.after[2][name]), name
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    scaler = trainer.accelerator.scaler
    assert scaler is not None and 0 < scaler.get_scale() < float("inf")
    (f,) = callback.report.findings
    assert (f.step, f.batch_index, f.op, f.cause, f.action) == (
        2, 2, "aten.log.default", "log-domain", "skipped")
