"""Mixed precision and early warnings (issue 8): AMP without false alarms, warnings before NaNs."""

import struct

import pytest
from helpers import LINEAR_CASE, ROOT, run_cli, scan

EXAMPLES = ROOT / "configs" / "examples"


def test_fp16_amp_skips_are_recorded_not_reported(tmp_path):
    result = scan(EXAMPLES / "amp_fp16_clean.yaml", tmp_path=tmp_path)
    assert result.code == 0 and result.report["status"] == "clean"
    assert result.report["config"]["precision"] == "fp16"
    assert result.report["config"]["grad_scaler"] is True
    timeline = result.report["timeline"]
    skipped = [e for e in timeline if e["skipped"]]
    assert 1 <= len(skipped) < len(timeline)
    assert timeline[0]["scale"] == 2.0 ** 20 and timeline[0]["skipped"]
    for before, after in zip(timeline, timeline[1:]):
        # A skip halves the scale for the next step; no growth within 2000 steps.
        assert after["scale"] == before["scale"] * (0.5 if before["skipped"] else 1.0)
    assert all(isinstance(e["grad_norm"], float) for e in timeline if not e["skipped"])
    assert result.report["warnings"] == []


def test_bf16_autocast_runs_clean_without_a_scaler(tmp_path):
    result = scan(EXAMPLES / "amp_bf16_clean.yaml", tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["config"]["grad_scaler"] is False
    assert all(e["scale"] is None and not e["skipped"] for e in result.report["timeline"])


def test_scale_collapse_is_localized_to_the_overflowing_backward_op(tmp_path):
    result = scan(EXAMPLES / "amp_scale_collapse.yaml", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["op"], f["cause"]) == (
        9, "backward", "aten.mm.default", "dtype-overflow")
    assert "skipped 10 steps in a row" in f["explanation"]
    assert "float16 holds at most 65504" in f["explanation"]
    assert all(e["skipped"] for e in result.report["timeline"])
    assert [e["scale"] for e in result.report["timeline"]][-1] == 65536 / 2 ** 9


def test_fp16_adam_eps_underflow_is_an_optimizer_finding(tmp_path):
    result = scan(EXAMPLES / "fp16_adam_eps.yaml", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["step"], f["where"], f["cause"], f["tensor"]) == (
        0, "optimizer", "optimizer-update", "weight")
    assert "eps=1e-08 is 0 in float16" in f["explanation"]


def test_near_overflow_is_warned_before_the_fp16_overflow(tmp_path):
    result = scan(EXAMPLES / "fp16_activation_growth.yaml", tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["where"], f["op"], f["module"], f["cause"]) == (
        "forward", "aten.mm.default", "proj", "dtype-overflow")
    near = [w for w in result.report["warnings"] if w["kind"] == "near-overflow"]
    assert len(near) == 1 and near[0]["module"] == "proj"
    assert near[0]["step"] < f["step"]
    assert 0.5 * 65504 <= near[0]["value"] < 65504
    assert f["first_warning"]["kind"] == "near-overflow"
    assert f"warned at step {near[0]['step']}" in f["explanation"]
    ratios = [e["act_ratio"] for e in result.report["timeline"] if e["act_ratio"] is not None]
    assert ratios == sorted(ratios), "the activation grows every step"


def test_learning_rate_divergence_warns_before_the_finding(tmp_path):
    result = scan(EXAMPLES / "gradient_explosion.yaml", tmp_path=tmp_path)
    f = result.finding
    kinds = {w["kind"]: w for w in result.report["warnings"]}
    assert {"grad-growth", "loss-spike", "update-ratio"} <= set(kinds)
    assert all(w["step"] < f["step"] for w in kinds.values())
    assert kinds["grad-growth"]["began"] < kinds["grad-growth"]["step"]
    assert f["cause"] == "divergence" and "warned at step" in f["explanation"]


@pytest.mark.parametrize("name", ["clean", "atan2"])
def test_clean_runs_raise_no_warnings(name, tmp_path):
    config = ROOT / "configs" / ("clean.yaml" if name == "clean" else
                                 "examples/atan2_origin.yaml")
    result = scan(config, tmp_path=tmp_path)
    assert result.code == 0 and result.report["warnings"] == []


def test_fail_on_warning_exits_7_before_any_nan(tmp_path):
    config = EXAMPLES / "gradient_explosion.yaml"
    lenient = scan(config, "--steps", "8", tmp_path=tmp_path)
    assert lenient.code == 0 and lenient.report["status"] == "clean"
    assert {w["kind"] for w in lenient.report["warnings"]} >= {"grad-growth"}
    junit = tmp_path / "strict.xml"
    strict = scan(config, "--steps", "8", "--fail-on", "warning", "--junit-xml", junit,
                  tmp_path=tmp_path)
    assert strict.code == 7
    text = junit.read_text()
    assert '<testcase classname="nanaudit.watch" name="grad-growth at step' in text
    assert "<failure type=\"grad-growth\"" in text
    relaxed = tmp_path / "relaxed.xml"
    run_cli("scan", config, "--steps", "8", "--junit-xml", relaxed, "-q")
    assert "<skipped message=\"step" in relaxed.read_text()


def test_github_annotations_carry_warnings(tmp_path):
    result = run_cli("scan", EXAMPLES / "gradient_explosion.yaml", "--steps", "8",
                     "--format", "github", "-q")
    lines = result.stdout.splitlines()
    assert any(line.startswith("::warning title=nanaudit (grad-growth)::") for line in lines)
    assert lines[-1].startswith("::notice")


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    result = run_cli("scan", EXAMPLES / "fp16_activation_growth.yaml", "--plot", png, "-q")
    assert result.code == 1
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 600


def test_update_ratio_is_the_sgd_step_over_the_weights(case, tmp_path):
    lr = 0.01
    config = case(LINEAR_CASE, optimizer={"class": "torch.optim.SGD", "lr": lr},
                  watch={"update_every": 1})
    result = scan(config, tmp_path=tmp_path)
    timeline = result.report["timeline"]
    for entry in timeline:
        expected = lr * entry["grad_norm"] / entry["param_norm"]
        assert entry["update_ratio"] == pytest.approx(expected, rel=1e-4)


def test_host_scale_mirror_matches_the_grad_scaler():
    from nanaudit.config.entrypoints import user_import_path
    from nanaudit.config.parse import load_config
    from nanaudit.run.loop import run_steps
    from nanaudit.run.session import build_session
    config = load_config(EXAMPLES / "amp_fp16_clean.yaml")
    with user_import_path(config.base_dir):
        session = build_session(config)
        outcome = run_steps(session)
    assert outcome.trip is None
    assert session.precision.scale == session.precision.scaler.get_scale()


@pytest.mark.parametrize("raw, key", [
    ({"precision": "fp8"}, "precision"),
    ({"amp": {"init_scale": 1024}}, "amp"),
    ({"precision": "fp16", "amp": {"max_skiped": 3}}, "amp.max_skiped"),
    ({"watch": {"near_overflow": 2}}, "watch.near_overflow"),
    ({"watch": {"update_every": -1}}, "watch.update_every"),
    ({"fail_on": "warnings"}, "fail_on"),
])
def test_bad_precision_and_watch_keys_are_config_errors(raw, key, case):
    result = run_cli("validate", case(LINEAR_CASE, **raw))
    assert result.code == 3
    assert key in result.stderr


def test_watch_costs_no_extra_host_reads(host_reads, case, tmp_path):
    config = case(LINEAR_CASE, optimizer={"class": "torch.optim.SGD", "lr": 0.01},
                  precision="fp16", amp={"init_scale": 256},
                  watch={"activations": 1, "update_every": 1})
    result = scan(config, tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 4
    assert all(e["act_max"] is not None and e["update_ratio"] is not None
               for e in result.report["timeline"])
    assert host_reads == {"tolist": 4, "item": 0}
