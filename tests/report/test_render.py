"""Every format is rendered from one canonical report and compared to its golden file.

Regenerate after an intended change with `NANAUDIT_UPDATE_GOLDEN=1 pytest tests/report/test_render.py`.
"""

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from rich.console import Console

from nanaudit.report.console import print_report
from nanaudit.report.formats import renderer_for
from nanaudit.report.model import (
    EarlyWarning,
    Finding,
    Report,
    SampleSearch,
    SourceLine,
    TensorStats,
    TimelineEntry,
)
from nanaudit.report.sections import (
    CheckpointBisect,
    CheckpointRef,
    ConfigFailure,
    ConfigProblem,
    DataBisect,
    DistributedRun,
    Interruption,
    RankStatus,
    Rerun,
    ScriptRun,
    ShardElement,
    SkipEntry,
    UserCodeFailure,
    UserFrame,
)
from nanaudit.report.vocabulary import RerunStatus

GOLDEN = Path(__file__).parent / "golden"
FORMATS = {"json": "report.json", "junit": "report.xml", "github": "report.github.txt",
           "markdown": "report.md"}


def canonical_report() -> Report:
    stats = TensorStats("self", (16, 1), "float32", 16, -0.02, 0.018, 0.0, 0, 0, 0, 0, 10)
    other = TensorStats("other", (16, 1), "float32", 16, 0.0, 8.64, 4.1, 0, 0, 0, 1, 0)
    finding = Finding(
        step=6, where="backward", value="nan", cause="sqrt-domain",
        explanation="sqrt received exact zeros at 1 of 16 position(s), first at index [5, 0]",
        fix="`torch.sqrt(x + eps)`", tensor="features.gain", op="aten.div.Tensor",
        forward_op="aten.sqrt.default", module="features",
        source=SourceLine("model.py", 26, "length = torch.sqrt((z * z).sum(1)) # <&> \x01",
                          "forward"),
        samples=[5], inputs=[stats, other], reproduced=True,
        sample_search=SampleSearch(batch_size=16, replays=8, coupled=False, note=""))
    timeline = [TimelineEntry(i, 1.0 / (i + 1), 0.5 * (i + 1), 4.4, 1e-3, 0.5) for i in range(6)]
    timeline.append(TimelineEntry(6, 5.5, float("nan"), 4.4, 1e-3, 0.5))
    warning = EarlyWarning(kind="grad-growth", step=4, began=1, value=2.5, threshold=10.0,
                           message="the gradient norm grew 12x over 4 steps in a row")
    return Report(tool_version="0.1.0", config={"path": "configs/demo.yaml"},
                  torch_version="2.13.0", device="cpu", status="nonfinite", steps_run=7,
                  finding=finding, timeline=timeline, warnings=[warning], duration_s=1.25)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_matches_golden(fmt):
    text = renderer_for(fmt).render(canonical_report())
    golden = GOLDEN / FORMATS[fmt]
    if os.environ.get("NANAUDIT_UPDATE_GOLDEN"):
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


def test_json_is_strict_and_carries_the_contract():
    body = json.loads(renderer_for("json").render(canonical_report()))
    assert body["schema_version"] == 1 and body["status"] == "nonfinite"
    assert body["timeline"][-1]["grad_norm"] == "nan"
    f = body["finding"]
    for key in ("step", "where", "value", "tensor", "op", "forward_op", "module", "source",
                "samples", "cause", "explanation", "fix", "inputs"):
        assert key in f
    assert f["source"] == {"file": "model.py", "line": 26, "function": "forward",
                           "code": "length = torch.sqrt((z * z).sum(1)) # <&> \x01"}


