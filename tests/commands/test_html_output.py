"""`--html PATH` through the command line: written with the other reports, its JSON the one
`--json` wrote, checked before the run (exit 9), and partial on Ctrl-C like every output."""

import json

from helpers import INTERRUPTED_CASE, ROOT, run_cli

from nanaudit.exitcodes import ExitCode
from nanaudit.report.html_text import embedded_json


def test_scan_writes_the_page_with_the_json_it_wrote(tmp_path):
    result = run_cli("scan", ROOT / "configs" / "demo.yaml", "--quiet", "--no-repro",
                     "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert result.code == ExitCode.NONFINITE
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert embedded_json(page) == (tmp_path / "r.json").read_text(encoding="utf-8")
    # The verdict, the user's line among its neighbours (read from the demo's source), the row.
    assert "non-finite nan at step 6 (backward): sqrt-domain" in page
    assert 'class="hit"><td class="ln">26</td><td>        length = torch.sqrt(' in page
    assert '<td class="ln">25</td><td>        z = x * self.gain</td>' in page
    assert "<h3>row 5</h3>" in page and 'id="chain"' in page


def test_bisect_page_lists_every_bad_batch(tmp_path):
    result = run_cli("bisect", ROOT / "configs" / "poisoned_data.yaml", "--quiet",
                     "--html", tmp_path / "b.html")
    assert result.code == ExitCode.NONFINITE
    page = (tmp_path / "b.html").read_text(encoding="utf-8")
    assert "Bisect: 3 bad batch(es) of 12 audited" in page
    for batch, cause in ((2, "nonfinite-input"), (6, "sqrt-domain"), (9, "nonfinite-input")):
        assert f"<summary>batch {batch}: {cause}</summary>" in page
    assert json.loads(embedded_json(page))["bisect"]["skip_list"][1]["sample_ids"] == [101]


def test_an_unwritable_page_is_exit_9_before_any_step(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    for command in ("scan", "bisect"):
        result = run_cli(command, ROOT / "configs" / "demo.yaml", "--html",
                         tmp_path / "file" / "r.html")
        assert result.code == ExitCode.OUTPUT, command
        assert "cannot write" in result.stderr and "r.html" in result.stderr


def test_ctrl_c_still_writes_a_partial_page(case, tmp_path):
    result = run_cli("scan", case(INTERRUPTED_CASE, data="case:interrupted"), "--quiet",
                     "--html", tmp_path / "r.html")
    assert result.code == ExitCode.INTERRUPTED
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "interrupted after 2 step(s): partial report" in page
    assert json.loads(embedded_json(page))["status"] == "interrupted"
