"""A value made in one tensor-parallel rank's own column-wise backward (issue 37), four gloo
ranks on CPU: FSDP2 + TP on ("dp", "tp") = (2, 2) through `nanaudit run` on an unmodified
script (configs/examples/scripts/mesh_tp_backward.py). Only tp rank 1 of dp group 1 (global
rank 3) holds the columns of `up` where sqrt meets exact zeros; the backward of
ColwiseParallel's input all-reduces the gradient of `up`'s input over the tp group, so rank 2
(tp=0) holds the NaN in its own gradients of `stem` before FSDP's reduce-scatter, like rank 3.
The step's one read (each rank's partial input gradients before that all-reduce) must name
rank 3, never rank 2; before it, the flags named rank 2."""

import json

import pytest
from helpers import ROOT, launch_ranks, line_of, rank_reports

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
SCRIPT = ROOT / "configs" / "examples" / "scripts" / "mesh_tp_backward.py"
RANKS = 4


def audit(tmp_path, *options, nproc=RANKS, layout="fsdp-tp"):
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", *options, "--json", out,
                                   SCRIPT, "--layout", layout], nproc=nproc, timeout_s=240)
    return codes, rank_reports(out, nproc), outputs


def test_step_flags_alone_name_the_rank_whose_column_wise_backward_made_the_value(tmp_path):
    # No re-run: the first run's one read per step decides alone.
    codes, reports, outputs = audit(tmp_path, "--no-rerun")
    assert codes == [1] * RANKS, outputs
    for report in reports:
        f = report["finding"]
        assert (f["rank"], f["mesh"], f["step"], f["where"]) == (
            3, {"dp": 1, "tp": 1}, 2, "backward")
        # rank 3's own shards of `up` went bad (rank 2's stayed finite: not its value)
        assert {"blocks.0.up.weight", "blocks.0.up.bias"} <= set(f["tensors"])
    assert [(r["rank"], r["status"]) for r in reports[0]["distributed"]["ranks"]] == [
        (r, "nonfinite") for r in range(RANKS)]


def test_the_rerun_names_the_op_module_line_rows_and_cause_on_the_rank_that_made_it(tmp_path):
    # `--rerun`: the path kept for what the in-process replay cannot reproduce
    codes, reports, outputs = audit(tmp_path, "--rerun")
    assert codes == [1] * RANKS, outputs
    for report in reports:
        f = report["finding"]
        assert (f["rank"], f["mesh"], f["step"], f["where"], f["forward_op"], f["module"],
                f["cause"], f["samples"]) == (3, {"dp": 1, "tp": 1}, 2, "backward",
                                              "aten.sqrt.default", "blocks.0", "sqrt-domain",
                                              [5])
        assert f["source"]["line"] == line_of(SCRIPT, "torch.sqrt(h * (h > 0))")
        assert "arrived from a peer" not in f["explanation"]
        assert f["placements"]["blocks.0.up.weight"] == "dp=_StridedShard(dim=0, sf=2), " \
                                                       "tp=Shard(dim=0)"


def test_tp_alone_names_the_rank_of_a_backward_value_from_its_flags(tmp_path):
    # Tensor parallel alone on ("tp",) of 2 ranks: no reduction of gradients to flag at all,
    # so rank 1's bad partial input gradient is all that tells it from rank 0.
    codes, (report, _), outputs = audit(tmp_path, "--no-rerun", nproc=2, layout="tp")
    assert codes == [1, 1], outputs
    f = report["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"]) == (1, {"tp": 1}, 2, "backward")


def test_scan_names_the_tp_rank_whose_column_wise_backward_made_the_value(tmp_path):
    """scan's step loop reads the same partial gradients (configs/examples/tp_backward.py), and
    each rank's finding names its own first bad element of a sharded gradient, as run's does."""
    out = tmp_path / "report.json"
    config = ROOT / "configs" / "examples" / "tp_backward_nan.yaml"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", out, "-q"],
                                  nproc=RANKS, timeout_s=240)
    assert codes == [1] * RANKS, outputs
    f = json.loads(out.read_text())["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["forward_op"], f["module"],
            f["cause"], f["samples"]) == (
        3, {"dp_replicate": 0, "dp_shard": 1, "tp": 1}, 2, "backward", "aten.sqrt.default",
        "blocks.0", "sqrt-domain", [5])
    # rank 3's own shard of a sharded gradient: `stem` (8 rows, sharded over dp_shard alone)
    # rows 4-7, so its local row 0 is the whole gradient's row 4
    assert f["element"] == {"tensor": "stem.weight.grad", "local_index": [0, 0],
                            "global_index": [4, 0]}


def test_tp_alone_is_localized_at_the_trip_on_the_rank_whose_columns_made_the_value(tmp_path):
    # No FSDP: the gradients as the step left them are where the walk starts; rank 0's ends at
    # the all-reduce of `up`'s input gradient (a peer's value), rank 1's at its own sqrt.
    codes, (report, _), outputs = audit(tmp_path, nproc=2, layout="tp")
    assert codes == [1, 1], outputs
    f = report["finding"]
    assert (f["rank"], f["mesh"], f["step"], f["where"], f["forward_op"], f["module"],
            f["cause"], f["localized_by"]) == (1, {"tp": 1}, 2, "backward", "aten.sqrt.default",
                                               "blocks.0", "sqrt-domain", "in-process")
    assert f["element"] == {"tensor": "blocks.0.up.weight.grad", "local_index": [0, 0],
                            "global_index": [8, 0]}
    assert "rerun" not in report["run"]