def test_junit_escapes_and_fails_the_gradient_case():
    suite = ET.fromstring(renderer_for("junit").render(canonical_report()).split("\n", 1)[1])
    assert suite.get("failures") == "1"
    failed = [c for c in suite if c.tag == "testcase" and c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["gradients"]
    assert "<&>" in failed[0].find("failure").text and "\x01" not in failed[0].find("failure").text


def test_github_annotation_is_on_the_source_line():
    warning, line = renderer_for("github").render(canonical_report()).splitlines()
    assert warning.startswith("::warning title=nanaudit (grad-growth)::step 4")
    assert line.startswith("::error file=model.py,line=26,title=nanaudit (sqrt-domain)::")


def test_clean_report_renders_in_every_format():
    report = canonical_report()
    report.status, report.finding = "clean", None
    suite = ET.fromstring(renderer_for("junit").render(report).split("\n", 1)[1])
    assert suite.get("failures") == "0" and suite.get("errors") == "0"
    assert renderer_for("github").render(report).splitlines()[-1].startswith("::notice")
    assert "✅" in renderer_for("markdown").render(report)


def test_console_report_shows_the_finding():
    console = Console(record=True, width=120, color_system=None)
    print_report(canonical_report(), console)
    text = console.export_text()
    for needle in ("finding: sqrt-domain", "aten.div.Tensor", "features", "model.py:26",
                   "inputs of the op that created it", "fix", "timeline"):
        assert needle in text


def _json(report: Report) -> dict:
    return json.loads(renderer_for("json").render(report))


def test_sections_keep_their_keys_and_key_order():
    """Each section's shape as schema version 1 wrote it: a key present only sometimes is
    left out, not null, and each shape keeps its order."""
    report = canonical_report()
    report.error = Interruption(signal="SIGTERM", exit_code=143, message="stopped")
    report.run = ScriptRun(rerun=Rerun(status=RerunStatus.SKIPPED, note="--no-rerun"))
    body = _json(report)
    assert list(body["error"]) == ["type", "signal", "exit_code", "message"]
    assert body["run"] == {"rerun": {"status": "skipped", "note": "--no-rerun"}}
    report.error = UserCodeFailure(message="m", what="the loss", exception="OSError",
                                   frames=[UserFrame("train.py", 3, "load", None)])
    report.run = ScriptRun(rank=1, rerun=Rerun(steps=4, duration_s=0.5,
                                               status=RerunStatus.REPRODUCED, ops_traced=9,
                                               precision="fp16"))
    body = _json(report)
    assert list(body["error"]) == ["type", "message", "what", "exception", "frames", "exit_code"]
    assert body["error"]["exit_code"] == 4 and body["error"]["frames"][0]["code"] is None
    assert list(body["run"]) == ["rank", "rerun"]
    assert list(body["run"]["rerun"]) == ["steps", "duration_s", "status", "ops_traced",
                                          "precision"]
    report.error = ConfigFailure(message="m", source=None, problems=[ConfigProblem("lr", "x")])
    report.error.rank = 1
    assert _json(report)["error"] == {"type": "ConfigError", "message": "m", "source": None,
                                      "problems": [{"key": "lr", "message": "x"}],
                                      "exit_code": 3, "rank": 1}


def test_bisect_and_distributed_sections_keep_their_shape():
    report = canonical_report()
    first = CheckpointBisect(checkpoints=4, checkpoints_loaded=2, loaded_steps=[20, 0],
                             linear_loads=1, first_bad=CheckpointRef(0, "step_0.pt"),
                             note="the first checkpoint is already non-finite")
    report.bisect = first
    section = _json(report)["bisect"]
    assert next(iter(section)) == "mode" and section["mode"] == "checkpoints"
    assert list(section)[-2:] == ["optimizer_state", "note"] and section["last_good"] is None
    report.bisect = DataBisect(batches_audited=3, bad_batches=[report.finding], skip_list=[
        SkipEntry(batch=2, rows=[5], sample_ids=None, cause="sqrt-domain"),
        SkipEntry(batch=4, rows=None, sample_ids=None, cause="sqrt-domain", confirmed=False)])
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0)
    body = _json(report)
    assert [("confirmed" in s) for s in body["bisect"]["skip_list"]] == [False, True]
    # The report's own finding leaves out optimizer/loss_name while unset; bisect's bad
    # batches carry them as null, as schema version 1 shipped them.
    assert "optimizer" not in body["finding"]
    assert body["bisect"]["bad_batches"][0]["optimizer"] is None
    assert list(body["distributed"]) == ["rank", "world_size", "backend", "host", "local_rank"]


