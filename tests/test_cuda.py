"""CUDA paths: run only where a GPU exists (skipped on CPU-only machines such as this CI)."""

import warnings

import pytest
import torch

from conftest import LINEAR_CASE, ROOT, scan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_default_scan_syncs_at_most_once_per_step(case, tmp_path):
    from nanaudit.config import load_config
    from nanaudit.loader import build_session, user_import_path
    from nanaudit.runner import run_steps
    code = LINEAR_CASE.replace("range(4)", "range(12)")
    config = load_config(case(code, optimizer={"class": "torch.optim.SGD", "lr": 0.01},
                              device="cuda"))
    with user_import_path(config.base_dir):
        session = build_session(config)
        run_steps(session, 2)                        # warm-up: allocator, kernels, lazy init
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outcome = run_steps(session, 10)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    assert outcome.trip is None and outcome.steps_run == 10
    syncs = [w for w in seen if "synchroniz" in str(w.message).lower()]
    # One readout per step, plus the final check of the last update.
    assert len(syncs) <= 10 + 1, [str(w.message) for w in syncs[:5]]


def test_demo_localizes_on_cuda(tmp_path):
    result = scan(ROOT / "configs" / "demo.yaml", "--device", "cuda", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        6, "backward", "aten.sqrt.default", "sqrt-domain", [5])
    assert result.report["device"].startswith("cuda")
