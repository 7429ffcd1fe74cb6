"""Two-rank runs, launched the way torchrun launches them: every rank stops at the same step, the
finding names the rank, every rank exits with the same code, nothing hangs. The example configs
pin `device: cpu` and gloo, so these pass alike on machines with zero, one or several GPUs;
ddp_auto.yaml checks what `auto` picks on this machine."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, free_port, launch_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
EXAMPLES = ROOT / "configs" / "examples"
HARD_TIMEOUT_S = 120


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env.pop("GITHUB_ACTIONS", None)
    return env


def launch(config, tmp_path, nproc=2, *extra):
    """Start `nproc` ranks with torchrun's environment variables (env:// rendezvous); return
    each rank's exit code and rank 0's JSON report. Kills every rank past the hard timeout."""
    report = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--json", report, *extra],
                                  nproc, HARD_TIMEOUT_S)
    body = json.loads(report.read_text()) if report.exists() else None
    return codes, body, outputs


def test_clean_run_exits_zero_on_every_rank(tmp_path):
    codes, report, outputs = launch(EXAMPLES / "ddp_clean.yaml", tmp_path)
    assert codes == [0, 0], outputs
    section = report["distributed"]
    assert section["world_size"] == 2 and section["backend"] == "gloo"
    assert [r["status"] for r in section["ranks"]] == ["clean", "clean"]
    assert [r["steps_run"] for r in section["ranks"]] == [6, 6]
    # Only rank 0 writes: rank 1's stdout stays empty.
    assert outputs[1][0] == ""


def test_nan_in_rank_1_shard_is_found_on_rank_1(tmp_path):
    codes, report, outputs = launch(EXAMPLES / "ddp_poisoned_rank.yaml", tmp_path)
    # every rank's whole output as text: a repr of it is cut, and once hid why a rank exited 4
    assert codes == [1, 1], "\n".join(f"rank {r}:\n{o}{e}" for r, (o, e) in enumerate(outputs))
    f = report["finding"]
    assert (f["rank"], f["step"], f["where"], f["tensor"], f["samples"]) == (
        1, 3, "input", 'batch["x"]', [5])
    ids = dict(f["sample_rows"][0]["leaves"])['batch["id"]']["value"]
    assert ids == [(3 * 2 + 1) * 8 + 5]          # the global sample id from rank 1's shard
    assert [r["steps_run"] for r in report["distributed"]["ranks"]] == [4, 4]


def test_backward_nan_is_attributed_to_the_rank_that_made_it(tmp_path):
    # After DDP's all-reduce every rank's gradients hold the NaN; the hook saw rank 1's first.
    codes, report, outputs = launch(EXAMPLES / "ddp_backward_nan.yaml", tmp_path)
    assert codes == [1, 1], outputs
    f = report["finding"]
    assert (f["rank"], f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        1, 2, "backward", "aten.sqrt.default", "sqrt-domain", [6])
    assert f["reproduced"] is True and f["source"]["file"].endswith("ddp.py")


def test_a_plain_dataloader_is_sharded_with_a_distributed_sampler(tmp_path):
    codes, report, outputs = launch(EXAMPLES / "ddp_dataloader.yaml", tmp_path)
    assert codes == [1, 1], outputs
    f = report["finding"]
    assert (f["rank"], f["step"], f["where"], f["samples"]) == (1, 2, "input", [6])
    ids = dict(f["sample_rows"][0]["leaves"])["batch[2]"]["value"]
    assert ids == [45]


@pytest.mark.parametrize("name, exception", [("ddp_failing_rank", "OSError"),
                                             ("ddp_failing_loss", "ValueError")])
def test_raise_on_rank_1_exits_4_on_every_rank(name, exception, tmp_path):
    codes, report, outputs = launch(EXAMPLES / f"{name}.yaml", tmp_path)
    assert codes == [4, 4], outputs
    error = report["error"]
    assert error["rank"] == 1 and error["exception"] == exception
    assert error["frames"][-1]["file"].endswith("ddp.py")


def test_auto_picks_a_backend_every_rank_can_use(tmp_path):
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    codes, report, outputs = launch(EXAMPLES / "ddp_auto.yaml", tmp_path)
    assert codes == [0, 0], outputs
    section = report["distributed"]
    # Two local ranks: NCCL only when each has a GPU of its own, else gloo on the CPU.
    assert section["backend"] == ("nccl" if gpus >= 2 else "gloo")
    assert [r["device"] for r in section["ranks"]] == (
        ["cuda:0", "cuda:1"] if gpus >= 2 else ["cpu", "cpu"])
    assert ("note" in section) == (gpus == 1)


def test_stuck_rank_becomes_an_error_not_a_hang(tmp_path):
    codes, report, outputs = launch(EXAMPLES / "ddp_stalled_rank.yaml", tmp_path)
    assert codes == [8, 8], outputs
    assert report["error"]["type"] == "DistributedError"
    assert "timeout_s (2s)" in report["error"]["message"]


def test_killed_rank_is_exit_8_on_the_survivor(tmp_path):
    codes, report, outputs = launch(EXAMPLES / "ddp_dying_rank.yaml", tmp_path)
    assert codes == [8, -9], outputs
    assert report["error"]["type"] == "DistributedError" and report["error"]["rank"] == 0
    assert "peer rank closed its connection" in report["error"]["message"]


def test_torchrun_command_line(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), "-m", "nanaudit", "scan",
         str(EXAMPLES / "ddp_poisoned_rank.yaml"), "--json", str(report), "--quiet"],
        env=_env(), capture_output=True, text=True, timeout=HARD_TIMEOUT_S)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("exitcode  : 1") == 2     # torchrun's summary: both ranks exit 1
    body = json.loads(report.read_text())
    assert body["finding"]["rank"] == 1 and body["finding"]["step"] == 3


@pytest.mark.parametrize("name, code, steps", [
    ("ddp_clean", 0, 6), ("ddp_poisoned_rank", 0, 6), ("ddp_failing_rank", 0, 6),
    ("ddp_failing_loss", 4, 5), ("ddp_stalled_rank", 0, 6), ("ddp_backward_nan", 0, 6),
    ("ddp_dataloader", 1, 6), ("ddp_auto", 0, 6), ("ddp_dying_rank", 0, 6)])
def test_without_torchrun_each_config_runs_as_one_process(name, code, steps, tmp_path):
    # One process reads shard 0 alone (unpoisoned, never failing or stalling) with sample ids
    # 0..47, so the loss that rejects sample 40 raises at step 5; the plain DataLoader is
    # not sharded, and its sample 45 is step 5, row 5.
    from helpers import scan
    result = scan(EXAMPLES / f"{name}.yaml", tmp_path=tmp_path)
    assert result.code == code and "distributed" not in result.report
    assert len(result.report["timeline"]) == steps
    if name == "ddp_dataloader":
        assert (result.finding["step"], result.finding["samples"]) == (5, [5])
