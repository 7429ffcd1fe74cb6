"""2-D device meshes under torchrun, four gloo ranks on CPU (issue 37): HSDP (replicate x
shard) and FSDP2 + tensor parallel (`parallelize_module` with Colwise/RowwiseParallel, then
`fully_shard` on the dp sub-mesh), through `nanaudit run` on an unmodified script. Every rank's
report names the rank whose own op made the value, its mesh coordinate, the op, module, line,
rows and cause; a rank that only received the value through TP's all-reduce is never blamed;
clean runs stay clean and add one collective per step (the exchange of flags), no other; a
dead rank is exit 8 on its peers. The faults are in configs/examples/scripts/mesh_faults.py."""

import json

import pytest
from helpers import ROOT, free_port, launch_ranks, line_of, rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = ROOT / "configs" / "examples" / "scripts" / "mesh_faults.py"
SQUARE = "self.down(torch.relu(self.up(x)).square())"     # the line that makes the value
COUNT = ROOT / "tests" / "e2e" / "count_collectives.py"
RANKS, STEPS = 4, 5


def run(tmp_path, layout, fault, *options):
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", *options, "--json", out, SCRIPT,
                                   "--layout", layout, "--fault", fault], nproc=RANKS,
                                  timeout_s=240)
    return codes, rank_reports(out, RANKS), outputs


def statuses(report):
    return [(r["rank"], r["status"], r["steps_run"]) for r in report["distributed"]["ranks"]]


def test_hsdp_forward_value_names_its_rank_and_mesh_coordinate(tmp_path):
    codes, reports, outputs = run(tmp_path, "hsdp", "forward")
    assert codes == [1] * RANKS, outputs
    for report in reports:          # every rank's own report names the same origin
        f = report["finding"]
        assert (f["rank"], f["mesh"], f["step"], f["where"], f["op"], f["module"], f["cause"],
                f["samples"]) == (3, {"dp_replicate": 1, "dp_shard": 1}, 3, "forward",
                                  "aten.pow.Tensor_Scalar", "blocks.0", "dtype-overflow", [2])
        assert f["source"]["line"] == line_of(SCRIPT, SQUARE)
        assert f["placements"]["blocks.0.up.weight"] == "dp_replicate=Replicate(), " \
                                                       "dp_shard=Shard(dim=0)"
    rank0 = reports[0]
    # named at the trip by every rank replaying the step together, the collectives included
    assert rank0["run"]["replay"]["status"] == "reproduced" and "rerun" not in rank0["run"]
    assert statuses(rank0) == [(r, "nonfinite", 4) for r in range(RANKS)]
    assert [r["mesh"] for r in rank0["distributed"]["ranks"]] == [
        {"dp_replicate": i, "dp_shard": j} for i in range(2) for j in range(2)]


def test_hsdp_backward_only_value_names_the_rank_before_the_reduce_scatter(tmp_path):
    codes, (rank0, *_), outputs = run(tmp_path, "hsdp", "backward")
    assert codes == [1] * RANKS, outputs
    f = rank0["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["forward_op"], f["module"],
            f["cause"], f["samples"]) == (3, {"dp_replicate": 1, "dp_shard": 1}, 2, "backward",
                                          "aten.sqrt.default", "length", "sqrt-domain", [5])
    # rank 3 (dp_shard=1) holds rows 8-15 of `up`'s weight: its first bad gradient element
    assert f["element"] == {"tensor": "blocks.0.up.weight.grad", "local_index": [0, 0],
                            "global_index": [8, 0]}
    assert all(entry["loss"] == entry["loss"] for entry in rank0["timeline"])   # no NaN loss


def test_fsdp_tp_value_made_in_one_tp_rank_column_slice_is_not_blamed_on_its_peer(tmp_path):
    # Only tp rank 1 holds `up`'s output columns 8-15; the row-wise all-reduce of `down` hands
    # the NaN to rank 2 (tp rank 0 of the same dp group), which must not be named.
    codes, reports, outputs = run(tmp_path, "fsdp-tp", "forward")
    assert codes == [1] * RANKS, outputs
    for report in reports:
        f = report["finding"]
        assert (f["rank"], f["mesh"], f["step"], f["where"], f["op"], f["module"], f["cause"],
                f["samples"]) == (3, {"dp": 1, "tp": 1}, 3, "forward",
                                  "aten.pow.Tensor_Scalar", "blocks.0", "dtype-overflow", [2])
        assert f["source"]["line"] == line_of(SCRIPT, SQUARE)
        assert "arrived from a peer" not in f["explanation"]
        assert f["placements"]["blocks.0.down.weight"] == "dp=Shard(dim=0), tp=Shard(dim=1)"
    assert statuses(reports[0]) == [(r, "nonfinite", 4) for r in range(RANKS)]


