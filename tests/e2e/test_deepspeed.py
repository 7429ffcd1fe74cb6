"""DeepSpeed ZeRO under torchrun, two ranks on gloo (CPU): `nanaudit run` on an unmodified
DeepSpeed loop (`deepspeed.initialize`, `engine.backward`, `engine.step`) with a backward-only
value planted on rank 1. DeepSpeed all-reduces one overflow flag and skips the step ("OVERFLOW!
Skipping step", in fp32 too) without calling the torch optimizer: the step is a finding, and
the rank whose own backward made the value is named with the op, module, line and row.

Needs deepspeed (`pip install deepspeed --no-deps` and its small dependencies: einops hjson
msgpack ninja psutil py-cpuinfo pydantic tqdm; never a torch). Its first run on a machine
builds DeepSpeed's shared-memory comm op (minutes; cached under ~/.cache/torch_extensions).
"""

import json
import math
import sys

import pytest
import torch
from helpers import ROOT, launch_ranks

pytest.importorskip("deepspeed", reason="deepspeed is not installed (see the module docstring)")
pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPTS = ROOT / "configs" / "examples" / "scripts"
SCRIPT = SCRIPTS / "deepspeed_faults.py"
MODEL = SCRIPTS / "fsdp_faults.py"


def run(tmp_path, *script_args):
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, SCRIPT,
                                   *script_args], timeout_s=420)
    text = "".join(o + e for o, e in outputs)
    if "deepspeed_shm_comm" in text and "Error building extension" in text:
        pytest.skip("DeepSpeed could not build its shared-memory comm op on this machine")
    reports = [json.loads(path.read_text()) if path.exists() else None
               for path in (out, tmp_path / "report.rank1.json")]
    return codes, reports, outputs


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(MODEL.read_text().splitlines(), 1) if text in line)


# ZeRO-3 with --sub-group-size 30 splits each rank's 77-element partition into three
# sub-groups (32 | 4 + 32 | 4 + 4 + 1), so DeepSpeed steps its torch optimizer three times per
# engine step; --steps 3 makes the skipped step the last one.
SUB_GROUPS = ("--stage", "3", "--sub-group-size", "30")


@pytest.mark.parametrize("setup", [("--stage", "1"), ("--stage", "2"), ("--stage", "3"),
                                   (*SUB_GROUPS, "--steps", "3")],
                         ids=["zero1", "zero2", "zero3", "zero3-sub-groups-last-step"])
def test_backward_only_value_under_zero_is_named_on_its_rank(tmp_path, setup):
    # Every loss is finite; DeepSpeed reduces the NaN into both ranks' partitions, finds the
    # overflow and skips step 2: before this, nanaudit reported a clean run with exit 0. Under
    # ZeRO-3 the skipped step was not checked at all (its torch optimizer's groups are empty
    # outside DeepSpeed's step): caught at step 3's check, so a skip at the last step ended in
    # a clean run, exit 0; with sub-groups, each of the three torch steps counted as a step.
    codes, (rank0, rank1), outputs = run(tmp_path, *setup, "--fault", "backward")
    assert codes == [1, 1], outputs
    for report in (rank0, rank1):
        f = report["finding"]
        assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
            1, 2, "backward", "aten.sqrt.default", "sqrt-domain", [5])
        assert f["module"].endswith("length")
        assert f["source"]["line"] == line_of("return torch.sqrt(")
        assert [(r["rank"], r["status"]) for r in report["distributed"]["ranks"]] == [
            (0, "nonfinite"), (1, "nonfinite")]
        # ZeRO-1/2: rank 1 replays its step on the engine's module, in-process (a re-run of
        # the script took 50 to 70 s here, DeepSpeed's start-up included); ZeRO-3's forward
        # gathers the partitions: the re-run, and the report says why.
        replay = report["run"]["replay"]
        if "3" in setup:
            assert f["localized_by"] == "re-run" and "ZeRO-3" in replay["note"], replay
        else:
            assert (f["localized_by"], replay["status"]) == ("in-process", "reproduced")
            assert report["run"].get("rerun") is None


def test_keep_going_under_zero2_skips_and_names_each_bad_step_in_process(tmp_path):
    # Before: the skipped step was not named (no in-process replay under ZeRO, and a step the
    # run went on from is never re-run), and it was no step: DeepSpeed's own overflow skip
    # left it uncounted, so the steps after it took its number (the timeline read 0 1 2 2 3).
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--keep-going", "--json", out,
                                   SCRIPT, "--stage", "2", "--fault", "backward"],
                                  timeout_s=420)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    f = report["finding"]
    assert (f["localized_by"], f["rank"], f["step"], f["forward_op"], f["cause"],
            f["samples"], f["action"]) == ("in-process", 1, 2, "aten.sqrt.default",
                                           "sqrt-domain", [5], "skipped")
    assert [(e["step"], e.get("bad")) for e in report["timeline"]] == [
        (0, None), (1, None), (2, "skipped"), (3, None), (4, None)]


