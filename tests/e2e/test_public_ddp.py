"""`nanaudit run` under torchrun (two gloo ranks) on the DDP shape of karpathy/nanoGPT's
train.py (tests/e2e/scripts/nanogpt_ddp.py): accumulation with `require_backward_grad_sync`
toggled per micro-step, a warmed-up learning rate set by hand, the master saving `ckpt.pt`.

A huge `--learning_rate` makes step 0's update move every weight to about 5e26: finite, but a
float32 sum of squares of such a tensor overflows, so each rank's exchanged weights flag was set.
Under DDP every rank holds the same weights, so each rank's own element-wise confirmation
decides (as `scan`'s step loop does); before, the flag alone made a false optimizer-update at
step 0 naming no parameter, where the true first non-finite value is step 1's forward."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from helpers import ROOT, launch_ranks, rank_reports

SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "nanogpt_ddp.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_weights_past_a_float32_sum_of_squares_are_no_update_trip(tmp_path):
    rng = np.random.default_rng(0)
    rng.integers(0, 32, size=2000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 32, size=500).astype(np.uint16).tofile(tmp_path / "val.bin")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    ckpt = out_dir / "ckpt.pt"
    ckpt.write_bytes(b"an earlier run's checkpoint")      # the user's: never touched
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(
        ["-m", "nanaudit", "run", "-q", "--json", out, SCRIPT, f"--data_dir={tmp_path}",
         f"--out_dir={out_dir}", "--learning_rate=1e30"], 2, timeout_s=150)
    assert codes == [1, 1], outputs
    for report in rank_reports(out, 2):
        finding = report["finding"]
        # Step 0's update (lr 1e30 / 3) left finite weights of about 3e29; step 1's first
        # LayerNorm squares them past float32's range.
        assert (finding["step"], finding["where"], finding["tensor"]) == (1, "forward", "loss")
        assert finding["cause"] == "divergence"
        assert finding["op"] == "aten.native_layer_norm.default"
        assert finding["module"] == "h.ln_1"
        assert finding["localized_by"] == "in-process"
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before