def test_fsdp_tp_step_flags_alone_name_the_rank_whose_partial_sum_went_bad_first(tmp_path):
    # No re-run: the first run's one read per step (each rank's partial sums before the
    # row-wise all-reduce) names rank 3, not rank 2, whose loss went bad just the same.
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--no-rerun", "--json", out,
                                   SCRIPT, "--layout", "fsdp-tp", "--fault", "forward"],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [1] * RANKS, outputs
    f = json.loads(out.read_text())["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"]) == (3, {"dp": 1, "tp": 1}, 3, "forward")


def test_fsdp_tp_backward_only_value_names_a_rank_of_the_dp_group_that_made_it(tmp_path):
    # Both tp ranks of dp group 1 compute `length` on the replicated activations: both made it.
    # --keep-going: every rank replays the bad step together, skips it, and trains on.
    codes, (rank0, *_), outputs = run(tmp_path, "fsdp-tp", "backward", "--keep-going")
    assert codes == [1] * RANKS, outputs
    assert statuses(rank0) == [(r, "nonfinite", STEPS) for r in range(RANKS)]
    assert (rank0["bad_steps"]["count"], rank0["bad_steps"]["skipped"]) == (1, 1)
    [f] = rank0["findings"]
    assert f["localized_by"] == "in-process" and f == rank0["finding"]
    assert f["rank"] in (2, 3) and f["mesh"]["dp"] == 1
    assert (f["step"], f["where"], f["forward_op"], f["module"], f["cause"], f["samples"]) == (
        2, "backward", "aten.sqrt.default", "length", "sqrt-domain", [5])
    # `up`'s weight (16 rows): tp rank t holds rows 8t-8t+7, of which dp rank 1 rows 8t+4 on
    element = f["element"]
    assert element["tensor"] == "blocks.0.up.weight.grad"
    local, glob = element["local_index"], element["global_index"]
    assert glob == [8 * f["mesh"]["tp"] + 4 + local[0], local[1]]


def test_tp_alone_names_the_rank_whose_column_slice_made_the_value(tmp_path):
    # Tensor parallel alone on a 1-D ("tp",) mesh of 2 ranks, no FSDP: tp rank 1 alone holds
    # `up`'s output columns 8-15, where the squared ReLU overflows; `down`'s row-wise
    # all-reduce hands the value to rank 0, which made none of it.
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--json", out, SCRIPT,
                                   "--layout", "tp", "--fault", "forward"], nproc=2,
                                  timeout_s=240)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    f = report["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["op"], f["module"], f["cause"],
            f["samples"]) == (1, {"tp": 1}, 3, "forward", "aten.pow.Tensor_Scalar", "blocks.0",
                              "dtype-overflow", [2])
    assert f["source"]["line"] == line_of(SCRIPT, SQUARE)
    assert f["placements"]["blocks.0.up.weight"] == "tp=Shard(dim=0)"
    assert [(r["rank"], r["status"], r["mesh"]) for r in report["distributed"]["ranks"]] == [
        (0, "nonfinite", {"tp": 0}), (1, "nonfinite", {"tp": 1})]


def test_pipeline_parallelism_is_refused_with_exit_2_naming_the_stage(tmp_path):
    # torch.distributed.pipelining (2 stages, GPipe): no rank's step shows another stage's
    # values, so a clean report would be a false one. Rank 0 refuses at its stage's first
    # forward; rank 1, blocked receiving from it, reads the refusal (2) or sees it leave (8).
    out = tmp_path / "report.json"
    script = ROOT / "configs" / "examples" / "scripts" / "pipeline_stages.py"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "--json", out, script], nproc=2,
                                  timeout_s=240)
    assert codes[0] == 2 and codes[1] in (2, 8), outputs
    error = json.loads(out.read_text())["error"]
    assert (error["type"], error["exit_code"], error["rank"]) == ("UsageError", 2, 0)
    assert "runs as a stage of a pipeline (`PipelineStage` from torch.distributed." \
           "pipelining): nanaudit does not audit pipeline parallelism" in error["message"]
    assert "nanaudit does not audit pipeline parallelism" in outputs[0][1]
    assert "Traceback" not in outputs[0][1]


