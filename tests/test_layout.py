"""The README's Layout holds: stage packages import only the stages below them (no cycle)."""

import ast
from pathlib import Path

import nanaudit

# Bottom to top, as README's Layout table names them; a stage may import itself and below.
STAGES = [("_version", "exitcodes"), ("report",), ("errors",), ("config",), ("run",),
          ("localize",), ("commands",), ("integrations", "cli", "demo"),
          ("__init__", "__main__")]
RANK = {name: level for level, names in enumerate(STAGES) for name in names}
PACKAGE = Path(nanaudit.__file__).parent


def _stage(module: str) -> str:
    """`nanaudit.run.loop` -> `run`; `nanaudit` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """Every nanaudit module the file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nanaudit":
                found.update(f"nanaudit.{alias.name}" for alias in node.names)
            elif node.module.startswith("nanaudit."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("nanaudit."))
    return found


def _files():
    """(stage, file) for every module: `run/loop.py` is in `run`, `cli.py` in `cli`."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).parts[0].removesuffix(".py"), path


def test_every_module_has_a_stage():
    assert [str(path) for stage, path in _files() if stage not in RANK] == []


def test_no_import_runs_up_a_stage():
    upward = [f"{path.relative_to(PACKAGE)} imports {target}"
              for stage, path in _files() for target in sorted(_imports(path))
              if RANK[_stage(target)] > RANK[stage]]
    assert upward == []
