"""The closed vocabularies are closed for the type checker too: a misspelt cause, where or check
in code that builds a finding or a trip fails mypy (and so CI), not a reader of the JSON."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from nanaudit.report.vocabulary import Cause, Check, Where

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
    from nanaudit.report.model import ChainLink, Finding
    from nanaudit.report.vocabulary import Cause, Check, Where

    def checked(check: Check) -> bool:
        return check == Check.SCHEDULE

    finding = Finding(step=0, where=Where.BACKWARD, value="nan", cause=Cause.DIV_BY_ZERO,
                      explanation="", fix="")
    link = ChainLink(op="aten.div.Tensor", where=Where.FORWARD, module=None, value=["inf"],
                     line=None)
    finding.cause = Cause.DIVERGENCE
    checked(Check.ERROR)
"""

# what is misspelt: (as written, misspelt, what mypy says of it)
MISSPELT = {
    "cause": ('cause=Cause.DIV_BY_ZERO,', 'cause="div-by-zer0",',
              'Argument "cause" to "Finding" has incompatible type "str"; expected "Cause"'),
    "where": ('where=Where.BACKWARD,', 'where="backwrad",',
              'Argument "where" to "Finding" has incompatible type "str"; expected "Where"'),
    "assigned cause": ('finding.cause = Cause.DIVERGENCE', 'finding.cause = "divergense"',
                       'expression has type "str", variable has type "Cause"'),
    "check": ('checked(Check.ERROR)', 'checked("eror")',
              'Argument 1 to "checked" has incompatible type "str"; expected "Check"'),
}


def _mypy(tmp_path: Path, sources: dict[str, str]) -> tuple[int, str]:
    """mypy's exit code and output on the snippets (module name -> source), in one run."""
    api = pytest.importorskip("mypy.api")
    paths = []
    for name, source in sources.items():
        paths.append(tmp_path / f"{name}.py")
        paths[-1].write_text(textwrap.dedent(source))
    cache = tmp_path / "cache"
    if (ROOT / ".mypy_cache").is_dir():
        # CI runs mypy on the package before the tests: start from a copy of its cache, so only
        # the snippets are checked (a cold cache re-reads torch's stubs: about half a minute)
        shutil.copytree(ROOT / ".mypy_cache", cache)
    out, err, code = api.run([*map(str, paths), "--config-file", str(ROOT / "pyproject.toml"),
                              "--cache-dir", str(cache)])
    return code, out + err


def test_schedule_and_error_are_checks():
    assert Check("schedule") is Check.SCHEDULE and Check("error") is Check.ERROR
    assert {str(w) for w in Where} == {"input", "parameter", "forward", "backward", "optimizer"}
    assert str(Cause.DIV_BY_ZERO) == "div-by-zero" and f"{Cause.POLE}" == "pole"


@pytest.mark.slow
def test_a_misspelt_cause_where_or_check_fails_mypy(tmp_path):
    bad = GOOD
    for right, wrong, _ in MISSPELT.values():
        assert right in bad
        bad = bad.replace(right, wrong)
    # One mypy run (loading torch's cached types is most of its time) over the control, spelt
    # right, and the misspelt copy: only the copy's four lines are errors.
    code, out = _mypy(tmp_path, {"spelt_right": GOOD, "misspelt": bad})
    assert code == 1 and "Found 4 errors in 1 file" in out, out
    assert "spelt_right.py" not in out, out
    for name, (_, _, said) in MISSPELT.items():
        assert said in out, (name, out)
