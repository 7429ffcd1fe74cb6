"""The command line: exit codes, clean stdout for machine formats, fast help, interrupts."""

import json
import subprocess
import sys

from helpers import INTERRUPTED_CASE, ROOT, run_cli, scan


def test_help_does_not_import_torch():
    code = ("import sys; from nanaudit.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "Exit codes:" in done.stdout and "130" in done.stdout


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "nanaudit", "--version"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and "nanaudit" in done.stdout


def test_usage_error_exits_2():
    assert run_cli("scan").code == 2
    assert run_cli("scan", "x.yaml", "--steps", "0").code == 2


def test_json_to_stdout_keeps_stdout_clean():
    result = run_cli("scan", ROOT / "configs" / "demo.yaml", "--json", "-")
    assert result.code == 1
    body = json.loads(result.stdout)
    assert body["finding"]["cause"] == "sqrt-domain"


def test_console_report_goes_to_stderr():
    result = run_cli("scan", ROOT / "configs" / "demo.yaml")
    assert result.code == 1 and result.stdout == ""
    assert "finding: sqrt-domain" in result.stderr


def _next_line(stderr: str) -> str:
    """The console's closing hints (its last paragraph), unwrapped."""
    return " ".join(stderr[stderr.index("\nnext: ") + 1:].split())


def test_the_closing_hints_do_not_suggest_an_output_already_written(tmp_path):
    demo, clean = ROOT / "configs" / "demo.yaml", ROOT / "configs" / "clean.yaml"
    assert "--json PATH saves this report" in _next_line(run_cli("scan", demo, "--no-repro").stderr)
    written = _next_line(run_cli("scan", demo, "--json", tmp_path / "r.json",
                                 "--no-repro").stderr)
    assert "--json" not in written and written.startswith("next: edit __init__.py:26 as the fix")
    assert "in CI with --junit-xml" in _next_line(run_cli("scan", clean).stderr)
    done = _next_line(run_cli("scan", clean, "--junit-xml", tmp_path / "r.xml").stderr)
    assert "--junit-xml" not in done and done.startswith("next: every batch the data yielded")


def test_github_annotations_when_running_in_actions(tmp_path):
    result = run_cli("scan", ROOT / "configs" / "demo.yaml", "--quiet",
                     env={"GITHUB_ACTIONS": "true"})
    assert result.stdout.startswith("::error file=")
    assert ",line=26,title=nanaudit (sqrt-domain)::" in result.stdout


def test_all_report_files_written(tmp_path):
    result = run_cli("scan", ROOT / "configs" / "demo.yaml", "--quiet",
                     "--json", tmp_path / "r.json", "--junit-xml", tmp_path / "r.xml",
                     "--markdown", tmp_path / "r.md")
    assert result.code == 1
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "nonfinite"
    assert 'failures="1"' in (tmp_path / "r.xml").read_text()
    assert "sqrt-domain" in (tmp_path / "r.md").read_text()
    # The repro bundle goes beside the reports; nothing else is written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.xml",
                                                          "repro-step6"]


def test_steps_option_limits_the_run(tmp_path):
    result = scan(ROOT / "configs" / "demo.yaml", "--steps", "3", tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 3


def test_ctrl_c_leaves_a_valid_partial_report(case, tmp_path):
    result = scan(case(INTERRUPTED_CASE, data="case:interrupted"), tmp_path=tmp_path)
    assert result.code == 130
    assert result.report["status"] == "interrupted" and result.report["steps_run"] == 2
    assert len(result.report["timeline"]) == 2


def test_library_api_returns_the_report():
    import nanaudit
    report = nanaudit.audit(str(ROOT / "configs" / "demo.yaml"), steps=8)
    assert report.status == "nonfinite" and report.finding.step == 6
    assert report.finding.module == "features"


def test_every_output_format_is_an_option_of_every_report_command_and_renders():
    """The outputs table is the one source: each format's option is on every command that
    writes a report, `--format` offers the stdout formats, and each renderer renders."""
    import importlib.util

    from nanaudit.cli import main
    from nanaudit.cli.outputs import FORMATS, STREAM_FORMATS
    from nanaudit.commands.common import early_report
    for name in ("scan", "bisect", "replay", "run"):
        params = {p.name: p for p in main.commands[name].params}
        assert {f.param for f in FORMATS if f.option} <= set(params), name
        assert tuple(params["fmt"].type.choices) == STREAM_FORMATS
    report = early_report("x.yaml", "scan", "SIGINT")
    for fmt in FORMATS:
        if fmt.name == "plot" and importlib.util.find_spec("matplotlib") is None:
            continue
        rendered = fmt.render(report)
        if isinstance(rendered, bytes):
            assert rendered.startswith(b"\x89PNG"), fmt.name
        else:
            assert "interrupted" in rendered, fmt.name


def test_fail_on_choices_are_the_configs():
    from nanaudit.cli import main
    from nanaudit.config.schema import FAIL_ON
    for name in ("scan", "bisect", "replay", "run"):
        fail_on = next(p for p in main.commands[name].params if p.name == "fail_on")
        assert tuple(fail_on.type.choices) == FAIL_ON
