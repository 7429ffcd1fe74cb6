"""FSDP2 (`fully_shard`) under torchrun, two ranks on gloo: `nanaudit run` on an unmodified
script names the rank whose own batch, computation or optimizer-state shard made the value,
with the op, module, line and rows; a clean mixed-precision run stays clean; a dying rank is
exit 8 on its peer, never a hang; `Sentinel` in the user's own FSDP2 loop and `scan` with
`distributed.fsdp` name the same origin on every rank. The faults are planted on rank 1."""

import json

import pytest
from helpers import ROOT, launch_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPTS = ROOT / "configs" / "examples" / "scripts"
SCRIPT = SCRIPTS / "fsdp_faults.py"


def run(tmp_path, *script_args, flags=()):
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", *flags, "--json", out, SCRIPT,
                                   *script_args])
    reports = [json.loads(path.read_text()) if path.exists() else None
               for path in (out, tmp_path / "report.rank1.json")]
    return codes, reports, outputs


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def test_forward_value_names_the_rank_whose_batch_made_it(tmp_path):
    # --rerun: the re-run from the start, every rank together (without it every rank replays
    # the step in-process: test_fsdp_inprocess.py, and the backward case below).
    codes, (rank0, rank1), outputs = run(tmp_path, "--fault", "forward", flags=["--rerun"])
    assert codes == [1, 1], outputs
    f = rank0["finding"]
    assert (f["rank"], f["step"], f["where"], f["op"], f["cause"], f["samples"]) == (
        1, 3, "forward", "aten.log.default", "log-domain", [2])
    assert f["source"]["line"] == line_of("h = torch.log(x)")
    assert rank0["run"]["rerun"]["status"] == "reproduced"
    # Every rank stopped at step 3, before the update, and says so; rank 1's own report too.
    assert [(r["rank"], r["status"], r["steps_run"]) for r in rank0["distributed"]["ranks"]] == [
        (0, "nonfinite", 4), (1, "nonfinite", 4)]
    assert rank1["finding"]["rank"] == 1 and rank1["run"]["rank"] == 1


def test_backward_only_value_names_its_rank_op_module_and_row(tmp_path):
    # Every loss is finite; after the reduce-scatter both ranks' gradient shards hold the NaN.
    codes, (rank0, rank1), outputs = run(tmp_path, "--fault", "backward")
    assert codes == [1, 1], outputs
    f = rank0["finding"]
    assert (f["rank"], f["step"], f["where"], f["forward_op"], f["module"], f["cause"],
            f["samples"]) == (1, 2, "backward", "aten.sqrt.default", "length", "sqrt-domain", [5])
    assert f["source"]["line"] == line_of("return torch.sqrt(")
    assert f["tensors"][0] == "blocks.0.fc.weight"          # the user's names, no wrapper
    for report in (rank0, rank1):
        assert all(entry["loss"] is not None and entry["loss"] == entry["loss"]
                   for entry in report["timeline"])


def test_nan_in_one_rank_optimizer_state_shard(tmp_path):
    codes, (rank0, _), outputs = run(tmp_path, "--fault", "state")
    assert codes == [1, 1], outputs
    f = rank0["finding"]
    assert (f["rank"], f["step"], f["where"], f["cause"], f["tensors"]) == (
        1, 2, "optimizer", "optimizer-update", ["blocks.0.fc.weight"])
    assert ("`exp_avg_sq` of blocks.0.fc.weight holds nan in rank 1's shard (rows 4-7 of 8)"
            in f["explanation"])


def test_clean_bf16_run_after_a_checkpoint_resume_step(tmp_path):
    # MixedPrecisionPolicy(bf16 params, fp32 reduce); get_optimizer_state_dict steps AdamW once
    # with zero gradients at lr 0 to create its state: not a training step.
    codes, (rank0, rank1), outputs = run(tmp_path, "--fault", "none", "--mp", "bf16", "--resume")
    assert codes == [0, 0], outputs
    assert [(r["status"], r["steps_run"]) for r in rank0["distributed"]["ranks"]] == [
        ("clean", 5), ("clean", 5)]
    assert rank1["status"] == "clean" and len(rank1["timeline"]) == 5


def test_a_rank_killed_mid_step_is_exit_8_on_its_peer(tmp_path):
    codes, (rank0, _), outputs = run(tmp_path, "--fault", "die")
    assert codes == [8, -9], outputs
    assert rank0["error"]["type"] == "DistributedError" and rank0["error"]["rank"] == 0


def test_sentinel_in_an_fsdp2_loop_names_the_rank_on_every_rank():
    codes, outputs = launch_ranks([SCRIPTS / "fsdp_sentinel.py", "--fault", "backward"])
    assert codes == [0, 0], outputs
    for rank, (stdout, _) in enumerate(outputs):
        seen = json.loads(stdout.strip().splitlines()[-1])
        assert (seen["rank"], seen["step"], seen["finding_rank"], seen["where"],
                seen["forward_op"], seen["module"], seen["cause"]) == (
            rank, 2, 1, "backward", "aten.sqrt.default", "length", "sqrt-domain")


def test_scan_shards_the_model_and_names_the_rank_of_a_backward_value(tmp_path):
    # distributed.fsdp with bf16 params: every rank replays at once; rank 1's own op made it.
    out = tmp_path / "report.json"
    config = ROOT / "configs" / "examples" / "fsdp_backward_nan.yaml"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", out, "-q"])
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    f = report["finding"]
    assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"],
            f["tensors"]) == (1, 2, "backward", "aten.sqrt.default", "sqrt-domain", [6], ["gain"])
    assert f["inputs"][0]["dtype"] == "bfloat16"      # the op ran in the policy's dtype
    assert [r["status"] for r in report["distributed"]["ranks"]] == ["nonfinite", "nonfinite"]


def test_scan_confirms_each_ranks_shard_before_a_huge_updates_weights_trip(tmp_path):
    """A learning rate of 1e30: step 0's update leaves every shard finite near 1e30, whose
    float32 sums of squares overflow on every rank. The ranks confirm their shards (one more
    exchange, on that step only), so the trip is step 1's forward overflow, divergence; the
    replay's weights, which FSDP2 frees after the layer's forward, are not read again (they
    crashed the diagnosis with a segfault)."""
    out = tmp_path / "report.json"
    config = ROOT / "configs" / "examples" / "fsdp_diverging.yaml"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", out, "-q"])
    assert codes == [1, 1], outputs
    f = json.loads(out.read_text())["finding"]
    assert (f["step"], f["where"], f["op"], f["cause"]) == (1, "forward", "aten.addmm.default",
                                                            "divergence")
    released = next(s for s in f["inputs"] if s["name"] == "mat2")
    assert released["shape"] == [8, 8] and released["min"] is None
    # the row says so, with no counts (zeros beside "—" read as "no NaN, no zeros")
    assert released["released"] is True and released["nan"] is None
