"""`nanaudit scan --keep-going`: a bad step is skipped without a trace (the final weights and
buffers equal a reference loop's that leaves those updates out and puts the buffers back),
each bad step is a finding, and the run stops when skipping cannot help."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import keep_going_scan_case as case
import torch
from helpers import ROOT

from nanaudit.commands.scan import audit
from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.formats import renderer_for
from nanaudit.report.model import Finding, Report
from nanaudit.report.vocabulary import BadStepAction, Cause, Status, StopReason, Where


def _config(tmp_path: Path, data_args: str = "{}", extra: str = "",
            optimizer: str = "{class: torch.optim.Adam, lr: 0.01}") -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(f"""\
        model: keep_going_scan_case:build_model
        data: {{entrypoint: keep_going_scan_case:batches, args: {data_args}}}
        loss: keep_going_scan_case:compute_loss
        optimizer: {optimizer}
        seed: 0
        """) + extra)
    return path


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(skipped: set[int], window: int = 1, count: int = 10, momentum: bool = False,
               bad: dict | None = None, every: str | None = None) -> dict[str, torch.Tensor]:
    """The same training by hand: no optimizer step on the skipped steps, their buffers put
    back as before the step's first forward."""
    model = case.build_model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if momentum
           else torch.optim.Adam(model.parameters(), lr=0.01))
    data = list(case.batches(count, bad, every))
    for step in range(count // window):
        saved = [b.clone() for b in model.buffers()]
        opt.zero_grad()
        for micro in data[step * window:(step + 1) * window]:
            (case.compute_loss(model, micro) / window).backward()
        if step in skipped:
            with torch.no_grad():
                for b, s in zip(model.buffers(), saved):
                    b.copy_(s)
        else:
            opt.step()
    return _state(model)


def _assert_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_three_bad_steps_are_skipped_without_a_trace(tmp_path):
    report = audit(_config(tmp_path), keep_going=True)
    _assert_equal(_reference(set(case.BAD)), _state(case.BUILT[-1]))
    assert report.status == Status.NONFINITE and report.steps_run == 10
    assert [f.step for f in report.findings] == sorted(case.BAD)
    assert report.finding is report.findings[0]
    assert all(f.action == BadStepAction.SKIPPED for f in report.findings)
    assert [f.where for f in report.findings] == [Where.INPUT, Where.BACKWARD, Where.FORWARD]
    assert [f.cause.value for f in report.findings] == ["nonfinite-input", "sqrt-domain",
                                                        "log-domain"]
    assert report.findings[0].samples == [3] and report.findings[0].batch_index == 2
    assert report.findings[2].op == "aten.log.default"
    assert report.bad_steps is not None
    assert (report.bad_steps.skipped, report.bad_steps.stopped) == (3, None)
    marked = {e.step: e.bad for e in report.timeline if getattr(e, "bad", None)}
    assert marked == dict.fromkeys(case.BAD, BadStepAction.SKIPPED)


def test_the_users_own_step_is_skipped_at_its_gate(tmp_path):
    # `step:`: the gate before the user's optimizer.step() holds the call there.
    config = _config(tmp_path).read_text().replace(
        "loss: keep_going_scan_case:compute_loss", "step: keep_going_scan_case:train_step")
    (tmp_path / "config.yaml").write_text(config)
    report = audit(tmp_path / "config.yaml", keep_going=True)
    _assert_equal(_reference(set(case.BAD)), _state(case.BUILT[-1]))
    assert [(f.step, f.cause.value, f.action) for f in report.findings] == [
        (2, "nonfinite-input", BadStepAction.SKIPPED), (4, "sqrt-domain", BadStepAction.SKIPPED),
        (6, "log-domain", BadStepAction.SKIPPED)]


def test_one_bad_micro_batch_skips_its_whole_window(tmp_path):
    # Data index 3 (log(0) in the loss) is micro-batch 1 of step 1; micro-batch 0 was fine.
    config = _config(tmp_path, '{bad: {3: loss}}', "accumulate: 2\n",
                     "{class: torch.optim.SGD, lr: 0.05, momentum: 0.9}")
    report = audit(config, keep_going=True)
    _assert_equal(_reference({1}, window=2, momentum=True, bad={3: "loss"}),
                  _state(case.BUILT[-1]))
    (finding,) = report.findings
    assert (finding.step, finding.micro_batch, finding.batch_index) == (1, 1, 3)
    assert finding.cause.value == "log-domain" and finding.action == BadStepAction.SKIPPED


def test_a_persistent_bad_shard_stops_at_max_bad_steps(tmp_path):
    report = audit(_config(tmp_path, "{every: loss}"), keep_going=True, max_bad_steps=3)
    assert report.status == Status.NONFINITE and report.steps_run == 4
    assert [f.step for f in report.findings] == [0, 1, 2, 3]
    assert [f.action for f in report.findings] == [BadStepAction.SKIPPED] * 3 + [
        BadStepAction.STOPPED]
    assert report.findings[-1].stop_reason == StopReason.MAX_BAD_STEPS
    assert report.bad_steps is not None and report.bad_steps.persistent
    # Nothing was ever applied: the weights are the ones built.
    _assert_equal(_reference({0, 1, 2, 3}, count=4, every="loss"), _state(case.BUILT[-1]))


def test_a_nonfinite_weight_from_the_checkpoint_stops_at_once(tmp_path):
    model = case.build_model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    torch.save({"model": model.state_dict()}, tmp_path / "bad.pt")
    report = audit(_config(tmp_path, extra="checkpoint: bad.pt\n"), keep_going=True)
    assert report.status == Status.NONFINITE and report.steps_run == 1
    (finding,) = report.findings
    assert finding.step == 0 and finding.where == Where.PARAMETER
    assert (finding.action, finding.stop_reason) == (BadStepAction.STOPPED,
                                                      StopReason.NONFINITE_STATE)


def test_a_clean_run_has_no_findings(tmp_path):
    report = audit(_config(tmp_path, "{bad: {}}"), keep_going=True)
    assert report.status == Status.CLEAN and report.findings == [] and report.bad_steps is None
    _assert_equal(_reference(set(), bad={}), _state(case.BUILT[-1]))


def test_grad_scaler_skips_are_not_findings():
    # The loss scale starts at 2^20: the GradScaler skips the first steps (AMP's normal
    # course, its own skips), which keep-going neither records nor counts.
    report = audit(ROOT / "configs" / "examples" / "amp_fp16_clean.yaml", keep_going=True)
    assert report.status == Status.CLEAN and report.findings == []
    assert any(entry.skipped for entry in report.timeline)


def test_the_skip_list_holds_every_bad_step(tmp_path):
    from helpers import run_cli
    listed = tmp_path / "skip.json"
    result = run_cli("scan", _config(tmp_path, "{every: loss}"), "--keep-going",
                     "--max-bad-steps", "3", "--skip-list", listed, "--no-repro", "--quiet")
    assert result.code == 1 and "not built yet" not in result.stderr
    entries = json.loads(listed.read_text())["skip"]
    assert [(e["batch"], e["step"], e["cause"]) for e in entries] == [
        (i, i, "log-domain") for i in range(4)]


def test_past_the_findings_kept_whole_the_skip_list_still_has_every_step():
    # A corrupt shard skips more steps than the report keeps whole: the --skip-list file
    # (report.skip_list) still lists each one's batch; the JSON's `findings` stay bounded.
    log = BadStepLog(max_bad_steps=50, keep_whole=2)
    for step in range(5):
        log.record(Finding(step=step, where=Where.FORWARD, value="nan", cause=Cause.LOG_DOMAIN,
                           explanation="", fix="", batch_index=10 + step, samples=[1]),
                   BadStepAction.SKIPPED)
    report = Report(tool_version="0", config={}, torch_version="", device="cpu",
                    status=Status.NONFINITE, steps_run=5)
    log.apply(report)
    assert len(report.findings) == 2
    assert [e.batch for e in report.skip_list] == [10, 11, 12, 13, 14]
    assert "skip_list" not in json.loads(renderer_for("json").render(report))