def partition_norm(rank: int, world: int = 2) -> float:
    """The norm of `rank`'s ZeRO-3 partition of the script's initial weights (each parameter
    split into equal parts, the last padded; the padding is no weight)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        from fsdp_faults import Model
    finally:
        sys.path.remove(str(SCRIPTS))
    torch.manual_seed(0)                        # as deepspeed_faults.py builds it
    parts = []
    for p in Model().parameters():
        flat = p.detach().reshape(-1)
        size = math.ceil(flat.numel() / world)
        parts.append(flat[rank * size:(rank + 1) * size])
    return torch.linalg.vector_norm(torch.cat(parts)).item()


def test_zero3_sub_groups_are_one_step_with_one_check(tmp_path):
    # DeepSpeed steps the torch optimizer once per sub-group: before, each was a nanaudit step
    # (15 steps for 5, 15 timeline entries), each check reading one sub-group's weights. Now
    # one check per engine step, whose weights' norm is the whole partition of every sub-group.
    codes, reports, outputs = run(tmp_path, *SUB_GROUPS, "--fault", "none")
    assert codes == [0, 0], outputs
    for rank, report in enumerate(reports):
        assert report["status"] == "clean"
        assert [(r["status"], r["steps_run"]) for r in report["distributed"]["ranks"]] == [
            ("clean", 5), ("clean", 5)]
        assert [entry["step"] for entry in report["timeline"]] == [0, 1, 2, 3, 4]
        assert report["timeline"][0]["param_norm"] == pytest.approx(partition_norm(rank),
                                                                    rel=1e-6)


def test_clean_zero1_run_stays_clean(tmp_path):
    codes, (rank0, rank1), outputs = run(tmp_path, "--stage", "1", "--fault", "none")
    assert codes == [0, 0], outputs
    assert [(r["status"], r["steps_run"]) for r in rank0["distributed"]["ranks"]] == [
        ("clean", 5), ("clean", 5)]
    assert rank1["status"] == "clean"


TRAINER = SCRIPTS / "trainer_deepspeed.py"


def test_trainer_with_a_deepspeed_config_names_the_rank(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, TRAINER,
                                   "--fault", "backward"], timeout_s=420)
    assert codes == [1, 1], outputs
    assert "deepspeed_shm_comm_op" in "".join(e for _, e in outputs) + "".join(
        o for o, _ in outputs)                       # DeepSpeed's engine ran, not plain DDP
    f = json.loads(out.read_text())["finding"]
    lines = TRAINER.read_text().splitlines()
    assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        1, 0, "backward", "aten.sqrt.default", "sqrt-domain", [1])
    assert lines[f["source"]["line"] - 1].strip().startswith("length = torch.sqrt(")


def test_trainer_with_its_own_two_param_groups_names_a_later_step(tmp_path):
    # The Trainer builds AdamW with decay / no-decay groups when the DeepSpeed config names no
    # optimizer; row 52 reaches rank 1 at step 2. Before: every step after 0 was numbered
    # twice (each group's torch step counted), so the value was reported at step 4.
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, TRAINER,
                                   "--fault", "backward", "--poison-row", "52",
                                   "--trainer-optimizer"], timeout_s=420)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    f = report["finding"]
    lines = TRAINER.read_text().splitlines()
    assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        1, 2, "backward", "aten.sqrt.default", "sqrt-domain", [1])
    assert lines[f["source"]["line"] - 1].strip().startswith("length = torch.sqrt(")
    assert [entry["step"] for entry in report["timeline"]] == [0, 1, 2]

ACCELERATE = SCRIPTS / "accelerate_cpu_deepspeed.py"


def test_accelerate_on_cpu_dropping_deepspeed_is_said_not_pretended(tmp_path):
    # Accelerator(cpu=True, deepspeed_plugin=...) trains with DDP: the run is clean, and the
    # ranks' section says DeepSpeed was asked for and dropped (console and JSON).
    pytest.importorskip("accelerate")
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "--json", out, ACCELERATE],
                                  timeout_s=240)
    assert codes == [0, 0], outputs
    report = json.loads(out.read_text())
    assert report["status"] == "clean"
    note = report["distributed"]["note"]
    assert "DeepSpeed was asked for" in note and "Accelerate dropped DeepSpeed" in note
    assert "not a DeepSpeed engine" in note
    assert "note: DeepSpeed was asked for" in "".join(outputs[0])      # rank 0's console


# Two param groups (decay / no-decay, as the HF Trainer builds them): ZeRO-1/2's `step()` hands
# the torch optimizer one group at a time, so each engine step was two nanaudit steps.
TWO_GROUPS = ("--groups", "2")


@pytest.mark.parametrize("stage", ["1", "2"], ids=["zero1", "zero2"])
def test_two_param_groups_under_zero_are_one_step_each(tmp_path, stage):
    # Before: the timeline read 0..9 for 5 engine steps and each check read one group.
    codes, reports, outputs = run(tmp_path, "--stage", stage, *TWO_GROUPS, "--fault", "none")
    assert codes == [0, 0], outputs
    for report in reports:
        assert report["status"] == "clean"
        assert [entry["step"] for entry in report["timeline"]] == [0, 1, 2, 3, 4]
        assert [(r["status"], r["steps_run"]) for r in report["distributed"]["ranks"]] == [
            ("clean", 5), ("clean", 5)]


@pytest.mark.parametrize("stage", ["1", "2"], ids=["zero1", "zero2"])
def test_backward_only_value_with_two_param_groups_is_named_at_its_engine_step(tmp_path,
                                                                               stage):
    # Before: engine step 2 was reported as step 4 (each group's torch step counted).
    codes, reports, outputs = run(tmp_path, "--stage", stage, *TWO_GROUPS, "--fault",
                                  "backward")
    assert codes == [1, 1], outputs
    for report in reports:
        f = report["finding"]
        assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
            1, 2, "backward", "aten.sqrt.default", "sqrt-domain", [5])
        assert f["module"].endswith("length")
        assert f["source"]["line"] == line_of("return torch.sqrt(")


# fp16 with a dynamic loss scale (initial_scale_power 30): DeepSpeed skips its first 14 steps
# while the scale backs off, as a GradScaler does. On a CPU DeepSpeed refuses fp16 ("Type fp16
# is not supported on your device.": its CPU accelerator asks oneDNN for float16 kernels); the
# script claims the support, so DeepSpeed's own fp16 optimizer and loss scaler run (see it).
FP16 = SCRIPTS / "deepspeed_fp16.py"


def run_fp16(tmp_path, *script_args):
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, FP16,
                                   *script_args], timeout_s=420)
    assert out.exists(), outputs
    return codes, json.loads(out.read_text()), outputs


@pytest.mark.parametrize("stage", ["2", "3"], ids=["zero2", "zero3"])
def test_fp16_calibration_skips_under_zero_are_a_clean_run(tmp_path, stage):
    # Before: the first skip was a finding at step 0 on a healthy run (every rank's own scaled
    # gradients, flagged as autograd made them, overflowed). Now 14 skips, no finding, the 30
    # steps numbered 0..29 as the loop and DeepSpeed's global_steps count them (the first 14
    # skipped), and the timeline's gradient norm the unscaled one (the scale is 2**17 by then:
    # scaled, each norm would be thousands).
    codes, report, outputs = run_fp16(tmp_path, "--stage", stage, "--fault", "none")
    assert codes == [0, 0], outputs
    assert report["status"] == "clean" and report["run"]["first_run"]["skipped"] == 14
    assert [entry["step"] for entry in report["timeline"]] == list(range(30))
    assert [entry["skipped"] for entry in report["timeline"]] == [True] * 14 + [False] * 16
    assert all(0 < entry["grad_norm"] < 10 for entry in report["timeline"][14:])


@pytest.mark.parametrize("stage", ["2", "3"], ids=["zero2", "zero3"])
def test_fp16_forward_value_is_named_at_its_step_after_the_skips(tmp_path, stage):
    codes, report, outputs = run_fp16(tmp_path, "--stage", stage, "--fault", "forward")
    assert codes == [1, 1], outputs
    f = report["finding"]
    assert (f["rank"], f["step"], f["where"], f["cause"], f["samples"]) == (
        1, 20, "forward", "log-domain", [2])        # the loop's step 20, after 14 skips
    assert f["source"]["line"] == line_of("h = torch.log(x)")
    assert report["run"]["first_run"]["skipped"] == 14


def test_fp16_skips_that_never_end_collapse_into_a_finding(tmp_path):
    # The float16 gradients overflow whatever the scale: after 10 skips in a row at a usable
    # scale the collapse is the finding (before DeepSpeed raises at its minimum scale).
    codes, report, outputs = run_fp16(tmp_path, "--fault", "overflow")
    assert codes == [1, 1], outputs
    f = report["finding"]
    # The 25th skip is the step traced (before, all were "tries" of step 0, traced at a scale
    # of 2**30, where loss * scale overflowed float32 already). At the scale of 64 it had then,
    # the float32 gradient of `.float()` is cast back to float16 in backward, past its range.
    assert (f["step"], f["where"], f["cause"], f["op"]) == (
        24, "backward", "dtype-overflow", "aten._to_copy.default")
    assert "DeepSpeed's loss scale collapsed: DeepSpeed skipped 10 steps in a row" in (
        f["explanation"]) and "float16 max is 65504" in f["explanation"]
    assert FP16.read_text().splitlines()[f["source"]["line"] - 1].strip().startswith(
        "loss = engine(x.half(), torch.ones(8, 1).half()).float()")
    assert report["run"]["first_run"]["skipped"] == 25