def test_console_shows_the_typed_sections():
    report = canonical_report()
    report.bisect = CheckpointBisect(checkpoints=10, checkpoints_loaded=4, loaded_steps=[],
                                     linear_loads=10, first_bad=CheckpointRef(90, "b.pt"),
                                     last_good=CheckpointRef(80, "a.pt"), steps_replayed=10,
                                     optimizer_state=False, reproduced=True, note="loaded 4")
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0, ranks=[
        RankStatus(0, "nonfinite", 4, "cpu", "h", 0), RankStatus(1, "nonfinite", 4, "cpu", "h", 1)])
    report.error = UserCodeFailure(message="the loss `m:f` raised OSError: no data: x",
                                   what="the loss `m:f`", exception="OSError",
                                   frames=[UserFrame("train.py", 3, "load", "open(path)")])
    console = Console(record=True, width=120, color_system=None)
    print_report(report, console)
    text = console.export_text()
    for needle in (("first bad checkpoint: step 90; last good: step 80; replayed 10 step(s); "
                    "optimizer state absent (fresh optimizer)"), "ranks (2, gloo)",
                   "rank 1  nonfinite   4 step(s)  cpu on h",
                   'File "train.py", line 3, in load', "open(path)", "OSError: no data: x"):
        assert needle in text


def test_console_ranks_list_names_each_rank_mesh_coordinate():
    # A 2-D mesh's user-named dimensions, as the JSON's distributed.ranks[].mesh has them
    # (markup-looking names stay text); a rank off the mesh shows none.
    report = canonical_report()
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0, ranks=[
        RankStatus(0, "clean", 5, "cpu", "h", 0, mesh={"[b]dp": 0, "tp": 1}),
        RankStatus(1, "clean", 5, "cpu", "h", 0)])
    console = Console(record=True, width=120, color_system=None)
    print_report(report, console)
    lines = console.export_text().splitlines()
    assert "  rank 0  clean       5 step(s)  cpu on h  [b]dp=0, tp=1" in lines
    assert "  rank 1  clean       5 step(s)  cpu on h" in lines


def test_every_format_names_a_sharded_tensor_bad_element_by_global_index():
    report = canonical_report()
    assert report.finding is not None
    report.finding.rank = 3
    report.finding.element = ShardElement("blocks.0.up.weight.grad", [0, 2], [8, 2])
    console = Console(record=True, width=200, color_system=None)
    print_report(report, console)
    assert "blocks.0.up.weight.grad[8, 2] (rank 3's shard [0, 2])" in console.export_text()
    body = json.loads(renderer_for("json").render(report))
    assert body["finding"]["element"] == {"tensor": "blocks.0.up.weight.grad",
                                          "local_index": [0, 2], "global_index": [8, 2]}


def _next_line(report: Report) -> str:
    console = Console(record=True, width=400, color_system=None)
    print_report(report, console)
    return next(line for line in console.export_text().splitlines() if line.startswith("next:"))


def test_next_step_of_a_divergence_is_the_optimizer_not_the_line():
    # pytorch/examples imagenet/main.py --dummy --lr 1e30: the weights overflow in a
    # convolution of torchvision's resnet.py, whose line is not what to edit.
    report = canonical_report()
    report.finding.cause, report.finding.source = "divergence", SourceLine(
        "/site-packages/torchvision/models/resnet.py", 92, "out = self.conv1(x)", "forward")
    line = _next_line(report)
    assert "edit resnet.py" not in line
    assert "change the optimizer as the fix says (resnet.py:92 is where" in line
    assert "edit model.py:26 as the fix says" in _next_line(canonical_report())


