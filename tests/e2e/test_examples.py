"""Every config in configs/ runs, and each seed case is localized to its step, op and cause."""


import json
import re

import pytest
from helpers import ROOT, run_cli, scan

EXPECTED = {
    "log_negative": dict(step=3, where="forward", op="aten.log.default", cause="log-domain",
                         samples=[2]),
    "acos_outside": dict(step=1, where="forward", op="aten.acos.default", cause="trig-domain",
                         samples=[4], module=""),
    "sqrt_zero_backward": dict(step=0, where="backward", op="aten.div.Tensor",
                               forward_op="aten.sqrt.default", cause="sqrt-domain", samples=None),
    "exp_overflow_masked": dict(step=0, where="backward", forward_op="aten.exp.default",
                                cause="masked-nonfinite-gradient"),
    "ctc_impossible": dict(step=1, where="forward", op="aten._ctc_loss.Tensor",
                           cause="impossible-ctc-target", samples=[2]),
    "masked_division": dict(step=2, where="backward", op="aten.div.Tensor",
                            forward_op="aten.div.Tensor", cause="masked-nonfinite-gradient"),
    "handwritten_softmax": dict(step=3, where="forward", op="aten.exp.default",
                                cause="exp-overflow", samples=[6]),
    # Issue 29: the batch was made non-finite by the data entrypoint's own division.
    "dirty_mask": dict(step=2, where="input", tensor='batch["mask"]', cause="div-by-zero",
                       op="aten.div.Tensor", samples=[1], value="nan"),
    "div_zero": dict(step=1, where="forward", op="aten.div.Tensor", cause="div-by-zero",
                     samples=[0]),
    "gradient_explosion": dict(where="forward", cause="divergence", samples=None),
    "saturated_bce": dict(step=2, where="forward", op="aten.log.default", cause="log-domain",
                          samples=[3]),
    "no_positives": dict(step=1, where="forward", op="aten.div.Tensor", cause="div-by-zero",
                         samples=None),
    "amp_scale_collapse": dict(step=9, where="backward", op="aten.mm.default",
                               cause="dtype-overflow"),
    "fp16_adam_eps": dict(step=0, where="optimizer", cause="optimizer-update", tensor="weight"),
    "fp16_activation_growth": dict(step=24, where="forward", op="aten.mm.default",
                                   module="proj", cause="dtype-overflow"),
    # Issue 16: follow every infinity to where it was made; causes from the op's mathematics.
    "fp16_ffn_overflow": dict(step=2, where="forward", value="nan", op="aten.addmm.default",
                              module="block.ffn.wo", cause="dtype-overflow", samples=[3]),
    "llama_fp16_massive_activation": dict(step=1, where="forward", value="nan",
                                          op="aten.mm.default",
                                          module="model.layers.0.mlp.down_proj",
                                          cause="dtype-overflow", samples=[2]),
    "softmax_backward_overflow": dict(step=1, where="forward", value="nan",
                                      op="aten.exp.default", module="", cause="exp-overflow",
                                      samples=[5]),
    "learned_temperature": dict(step=2, where="forward", value="nan", op="aten.exp.default",
                                module="", cause="exp-overflow", samples=[9]),
    "nb_dispersion_pole": dict(step=1, where="forward", op="aten.lgamma.default",
                               module="nb_dispersion_pole:loss", cause="pole", samples=[6]),
    "empty_bag_logsumexp": dict(step=2, where="forward", value="nan",
                                op="aten.logsumexp.default", module="",
                                cause="softmax-all-masked", samples=[4]),
    "numpy_function": dict(step=1, where="forward", value="inf", module="", cause="unknown",
                           samples=[2]),
    "gem_negative_base": dict(step=0, where="forward", value="nan", op="aten.pow.Tensor_Tensor",
                              module="pool", cause="sqrt-domain", samples=None),
    # Issue 15: a custom autograd.Function's hand-written backward divides by zero.
    "custom_backward": dict(step=2, where="backward", value="nan", op="aten.div.Tensor",
                            forward_op="autograd.Function SafeLog",
                            module="custom_backward:loss", cause="div-by-zero", samples=[3]),
    # Issue 15: log(0) of a silent clip before a BatchNorm in train mode.
    "batchnorm_log_silence": dict(step=2, batch_index=2, where="forward", value="nan",
                                  op="aten.log.default", module="", cause="log-domain",
                                  samples=[5]),
    # Issue 15: the batch types and layers of real training code.
    "userdict_masked_mean": dict(step=3, where="forward", value="nan", op="aten.div.Tensor",
                                 module="pool", cause="div-by-zero", samples=[4]),
    "dataclass_string_ids": dict(step=2, where="forward", value="nan", op="aten.log.default",
                                 module="frontend", cause="log-domain", samples=[5]),
    "sparse_embedding": dict(step=2, where="backward", value="nan", op="aten.div.Tensor",
                             forward_op="aten.sqrt.default", module="", tensor="users.weight",
                             cause="sqrt-domain", samples=[6]),
}
CLEAN = {"atan2_origin", "amp_fp16_clean", "amp_bf16_clean", "custom_backward_clean",
         "batchnorm_log_silence_clean", "userdict_masked_mean_clean",
         "dataclass_string_ids_clean", "sparse_embedding_clean"}
# Run under two ranks in test_distributed.py (and as one process there too), FSDP in test_fsdp.py.
DISTRIBUTED = {"ddp_clean", "ddp_poisoned_rank", "ddp_failing_rank", "ddp_failing_loss",
               "ddp_stalled_rank", "ddp_backward_nan", "ddp_dataloader", "ddp_auto",
               "ddp_dying_rank", "fsdp_backward_nan", "fsdp_diverging", "hsdp_backward_nan",
               "fsdp_tp_forward_nan", "tp_backward_nan"}
