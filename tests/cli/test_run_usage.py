"""`nanaudit run`'s own options come before the script: an unknown one is a usage error that
names the closest option (exit 2, as every command gives), never taken for the script; a
script whose name starts with `-` is given after `--`; what follows the script is its own."""

from __future__ import annotations

import textwrap
from pathlib import Path

from helpers import run_cli

SCRIPT = """
    import sys
    from pathlib import Path
    Path("ran.txt").write_text(" ".join(sys.argv[1:]))
"""


def _script(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def test_a_mistyped_option_is_a_usage_error_naming_the_closest(tmp_path):
    script = _script(tmp_path, "train.py")
    result = run_cli("run", "--jsn", tmp_path / "out.json", script)
    assert result.code == 2
    assert "No such option '--jsn'" in result.stderr and "Did you mean '--json'?" in result.stderr
    assert not (tmp_path / "ran.txt").exists()         # the script never ran


def test_an_unknown_option_after_known_ones_is_still_refused(tmp_path):
    script = _script(tmp_path, "train.py")
    result = run_cli("run", "--seed", "3", "--quiet", "--max-rerun-step=2", script)
    assert result.code == 2 and "No such option '--max-rerun-step'" in result.stderr
    assert "'--max-rerun-steps'" in result.stderr
    assert not (tmp_path / "ran.txt").exists()


def test_a_script_named_with_a_dash_runs_after_double_dash(tmp_path):
    script = _script(tmp_path, "-train.py")
    result = run_cli("run", "--quiet", "--json", tmp_path / "out.json", "--", script, "--lr",
                     "3")
    assert result.code not in (2, 3), result.stderr
    assert (tmp_path / "ran.txt").read_text() == "--lr 3"


def test_the_scripts_own_options_stay_the_scripts(tmp_path):
    script = _script(tmp_path, "train.py")
    result = run_cli("run", "--quiet", "--json=" + str(tmp_path / "out.json"), script,
                     "--jsn", "x", "-q")
    assert result.code not in (2, 3), result.stderr
    assert (tmp_path / "ran.txt").read_text() == "--jsn x -q"


def test_our_refusal_wrapped_by_a_library_is_still_ours(tmp_path):
    """torch 2.11's pipeline stage re-raises whatever its forward raised as a RuntimeError from
    it: a refusal nanaudit raised inside the user's code keeps its exit code and message (2,
    not the user's error 4)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from nanaudit.errors import UsageError

        def stage_forward():
            raise UsageError("`Sequential` runs as a stage of a pipeline")

        try:
            stage_forward()
        except Exception as e:
            raise RuntimeError("[Stage 0] failed to run forward:") from e
    """))
    result = run_cli("run", script)
    assert result.code == 2, result.stderr
    assert "runs as a stage of a pipeline" in result.stderr
    assert "failed to run forward" not in result.stderr


def test_a_users_own_wrapped_error_stays_the_users(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("try:\n    {}['missing']\nexcept KeyError as e:\n"
                      "    raise RuntimeError('no config key') from e\n")
    result = run_cli("run", script)
    assert result.code == 4 and "RuntimeError: no config key" in result.stderr
