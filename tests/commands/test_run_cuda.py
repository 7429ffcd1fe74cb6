"""`nanaudit run` on the GPU: the in-process replay and `--keep-going` where Dropout draws from
the CUDA generator, the GradScaler is a real float16 one under autocast, and DDP's ranks hold
CUDA tensors. Run only where a GPU exists (skipped on CPU-only machines such as this CI); the
CPU versions of the same cases are in test_run_keep_going.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import launch_ranks, run_cli
from test_run_keep_going import DDP, LOOP, audited, reference, same

from nanaudit.commands.common import exit_code

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two saved states differ (a tensor's path and largest difference): the message of
    a failed exact comparison, so a GPU run says what moved."""
    if isinstance(a, torch.Tensor):
        if isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype:
            if torch.equal(a, b):
                return []
            return [f"{path}: max |diff| {(a.double() - b.double()).abs().max().item():.3g}"]
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys()
                for d in differences(a.get(k), b.get(k), f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def test_keep_going_on_cuda_skips_three_kinds_without_a_trace(tmp_path):
    # The replay re-draws the step's Dropout masks from the CUDA generator as the step began,
    # and must leave that generator where the script's own step left it: the log's draws from
    # it after each step, and the final weights, equal the by-hand reference's.
    args = ("--device", "cuda", "--bad", "2:forward,4:backward,6:loss")
    expected, expected_log = reference(tmp_path, *args)
    report, got, log = audited(tmp_path, *args)
    assert not differences(got, expected), differences(got, expected)
    assert log == expected_log
    assert all("cuda_draw" in json.loads(line) for line in log.splitlines())
    assert exit_code(report) == 1
    assert [(f.step, f.op, f.cause, f.action, f.localized_by) for f in report.findings] == [
        (2, "aten.log.default", "log-domain", "skipped", "in-process"),
        (4, "aten.div.Tensor", "sqrt-domain", "skipped", "in-process"),
        (6, "aten.log.default", "log-domain", "skipped", "in-process")]
    assert report.findings[0].samples == [3]


@pytest.mark.parametrize("deterministic", [False, True])
def test_keep_going_with_a_float16_grad_scaler_under_autocast(tmp_path, monkeypatch,
                                                               deterministic):
    # A real fp16 GradScaler: its own overflow skips are not findings; a step nanaudit holds
    # back leaves the scale as an overflow would, and the weights equal the reference's. (A
    # backward-only NaN under a GradScaler is the scaler's own skip, not nanaudit's: it leaves
    # the forward's buffers, so the bad kinds here are a loss and a forward value.) With
    # `deterministic`, the loop (reference and audited alike) asks torch for deterministic
    # kernels, which tells a GPU's run-to-run variation apart from a trace the skip left.
    args = ["--device", "cuda", "--shape", "scaler", "--autocast", "--init-scale", "65536",
            "--bad", "3:loss,6:forward"]
    if deterministic:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        args.append("--deterministic")
    try:
        expected, expected_log = reference(tmp_path, *args)
        (tmp_path / "again").mkdir()
        again, _log = reference(tmp_path / "again", *args)
        report, got, log = audited(tmp_path, *args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not differences(again, expected), ("the reference itself varies from run to run",
                                              differences(again, expected))
    assert not differences(got, expected), differences(got, expected)
    assert log == expected_log
    assert exit_code(report) == 1
    assert report.findings and all(
        (f.action, f.localized_by) == ("skipped", "in-process") for f in report.findings)


def test_a_stop_on_cuda_is_localized_in_process_without_a_rerun(tmp_path):
    out, report_path = tmp_path / "out.pt", tmp_path / "r.json"
    result = run_cli("run", "-q", "--json", report_path, LOOP, out, "--device", "cuda",
                     "--bad", "4:backward")
    assert result.code == 1, result.stderr
    report = json.loads(report_path.read_text())
    f = report["finding"]
    assert (f["step"], f["where"], f["forward_op"], f["cause"], f["localized_by"]) == (
        4, "backward", "aten.sqrt.default", "sqrt-domain", "in-process")
    assert report["run"].get("rerun") is None
    assert [json.loads(line)["step"] for line in Path(f"{out}.log").read_text().splitlines()] \
        == [0, 1, 2, 3]                                     # the script ran once


@pytest.mark.distributed
def test_ddp_on_cuda_every_rank_skips_and_the_replicas_stay_equal(tmp_path):
    ref, got, out = tmp_path / "ref", tmp_path / "got", tmp_path / "report.json"
    codes, outputs = launch_ranks([DDP, ref, "--reference", "--cuda"], 2, timeout_s=180)
    assert codes == [0, 0], outputs
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--keep-going", "--json",
                                   out, DDP, got, "--cuda"], 2, timeout_s=180)
    assert codes == [1, 1], outputs
    expected = torch.load(f"{ref}.rank0.pt", weights_only=True)
    for rank in (0, 1):
        state = torch.load(f"{got}.rank{rank}.pt", weights_only=True)
        assert all(t.is_cuda for t in state.values())
        assert same(state, expected)
    report = json.loads(out.read_text())
    assert [(f["step"], f["rank"], f["op"], f["action"], f["localized_by"])
            for f in report["findings"]] == [
        (3, 1, "aten.log.default", "skipped", "in-process"),
        (4, 1, "aten.div.Tensor", "skipped", "in-process")]