def test_console_log_facts_are_not_padded_to_the_longest_value():
    """In a CI log (no terminal) each fact is one line as long as its own value: a long list
    of tensors does not pad every other fact's line to its width."""
    report = canonical_report()
    assert report.finding is not None
    report.finding.tensors = [f"blocks.{i}.attn.c_attn.weight" for i in range(12)]
    console = Console(record=True, width=400, color_system=None, force_terminal=False)
    print_report(report, console)
    lines = console.export_text().splitlines()
    step = next(line for line in lines if line.startswith("step "))
    assert step == step.rstrip() and len(step) < 40
    tensors = next(line for line in lines if line.startswith("all tensors"))
    assert tensors.endswith("blocks.11.attn.c_attn.weight")


def test_a_released_tensors_row_says_released_in_every_format_instead_of_zero_counts():
    # FSDP2 frees a layer's unsharded weights after its forward (storage resized to 0): the
    # op read them, their statistics cannot be taken, and zero counts beside "—" would read
    # as "no NaN, no zeros" (localize/overflow.released).
    from nanaudit.localize.stats import tensor_stats
    weight = torch.nn.Parameter(torch.ones(8, 8))
    weight.data.untyped_storage().resize_(0)
    stats = tensor_stats("mat2", weight)
    assert (stats.shape, stats.dtype, stats.released) == ((8, 8), "float32", True)
    assert (stats.min, stats.nan, stats.zeros, stats.negatives) == (None, None, None, None)
    report = canonical_report()
    assert report.finding is not None
    report.finding.inputs = [report.finding.inputs[0], stats]
    row = _json(report)["finding"]["inputs"]
    assert row[1]["released"] is True and row[1]["nan"] is None and row[1]["zeros"] is None
    assert "released" not in row[0]            # a row with values keeps its keys as they were
    console = Console(record=True, width=160, color_system=None)
    print_report(report, console)
    text = console.export_text()
    line = next(t for t in text.splitlines() if t.strip().startswith("mat2"))
    assert "released" in line and " 0 " not in line
    assert "released: its memory was freed after the op read it" in text
    markdown = renderer_for("markdown").render(report)
    assert "| mat2 | `float32[8, 8] released: its memory was freed" in markdown
    html = renderer_for("html").render(report)
    cells = html.split("<td>mat2</td>", 1)[1].split("</tr>", 1)[0]
    assert ">released</span>" in cells and "<td>0</td>" not in cells


def test_a_format_imports_its_own_renderer_alone():
    # `nanaudit run --json` at its end: the HTML renderer's and the console's imports (pygments,
    # rich's syntax) are not paid for a format that was not asked for.
    import subprocess
    import sys
    probe = ("import sys; from nanaudit.report.formats import renderer_for; "
             "kind = type(renderer_for('json')).__name__; "
             "print(kind, sorted(m for m in ('nanaudit.report.html', 'nanaudit.report.junit', "
             "'nanaudit.report.markdown', 'nanaudit.report.github', 'nanaudit.report.console', "
             "'pygments') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.split(maxsplit=1) == ["JsonRenderer", "[]\n"]
    names = {"json": "JsonRenderer", "junit": "JunitRenderer", "github": "GithubRenderer",
             "markdown": "MarkdownRenderer", "html": "HtmlRenderer"}
    assert {name: type(renderer_for(name)).__name__ for name in names} == names
    with pytest.raises(KeyError):
        renderer_for("yaml")


def test_a_batch_level_value_lists_its_first_rows_and_counts_them_keeping_all_in_json():
    # A standardization that divides by a zero std makes every row of the batch NaN: 128 rows
    # named one by one in the console (twice: the facts and the next line) said nothing more.
    report = canonical_report()
    report.finding.samples = list(range(128))
    console = Console(record=True, width=400, color_system=None)
    print_report(report, console)
    text = console.export_text()
    assert text.count("[0, 1, 2, 3, 4, 5, 6, 7, ...] (128 rows)") == 2, text
    assert "inspect batch rows [0, 1, 2, 3, 4, 5, 6, 7, ...] (128 rows) of step 6" in text
    assert "127" not in text
    assert _json(report)["finding"]["samples"] == list(range(128))
    assert "inspect batch rows [5] of step 6" in _next_line(canonical_report())