# Scanned with --keep-going: every bad step's (step, where, cause, rows), all skipped.
KEEP_GOING = {"keep_going": [(3, "input", "nonfinite-input", [2]),
                             (5, "backward", "sqrt-domain", [6]),
                             (8, "forward", "log-domain", [1])]}
SHARED_SOURCE = {"llama_fp16_massive_activation": "transformers/models/llama/modeling_llama.py",
                 "amp_scale_collapse": "mixed_precision.py",
                 "fp16_activation_growth": "mixed_precision.py"}


def test_every_example_has_an_expectation():
    from test_setups import SETUPS, SETUPS_CLEAN  # the training-setup examples' own file
    names = {p.stem for p in (ROOT / "configs" / "examples").glob("*.yaml")}
    assert names == set(EXPECTED) | CLEAN | DISTRIBUTED | set(SETUPS) | SETUPS_CLEAN | \
        set(KEEP_GOING)


def test_every_distributed_example_and_example_script_is_run_by_a_test():
    # The sets above only name the multi-process configs and the scripts for `nanaudit run`;
    # the tests that launch them live in other files: each must be named in one.
    here = ROOT / "tests"
    launchers = (here / "e2e" / "test_distributed.py").read_text() + \
        (here / "e2e" / "test_fsdp.py").read_text() + (here / "e2e" / "test_mesh.py").read_text() \
        + (here / "e2e" / "test_mesh_tp_backward.py").read_text()
    # Named as "name.yaml" or as a bare "name" in a parametrize list.
    assert [n for n in sorted(DISTRIBUTED) if f"\"{n}" not in launchers] == []
    sources = "".join(p.read_text() for p in here.rglob("test_*.py")
                      if p.name != "test_examples.py")
    scripts = sorted((ROOT / "configs" / "examples" / "scripts").glob("*.py"))
    assert scripts and [p.name for p in scripts if p.name not in sources] == []


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_is_localized(name, tmp_path):
    result = scan(ROOT / "configs" / "examples" / f"{name}.yaml", tmp_path=tmp_path)
    assert result.code == 1, result.report
    assert result.report["status"] == "nonfinite"
    finding = result.finding
    for key, value in EXPECTED[name].items():
        assert finding[key] == value, (key, finding)
    if finding["where"] in ("forward", "backward"):
        assert finding["reproduced"] is True
        assert finding["source"]["file"].endswith(SHARED_SOURCE.get(name, f"{name}.py"))
        assert finding["source"]["code"]
        assert finding["inputs"], "the creating op's inputs are reported"


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_example(name, tmp_path):
    result = scan(ROOT / "configs" / "examples" / f"{name}.yaml", tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["status"] == "clean" and result.finding is None


def test_demo_names_row_module_op_and_line(tmp_path):
    result = scan(ROOT / "configs" / "demo.yaml", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["forward_op"]) == (
        6, "backward", "aten.div.Tensor", "aten.sqrt.default")
    assert f["module"] == "features" and f["cause"] == "sqrt-domain"
    assert f["samples"] == [5] and f["sample_search"]["replays"] <= 12
    assert "torch.sqrt" in f["source"]["code"]
    assert result.report["steps_run"] == 7 and len(result.report["timeline"]) == 7
    assert result.report["timeline"][-1]["grad_norm"] == "nan"


def test_clean_config_exits_zero(tmp_path):
    result = scan(ROOT / "configs" / "clean.yaml", tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["status"] == "clean"
    assert result.report["steps_run"] == 12
    assert all(isinstance(e["loss"], float) for e in result.report["timeline"])


def test_a_per_sample_file_name_is_shown_beside_its_row(tmp_path):
    result = run_cli("scan", ROOT / "configs" / "examples" / "dataclass_string_ids.yaml",
                     "--json", tmp_path / "report.json", "--no-repro")
    assert result.code == 1
    row = json.loads((tmp_path / "report.json").read_text())["finding"]["sample_rows"][0]
    assert row["index"] == 5 and row["values"] == [["batch.ids", "clip_0021.wav"]]
    assert dict(row["leaves"])["batch.frames"]["zeros"] == 192      # the silent clip
    assert re.search(r'5 │ batch\.ids +│ "clip_0021\.wav"', result.stderr)


def test_rows_without_per_sample_values_keep_the_json_as_it_was(tmp_path):
    result = scan(ROOT / "configs" / "examples" / "userdict_masked_mean.yaml", tmp_path=tmp_path)
    row = result.finding["sample_rows"][0]
    assert sorted(row) == ["index", "leaves"]
    assert dict(row["leaves"])['batch["attention_mask"]']["value"] == [0.0] * 10


@pytest.mark.parametrize("name", sorted(KEEP_GOING))
def test_keep_going_example_skips_every_bad_step(name, tmp_path):
    result = scan(ROOT / "configs" / "examples" / f"{name}.yaml", "--keep-going",
                  tmp_path=tmp_path)
    assert result.code == 1 and result.report["status"] == "nonfinite"
    report = result.report
    assert report["steps_run"] == 12              # trained to the data's end
    assert [(f["step"], f["where"], f["cause"], f["samples"]) for f in report["findings"]] == \
        KEEP_GOING[name]
    assert {f["action"] for f in report["findings"]} == {"skipped"}
    assert report["finding"] == report["findings"][0]
    assert report["bad_steps"]["skipped"] == 3 and report["bad_steps"]["stopped"] is None
