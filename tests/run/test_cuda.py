"""CUDA paths: run only where a GPU exists (skipped on CPU-only machines such as this CI)."""

import warnings

import pytest
import torch
from helpers import LINEAR_CASE, ROOT, scan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _syncs_of_ten_steps(case, optimizer):
    """Run 10 steps under torch's sync debug mode; return (outcome, synchronization warnings)."""
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.config.parse import load_config
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import build_session
    code = LINEAR_CASE.replace("range(4)", "range(12)")
    config = load_config(case(code, optimizer=optimizer, device="cuda"))
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
    # Only the synchronizations themselves ("called a synchronizing CUDA operation"), not
    # torch's notice that the debug mode is a prototype feature.
    syncs = [str(w.message) for w in seen if "called a synchronizing" in str(w.message)]
    return outcome, syncs


def test_default_scan_syncs_at_most_once_per_step(case):
    outcome, syncs = _syncs_of_ten_steps(case, {"class": "torch.optim.SGD", "lr": 0.01})
    assert outcome.trip is None and outcome.steps_run == 10
    assert outcome.read_mode.mode == "sync" and "fused=True" in outcome.read_mode.reason
    # One readout per step, plus the final check of the last update.
    assert len(syncs) <= 10 + 1, syncs[:5]
    assert outcome.host_syncs == 11


def test_fused_optimizer_reads_one_step_later(case):
    outcome, syncs = _syncs_of_ten_steps(case, {"class": "torch.optim.SGD", "lr": 0.01,
                                                "fused": True})
    assert outcome.trip is None and outcome.steps_run == 10
    assert outcome.read_mode.mode == "deferred"
    assert len(syncs) <= 10 + 1, syncs[:5]
    assert outcome.host_syncs == 11 and len(outcome.timeline) == 10


@pytest.mark.parametrize("optimizer", [None, {"class": "torch.optim.AdamW", "lr": 1e-3,
                                              "fused": True}])
def test_demo_localizes_on_cuda(optimizer, tmp_path):
    config = ROOT / "configs" / "demo.yaml"
    if optimizer is not None:                      # the demo with a fused optimizer: deferred
        import yaml
        body = yaml.safe_load(config.read_text())
        body["optimizer"] = optimizer
        config = tmp_path / "demo_fused.yaml"
        config.write_text(yaml.safe_dump(body))
    result = scan(config, "--device", "cuda", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["forward_op"], f["cause"], f["samples"]) == (
        6, "backward", "aten.sqrt.default", "sqrt-domain", [5])
    assert result.report["device"].startswith("cuda")
    if optimizer is not None:
        assert result.report["sentinel_read"]["mode"] == "deferred"
        assert result.report["sentinel_read"]["sync_from_step"] == 6


def test_a_bare_cuda_device_takes_the_fused_check(case):
    # `device: cuda` (and `auto` on a GPU) was torch.device("cuda"), which never equals a
    # tensor's `cuda:0`: every step's check took the per-tensor path (a copy and a kernel per
    # parameter and gradient: on the H200, 112 copies a step of a 3.67M transformer).
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.config.parse import load_config
    from nanaudit.run.checks import StepChecks
    from nanaudit.run.session import build_session

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    config = load_config(case(LINEAR_CASE, device="cuda"))
    with user_import_path(config.base_dir):
        assert build_session(config).device == torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).cuda()
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    checks = StepChecks(model, "cuda")
    with Ops() as ops:
        readout = checks.step_readout(torch.zeros((), device="cuda"), [])
    assert ops.seen["aten._to_copy.default"] == 0, ops.seen
    assert ops.seen["aten._foreach_norm.Scalar"] == 1 and readout.values.numel() == 9