@pytest.mark.parametrize("layout", ["hsdp", "fsdp-tp"])
def test_clean_mesh_run_is_clean_and_adds_one_collective_per_step(tmp_path, layout):
    # The plain run, then the audited one at a fresh port, in the same four processes (one
    # torch import per rank, not two); each run's groups are its own, counted apart.
    plain, audited = tmp_path / "plain.json", tmp_path / "audited.json"
    report = tmp_path / "report.json"
    script = [SCRIPT, "--layout", layout, "--fault", "none"]
    codes, outputs = launch_ranks([COUNT, plain, *script, "--then", free_port(), audited,
                                   "-m", "nanaudit", "run", "-q", "--json", report, *script],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [0] * RANKS, outputs
    assert statuses(json.loads(report.read_text())) == [(r, "clean", STEPS) for r in range(RANKS)]
    world = ",".join(map(str, range(RANKS)))
    for rank in range(RANKS):
        before = json.loads((tmp_path / f"plain.json.rank{rank}").read_text())
        after = json.loads((tmp_path / f"audited.json.rank{rank}").read_text())
        # the script's own (FSDP's, TP's) collectives on the mesh groups are unchanged
        assert {k: v for k, v in after.items() if k != world} == \
               {k: v for k, v in before.items() if k != world}
        assert after.get(world, 0) - before.get(world, 0) == STEPS


def test_a_dead_rank_on_a_mesh_is_exit_8_on_its_peers(tmp_path):
    codes, (rank0, *_), outputs = run(tmp_path, "fsdp-tp", "die")
    assert codes[3] == -9 and codes[:3] == [8, 8, 8], outputs
    assert rank0["error"]["type"] == "DistributedError"


def test_sentinel_in_an_fsdp_tp_loop_names_the_origin_and_its_coordinate_on_every_rank():
    script = ROOT / "configs" / "examples" / "scripts" / "mesh_sentinel.py"
    codes, outputs = launch_ranks([script, "--layout", "fsdp-tp", "--fault", "forward"],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [0] * RANKS, outputs
    for rank, (stdout, _) in enumerate(outputs):
        seen = json.loads(stdout.strip().splitlines()[-1])
        assert (seen["rank"], seen["step"], seen["finding_rank"], seen["mesh"], seen["where"],
                seen["op"], seen["module"], seen["cause"], seen["samples"]) == (
            rank, 3, 3, {"dp": 1, "tp": 1}, "forward", "aten.pow.Tensor_Scalar", "blocks.0",
            "dtype-overflow", [2])


def test_scan_with_an_hsdp_mesh_names_the_rank_of_a_backward_value(tmp_path):
    out = tmp_path / "report.json"
    config = ROOT / "configs" / "examples" / "hsdp_backward_nan.yaml"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", out, "-q"],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [1] * RANKS, outputs
    f = json.loads(out.read_text())["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["forward_op"], f["cause"],
            f["samples"], f["placements"]) == (
        3, {"dp_replicate": 1, "dp_shard": 1}, 2, "backward", "aten.sqrt.default",
        "sqrt-domain", [6], {"gain": "dp_replicate=Replicate(), dp_shard=Shard(dim=0)"})
    assert [r["mesh"] for r in json.loads(out.read_text())["distributed"]["ranks"]] == [
        {"dp_replicate": i, "dp_shard": j} for i in range(2) for j in range(2)]


def test_scan_with_fsdp_and_tp_names_the_tp_rank_whose_column_slice_made_the_value(tmp_path):
    """`distributed.tp: 2` applies the config's plan (fsdp_tp:plan) on the tp dimension; the
    two tp ranks of a data-parallel group share its batches, and the value made in tp rank 1's
    columns of `up` is named there, not on the peer that received it through `down`."""
    out = tmp_path / "report.json"
    config = ROOT / "configs" / "examples" / "fsdp_tp_forward_nan.yaml"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", out, "-q"],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [1] * RANKS, outputs
    report = json.loads(out.read_text())
    f = report["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["op"], f["module"], f["cause"],
            f["samples"]) == (
        3, {"dp_replicate": 0, "dp_shard": 1, "tp": 1}, 3, "forward", "aten.pow.Tensor_Scalar",
        "blocks.0", "dtype-overflow", [2])
    assert [r["mesh"] for r in report["distributed"]["ranks"]] == [
        {"dp_replicate": 0, "dp_shard": i, "tp": j} for i in range(2) for j in range(2)]
