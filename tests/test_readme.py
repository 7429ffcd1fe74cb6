"""The README's reference tables and set-up commands are checked against the code, so they
cannot drift: the exit codes (`ExitCode`), the config's keys and defaults (the schema's
dataclasses), the causes (the catalogue), the Layout's stages (tests/test_layout.py), and the
two set-up commands against `.ci/run`. The package face is checked as a type checker sees it."""

from __future__ import annotations

import dataclasses
import re
import shlex
import sys

import pytest
import yaml
from helpers import ROOT

README = (ROOT / "README.md").read_text(encoding="utf-8")
CI_RUN = (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _section(heading: str) -> str:
    """The text under a `## heading` up to the next `## `."""
    start = README.index(f"\n## {heading}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end != -1 else None]


def _tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in `text`: a list of rows (header and separator left out), each a
    list of its cells, stripped. `\\|` inside a cell is a literal bar."""
    tables, rows, in_table = [], [], False
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|")
                     for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append(cells)
            in_table = True
        elif in_table:
            tables.append([r for r in rows[1:] if not set("".join(r)) <= set("-: ")])
            rows, in_table = [], False
    return tables


def _code(cell: str) -> str:
    """`name` -> name."""
    assert cell.startswith("`") and cell.endswith("`"), cell
    return cell[1:-1]


def _code_blocks() -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", README, re.S | re.M)


# --- exit codes ---------------------------------------------------------------------------

def test_exit_code_table_is_the_enum():
    from nanaudit.exitcodes import ExitCode
    (table,) = _tables(_section("Exit codes"))
    assert [(int(code), meaning) for code, meaning in table] == \
        [(int(code), code.doc) for code in ExitCode]


# --- the config ---------------------------------------------------------------------------

def _config_tables():
    top, sections = _tables(_section("The config (schema version 1)"))
    return ({_code(key): default for key, default, _ in top},
            {_code(key): default for key, default, _ in sections})


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _yaml(cell: str):
    return yaml.safe_load(_code(cell))


def test_config_top_level_keys_and_defaults_are_the_schema():
    from nanaudit.config.schema import SCHEMA_VERSION, Config
    top, _ = _config_tables()
    fields = [f for f in dataclasses.fields(Config) if f.name != "path"]   # path: the file's own
    assert sorted(top) == sorted(["schema_version", *(f.name for f in fields)])
    assert _yaml(top["schema_version"]) == SCHEMA_VERSION
    for field in fields:
        default, cell = _default(field), top[field.name]
        if default is dataclasses.MISSING:
            assert cell == "required", field.name
        elif dataclasses.is_dataclass(default):
            assert cell == "section", field.name
        else:
            assert _yaml(cell) == default, field.name


def test_config_section_keys_and_defaults_are_the_schema():
    from nanaudit.config.schema import Config
    _, sections = _config_tables()
    expected = {}
    for field in dataclasses.fields(Config):
        default = _default(field)
        if dataclasses.is_dataclass(default):
            for option in dataclasses.fields(default):
                expected[f"{field.name}.{option.name}"] = getattr(default, option.name)
    assert sorted(sections) == sorted(expected)
    for key, default in expected.items():
        value = _yaml(sections[key])
        same_type = type(value) is type(default) or (type(default) is float and type(value) is int)
        assert value == default and same_type, key


# --- causes -------------------------------------------------------------------------------

def _catalogue() -> dict[str, str]:
    """id -> what it means, from the catalogue, whether an entry is a (meaning, fix) pair or
    an object with a `meaning`."""
    from nanaudit.localize.causes import CAUSES
    return {str(cause): entry[0] if isinstance(entry, tuple) else entry.meaning
            for cause, entry in CAUSES.items()}


def test_cause_table_is_the_catalogue():
    (table,) = _tables(_section("Causes"))
    assert {_code(cause): meaning for cause, meaning in table} == _catalogue()
    assert len(table) == len(_catalogue())


# --- layout -------------------------------------------------------------------------------

def test_layout_table_lists_the_stages_of_test_layout_bottom_up():
    from test_layout import STAGES
    (table,) = _tables(_section("Layout"))
    listed = [tuple(re.sub(r"(\.py|/)$", "", name) for name in re.findall(r"`([^`]+)`", stage))
              for stage, _ in table]
    assert listed == [tuple(names) for names in STAGES]


# --- set-up commands ----------------------------------------------------------------------

def _commands(block: str) -> list[str]:
    """The shell commands of a one-line block, split at `&&`."""
    (line,) = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    return [command.strip() for command in line.split("&&")]


def test_the_first_two_code_blocks_are_the_set_up_commands():
    use, develop = _code_blocks()[:2]
    torch_first = "pip install torch==2.13.0"
    assert _commands(use) == [torch_first, "pip install -e .", "nanaudit scan configs/demo.yaml"]
    assert _commands(develop)[:2] == [torch_first, 'pip install -e ".[test]"']
    assert _commands(develop)[2].startswith("python -m pytest")
    # CI installs the same torch, before the project and its test extras.
    lines = CI_RUN.splitlines()
    torch_line = next(i for i, ln in enumerate(lines) if "pip install" in ln and "torch" in ln)
    extras_line = next(i for i, ln in enumerate(lines) if "pip install" in ln and "[test]" in ln)
    assert torch_line < extras_line
    assert "torch==2.13.0" in shlex.split(lines[torch_line])
    assert '-e ".[test]"' in lines[extras_line]


def test_ci_runs_the_readme_test_command_after_lint_and_types():
    test_command = _commands(_code_blocks()[1])[2]
    lines = [ln.strip() for ln in CI_RUN.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[-1] == test_command
    assert lines.index("ruff check nanaudit tests scripts configs") < lines.index("mypy") \
        < len(lines) - 1


# --- the package face ---------------------------------------------------------------------

FACE = ("Sentinel", "NonFiniteError", "audit", "Report", "Finding", "__version__")


def test_the_package_face_is_visible_to_type_checkers(tmp_path, monkeypatch):
    """mypy sees each name of `nanaudit.__all__` as its real class or function, not `Any`
    (a module `__getattr__` alone would give Any)."""
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "face.py"
    snippet.write_text("import nanaudit\n" + "".join(f"reveal_type(nanaudit.{name})\n"
                                                   for name in FACE))
    config = tmp_path / "mypy.ini"   # torch's own sources are not what is checked here
    config.write_text("[mypy]\nfollow_imports = silent\nignore_missing_imports = True\n"
                      "[mypy-torch.*]\nfollow_imports = skip\n")
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    out, err, status = api.run([str(snippet), "--config-file", str(config),
                                "--cache-dir", str(tmp_path / "cache")])
    revealed = re.findall(r'face\.py:(\d+): note: Revealed type is "(.*)"', out)
    assert status == 0 and len(revealed) == len(FACE), out + err
    types = dict(zip(FACE, (t for _, t in revealed)))
    assert types["__version__"] == "str"
    returns = {"Sentinel": "Sentinel", "NonFiniteError": "NonFiniteError", "Report": "Report",
               "Finding": "Finding", "audit": "Report"}   # a class's constructor, audit's result
    for name, result in returns.items():
        assert re.search(rf"-> [\w.]*\b{result}$", types[name]), (name, types[name])


def test_importing_the_face_imports_no_torch():
    import subprocess
    code = ("import sys, nanaudit; from nanaudit import audit, __version__; "
            f"assert sorted(nanaudit.__all__) == sorted({FACE!r}); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the demo's panel ---------------------------------------------------------------------

def demo_panel(width: int = 90) -> str:
    """What `nanaudit scan configs/demo.yaml` prints in a `width`-column terminal, from its
    headline to its timeline (the header's timing and the next steps' paths vary by run), with
    the checkout's root left out of the source file's path."""
    import io

    from rich.console import Console

    from nanaudit.commands.scan import scan
    from nanaudit.report.console import print_report
    out = io.StringIO()
    print_report(scan(ROOT / "configs" / "demo.yaml"),
                 Console(file=out, width=width, force_terminal=True, color_system=None,
                         highlight=False, legacy_windows=False))
    root = f"{ROOT.resolve()}/"
    lines = []
    for line in out.getvalue().splitlines():
        if root in line and line.endswith("│"):    # keep the box's right edge where it was
            line = line.replace(root, "")[:-1] + " " * len(root) + "│"
        lines.append(line.rstrip())
    start = next(i for i, line in enumerate(lines) if line.startswith("✗ "))
    end = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    return "\n".join(lines[start:end])


@pytest.mark.slow
def test_the_demo_panel_is_the_demos_output():
    block = re.search(r"in a 90-column terminal.*?\n```\n(.*?)\n```", _section("What the demo "
                                                                             "prints"), re.S)
    assert block is not None and block.group(1) == demo_panel(90)
