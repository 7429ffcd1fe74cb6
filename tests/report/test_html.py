"""The HTML report: its content in reading order, the embedded JSON equal to `--json`'s, no
external reference, and no string a user's program chose becoming markup or script."""

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from nanaudit.report.html import render_html
from nanaudit.report.html_finding import source_lines
from nanaudit.report.html_text import embed_json, embedded_json, json_text
from nanaudit.report.json import JsonRenderer
from nanaudit.report.model import (
    ChainLink,
    EarlyWarning,
    Finding,
    Report,
    SampleRow,
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
    RankStatus,
    SkipEntry,
    UserCodeFailure,
    UserFrame,
)

EVIL_MODULE = "</script><script>alert(1)</script>"
EVIL_KEY = 'batch["<img src=x onerror=alert(2)>"]'
EVIL_PATH = "/tmp/\"quoted\" 'single' & <angle>.py"
SURROGATE = "bad bytes \udc80 here"


def _stats(name, nan=0, value=None):
    return TensorStats(name, (4,), "float32", 4, -1.0, 2.0, 0.5, nan, 0, 0, 1, 1, value)


def finding_report(module="encoder.attn", key='batch["x"]', path="model.py",
                   message="log of zero") -> Report:
    finding = Finding(
        step=6, where="forward", value="nan", cause="log-domain", explanation=message,
        fix="`torch.log(x.clamp(min=eps))`", op="aten.log.default", module=module,
        source=SourceLine(path, 12, "y = torch.log(x)  # <b>not bold</b>", "forward"),
        samples=[3], inputs=[_stats("self", value=[0.0, 1.0, -1.0, 2.0])], reproduced=True,
        sample_rows=[SampleRow(3, leaves=((key, _stats(key, value=[0.0, 0.5])),),
                               values=(('batch["id"]', "clip<0042>.wav"),))],
        sample_search=SampleSearch(batch_size=8, replays=5, coupled=False),
        chain=[ChainLink("aten.log.default", "forward", module, ["-inf"], 12),
               ChainLink("aten.mul.Tensor", "forward", "", ["nan"], 13,
                         received=["self: -inf", "other: finite"])],
        batch_index=6)
    timeline = [TimelineEntry(i, 1.0 / (i + 1), 0.5 * (i + 1), 4.0, 1e-3, 0.5,
                              scale=65536.0 / 2 ** (i // 3), skipped=i == 4)
                for i in range(6)]
    timeline.append(TimelineEntry(6, float("nan"), float("inf"), 4.0, 1e-3, 0.5))
    warning = EarlyWarning(kind="grad-growth", step=4, began=1, message=f"grew in {module}")
    return Report(tool_version="0.1.0", config={"path": "cfg.yaml", "seed": 3,
                                                "precision": "fp16"},
                  torch_version="2.13.0", device="cpu", status="nonfinite", steps_run=7,
                  finding=finding, timeline=timeline, warnings=[warning], duration_s=1.5,
                  repro="out/repro-step6")


def hostile_report() -> Report:
    report = finding_report(EVIL_MODULE, EVIL_KEY, EVIL_PATH, SURROGATE)
    report.error = UserCodeFailure(message=f"the loss raised ValueError: {SURROGATE}",
                                   what=f"the loss `{EVIL_MODULE}`", exception="ValueError",
                                   frames=[UserFrame(EVIL_PATH, 3, EVIL_MODULE, "x = '<!--'")])
    return report


class Elements(HTMLParser):
    """Every element the browser's tokenizer would make, with its attributes."""

    def __init__(self, page: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def test_the_page_shows_verdict_timeline_finding_chain_rows_and_how_to_reproduce():
    page = render_html(finding_report())
    order = [page.index(needle) for needle in (
        'class="verdict nonfinite"', 'id="timeline"', 'id="finding"', 'id="chain"',
        'id="rows"', 'id="warnings"', 'id="environment"', 'id="json"')]
    assert order == sorted(order)
    verdict = page[:page.index('id="timeline"')]
    for needle in ("non-finite nan at step 6 (forward): log-domain", "<dt>batch</dt><dd>6</dd>",
                   "<dt>samples</dt><dd>[3]</dd>", "torch.log(x.clamp(min=eps))"):
        assert needle in verdict
    # Loss, gradient norm and loss scale are drawn; the non-finite step is a cross.
    assert page.count('<svg class="chart"') == 3 and "loss scale (GradScaler)" in page
    assert "step 6: gradient norm inf" in page and "step 4: skipped by the GradScaler" in page
    assert "step 4, growing since step 1: grad-growth" in page
    # The user's line, its op inputs, the chain, the rows with their ids.
    assert "<td>y = torch.log(x)  # &lt;b&gt;not bold&lt;/b&gt;</td>" in page
    assert "inputs of aten.log.default, the op that created it" in page
    assert page.count("<td><span class=\"mono\">aten.") == 2 and "(root)" in page
    assert "<td>self: -inf; other: finite</td>" in page and "<td>—</td>" in page
    assert "clip&lt;0042&gt;.wav" in page and "<h3>row 3</h3>" in page
    assert "python out/repro-step6/repro.py --rows" in page and "nanaudit scan cfg.yaml" in page
    assert "<th>precision</th><td>fp16</td>" in page and "<th>seed</th><td>3</td>" in page


def test_embedded_json_is_exactly_what_json_writes():
    for report in (finding_report(), hostile_report()):
        text = JsonRenderer().render(report)
        page = render_html(report)
        assert embedded_json(page) == text
        assert json.loads(embedded_json(page)) == json.loads(text)
    # The escapes survive a user's own backslashes: `\u003c` typed by the user stays text.
    tricky = json.dumps({"a": "\\u003c</script>&\\", "b": "\u2028"}, indent=2)
    assert json_text(embed_json(tricky)) == tricky
    assert "</" not in embed_json(tricky) and json.loads(embed_json(tricky)) == json.loads(tricky)


def test_nothing_is_loaded_from_anywhere():
    page = render_html(finding_report())
    assert re.findall(r"https?:|src\s*=|@import|\burl\(", page, flags=re.I) == []
    elements = Elements(page)
    assert {a["href"][0] for t, a in elements.tags if "href" in a} == {"#"}
    scripts = [a for t, a in elements.tags if t == "script"]
    assert scripts == [{"type": "application/json", "id": "nanaudit-report"}, {}]
    policy = next(a["content"] for t, a in elements.tags if a.get("http-equiv"))
    assert policy.startswith("default-src 'none'; style-src 'sha256-")
    assert len(page.encode()) < 100_000


def test_hostile_names_are_text_never_markup():
    page = render_html(hostile_report())
    page.encode("utf-8")            # a lone surrogate must not stop the page being written
    elements = Elements(page)
    tags = [t for t, _ in elements.tags]
    assert tags.count("script") == 2 and "img" not in tags
    assert not [a for _, attrs in elements.tags for a in attrs if a.startswith("on")]
    text = "".join(elements.text)
    for name in (EVIL_MODULE, EVIL_KEY, EVIL_PATH, "bad bytes \\udc80 here"):
        assert name in text, name
    assert "&lt;/script&gt;&lt;script&gt;alert(1)" in page and EVIL_MODULE not in page
    assert "<img" not in page and "</script><script>alert" not in page


def test_a_clean_run_is_a_short_page_with_its_timeline():
    report = finding_report()
    report.status, report.finding, report.warnings, report.repro = "clean", None, [], None
    report.timeline = report.timeline[:6]
    page = render_html(report)
    assert 'class="verdict clean"' in page and "clean: 7 step(s) audited" in page
    assert 'id="timeline"' in page and 'id="finding"' not in page and 'id="rows"' not in page


def test_series_never_measured_get_no_chart_and_one_sample_a_sentence():
    report = finding_report()
    for e in report.timeline:
        e.scale = None
    report.timeline[2].update_ratio = 0.004
    page = render_html(report)
    assert "<figcaption>loss scale" not in page and "largest |activation|" not in page
    assert page.count('<svg class="chart"') == 2
    assert "|update| / |weights|: <b>0.004</b> at step 2" in page


def test_a_long_timeline_stays_small():
    report = finding_report()
    report.timeline = [TimelineEntry(i, 1.0 + (i % 7), 2.0, 4.0, 1e-3, 0.5)
                       for i in range(20_000)]
    page = render_html(report)
    html_only = page[:page.index('<script type="application/json"')]
    assert len(html_only.encode()) < 150_000 and "<circle" not in html_only


def test_bisect_shows_every_bad_batch_and_the_checkpoint_search_path():
    report = finding_report()
    bad = [report.finding, finding_report().finding]
    bad[1].batch_index, bad[1].samples = 9, [0, 2]
    report.bisect = DataBisect(batches_audited=12, bad_batches=bad, skip_list=[
        SkipEntry(6, [3], ["<id-3>"], "log-domain"), SkipEntry(9, [0, 2], None, "log-domain",
                                                               confirmed=False)])
    page = render_html(report)
    assert "Bisect: 2 bad batch(es) of 12 audited" in page and "[&#x27;&lt;id-3&gt;&#x27;]" in page
    assert "<summary>batch 9: log-domain</summary>" in page and "[0, 2]" in page
    report.bisect = CheckpointBisect(checkpoints=8, checkpoints_loaded=3, loaded_steps=[400, 200,
                                     300], linear_loads=4,
                                     first_bad=CheckpointRef(300, "ck/step_300.pt"),
                                     last_good=CheckpointRef(200, "ck/step_200.pt"),
                                     steps_replayed=100, optimizer_state=True, reproduced=True)
    report.command = "bisect"
    page = render_html(report)
    verdicts = re.findall(r'<td class="num">\d</td><td class="num">(\d+)</td><td><span '
                          r'class="(bad|ok)">', page)
    assert verdicts == [("400", "bad"), ("200", "ok"), ("300", "bad")]
    assert "nanaudit bisect cfg.yaml --checkpoints ck" in page


def test_every_rank_has_its_status():
    report = finding_report()
    report.finding.rank = 1
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0, ranks=[
                                            RankStatus(0, "nonfinite", 7, "cpu", "h", 0),
                                            RankStatus(1, "nonfinite", 7, "cpu", "h<2>", 1)])
    page = render_html(report)
    assert "world size 2, backend gloo" in page and "h&lt;2&gt;" in page
    assert '1 <span class="bad">(finding)</span>' in page
    assert "torchrun --nproc-per-node 2 -m nanaudit scan cfg.yaml" in page


def test_errors_show_their_problems():
    report = finding_report()
    report.status, report.finding = "error", None
    report.error = ConfigFailure(message="2 problems", source="cfg.yaml",
                                 problems=[ConfigProblem("optimizer.lr", "expected a number")])
    page = render_html(report)
    assert "ConfigError (exit 3)" in page and "<code>optimizer.lr</code>" in page


def test_source_neighbours_come_from_the_file_only_while_it_holds_the_line(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("".join(f"line{n}\n" for n in range(1, 11)))
    src = SourceLine(str(path), 5, "line5")
    assert [n for n, _ in source_lines(src)] == [2, 3, 4, 5, 6, 7, 8]
    assert source_lines(SourceLine(str(path), 9, "line9"))[-1] == (10, "line10")
    assert source_lines(SourceLine(str(path), 5, "edited since")) == [(5, "edited since")]
    assert source_lines(SourceLine(str(tmp_path / "gone.py"), 5, "x")) == [(5, "x")]
    assert source_lines(SourceLine(str(tmp_path), 5, "x")) == [(5, "x")]


def test_callbacks_write_the_page_beside_their_json(tmp_path):
    from nanaudit.integrations._output import write_reports
    paths = write_reports(finding_report(), tmp_path, echo=False)
    page = (tmp_path / "nanaudit.html").read_text(encoding="utf-8")
    assert paths["html"] == str(tmp_path / "nanaudit.html")
    assert embedded_json(page) == (tmp_path / "nanaudit.json").read_text(encoding="utf-8")


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(not _chromium(), reason="Chromium is not installed (Debian: chromium)")
def test_chromium_renders_the_page_and_runs_no_injected_markup(tmp_path):
    page_path = tmp_path / "report.html"
    page_path.write_text(render_html(hostile_report()), encoding="utf-8")
    done = subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                           f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                           page_path.as_uri()], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    elements = Elements(done.stdout)
    tags = [t for t, _ in elements.tags]
    assert "img" not in tags and tags.count("script") == 2
    text = "".join(elements.text)
    assert "non-finite nan at step 6 (forward): log-domain" in text
    assert EVIL_MODULE in text and EVIL_KEY in text
    # The page's own script ran under its policy: the download button was shown.
    assert '<button id="download" type="button">' in done.stdout


def test_the_ranks_table_shows_each_rank_mesh_coordinate_escaped():
    report = finding_report()
    report.finding.rank = 1
    mesh = [{"dp_shard": 0, "tp": 0}, {"dp_shard": 0, "<tp>": 1}]
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0, ranks=[
                                            RankStatus(i, "nonfinite", 7, "cpu", "h", 0, mesh[i])
                                            for i in range(2)])
    page = render_html(report)
    assert "<th>mesh</th>" in page
    assert "<td>dp_shard=0, tp=0</td>" in page and "<td>dp_shard=0, &lt;tp&gt;=1</td>" in page
    report.distributed = DistributedRun(rank=0, world_size=2, backend="gloo", host="h",
                                        local_rank=0, ranks=[
                                            RankStatus(i, "clean", 7, "cpu", "h", 0)
                                            for i in range(2)])
    assert "<th>mesh</th>" not in render_html(report)
