"""The cause ids are a public contract: one enum spells them, the catalogue explains and fixes
each one, and an id reads, formats and serialises exactly as its plain string."""

import json

from nanaudit.localize.causes import CAUSES, fix_for
from nanaudit.report.vocabulary import Cause

# The catalogue's ids, as released (README "Causes"); an id never changes meaning.
CATALOGUE = ("nonfinite-input", "nonfinite-parameter", "log-domain", "div-by-zero",
             "sqrt-domain", "exp-overflow", "trig-domain", "norm-at-zero", "softmax-all-masked",
             "degenerate-reduction", "pole", "dtype-overflow", "masked-nonfinite-gradient",
             "impossible-ctc-target", "divergence", "optimizer-update", "inf-arithmetic",
             "compiled-only", "unknown")


def test_the_enum_holds_exactly_the_catalogue_and_every_id_has_a_fix():
    assert [c.value for c in Cause] == list(CATALOGUE)
    assert list(CAUSES) == list(Cause)
    for cause in Cause:
        meaning, fix = CAUSES[cause]
        assert meaning and fix and fix_for(cause) == fix
        assert fix_for(cause.value) == fix          # a plain id string finds it too


def test_a_cause_reads_as_its_plain_string():
    cause = Cause.LOG_DOMAIN
    assert cause == "log-domain" and str(cause) == "log-domain"
    assert f"{cause}" == "log-domain" and f"{cause:>12}" == "  log-domain"
    assert json.dumps({"cause": cause}) == '{"cause": "log-domain"}'
