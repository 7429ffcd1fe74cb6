"""The HTML report's finding: where the value was made (the facts, the user's source with the
line highlighted among its neighbours, the creating op's inputs, why and the fix), the chain
of ops that carried it to the check that tripped, and the offending rows of the batch.

The report holds the user's line itself; its neighbours are read from the file when the page
is rendered, only while the file is readable and still has that line there (a file edited
since shows the recorded line alone), and a file that cannot be read never fails the page.
"""

from __future__ import annotations

import linecache
import os

from nanaudit.report.html_text import esc, facts_table, number, number_text, table
from nanaudit.report.model import Finding, SourceLine, TensorStats
from nanaudit.report.text import (
    RELEASED,
    RELEASED_WHY,
    describe,
    finding_facts,
    module_label,
    sample_value,
    search_summary,
)

CONTEXT = 3             # source lines shown each side of the user's line
CHAIN_OPEN = 25         # a longer chain is folded into <details>
VALUES_SHOWN = 16       # a tiny tensor's values listed inline, at most


def finding_sections(f: Finding) -> list[str]:
    """The finding, the chain, the rows: each a <section>, left out when there is nothing."""
    return [s for s in (_finding(f), _chain(f), _rows(f)) if s]


def finding_details(f: Finding) -> str:
    """The facts, source, inputs, why and fix of one finding (bisect's bad batches too)."""
    facts = finding_facts(f)
    if f.sample_search:
        facts.append(("sample search", search_summary(f.sample_search)))
    if len(f.tensors) > 1:
        facts.append(("all tensors", ", ".join(map(str, f.tensors))))
    parts = [facts_table(facts)]
    if f.source:
        parts.append(source_block(f.source))
    if f.inputs:
        title = f"inputs of {esc(f.op)}, the op that created it" if f.op else "tensors"
        parts.append(f"<h3>{title}</h3>" + stats_table(f.inputs))
    if f.forward_inputs:
        parts.append(f"<h3>inputs of the forward op {esc(f.forward_op or '')}</h3>"
                     + stats_table(f.forward_inputs))
    if f.reproduced is False:
        parts.append('<p class="warn">not reproduced on replay: see the explanation</p>')
    parts.append(f'<p class="why"><b>why</b> {esc(f.explanation)}</p>')
    parts.append(f'<p class="fix"><b>fix</b> {esc(f.fix)}</p>')
    return "".join(parts)


def _finding(f: Finding) -> str:
    return (f'<section id="finding"><h2>Finding: {esc(f.cause)}</h2>'
            f"{finding_details(f)}</section>")


def source_lines(src: SourceLine, context: int = CONTEXT) -> list[tuple[int, str]]:
    """(number, text) of the user's line and its neighbours, or the recorded line alone."""
    alone = [(src.line, src.code)]
    try:
        if not (src.line and os.path.isfile(src.file)):
            return alone
        linecache.checkcache(src.file)
        if linecache.getline(src.file, src.line).strip() != src.code.strip():
            return alone        # the file changed since the run: its neighbours would lie
        lines = []
        for n in range(max(1, src.line - context), src.line + context + 1):
            text = linecache.getline(src.file, n)
            if not text:        # past the end of the file ("" here; a blank line is "\n")
                break
            lines.append((n, text.rstrip("\r\n")))
        return lines
    except (OSError, ValueError):
        return alone


def source_block(src: SourceLine) -> str:
    function = f" in {esc(src.function)}" if src.function else ""
    hit = ' class="hit"'
    rows = "".join(
        f'<tr{hit if n == src.line else ""}><td class="ln">{n}</td>'
        f"<td>{esc(text)}</td></tr>" for n, text in source_lines(src))
    return (f'<h3 class="mono">{esc(src.file)}:{src.line}{function}</h3>'
            f'<table class="source mono"><tbody>{rows}</tbody></table>')


def _count(n: int | None) -> str:
    return f'<span class="bad">{n}</span>' if n else "0"


def stats_table(stats: list[TensorStats]) -> str:
    """Shape, dtype, range and the counts that explain an op (non-finite counts in red)."""
    rows = []
    for s in stats:
        values = ""
        if isinstance(s.value, (list, tuple)):
            shown = ", ".join(number(v) for v in s.value[:VALUES_SHOWN])
            values = shown + (" …" if len(s.value) > VALUES_SHOWN else "")
        counts = [_count(s.nan), _count(s.posinf), _count(s.neginf), str(s.zeros),
                  str(s.negatives)]
        if s.released:      # no values were read: no counts, and the row says why
            counts = [f'<span title="{esc(RELEASED_WHY)}">{RELEASED}</span>'] + [""] * 4
        rows.append([esc(s.name), esc(list(s.shape)), esc(s.dtype), number(s.min),
                     number(s.max), number(s.mean), *counts,
                     f'<span class="mono">{values}</span>'])
    return table(("input", "shape", "dtype", "min", "max", "mean", "nan", "+inf", "-inf",
                  "zeros", "neg", "values"), rows, numeric=tuple(range(3, 11)))


def _chain(f: Finding) -> str:
    if not f.chain:
        return ""
    rows = [[str(i), f'<span class="mono">{esc(link.op)}</span>', esc(link.where),
             esc(module_label(link.module) or "—"),
             "—" if link.line is None else str(link.line),
             esc("; ".join(link.received)) or "—",
             f'<span class="bad">{esc(", ".join(map(str, link.value)))}</span>']
            for i, link in enumerate(f.chain, start=1)]
    body = table(("#", "op", "where", "module", "line", "received", "returned"), rows,
                 numeric=(0, 4))
    if len(f.chain) > CHAIN_OPEN:
        body = (f"<details><summary>{len(f.chain)} ops, from {esc(f.chain[0].op)} to "
                f"{esc(f.chain[-1].op)}</summary>{body}</details>")
    return ('<section id="chain"><h2>From the creating op to the check</h2>'
            '<p class="muted">op by op, the first one created the value (its inputs are '
            'above); each received its inputs with the kinds listed and returned the '
            'non-finite kinds listed.</p>' + body + "</section>")


def _rows(f: Finding) -> str:
    if not f.sample_rows:
        return ""
    parts = ['<section id="rows"><h2>Offending rows</h2>']
    if f.samples:
        parts.append(f"<p>rows {esc(f.samples)} of the batch reproduce it"
                     f"{' together' if f.sample_search and f.sample_search.coupled else ''}"
                     f".</p>")
    for row in f.sample_rows:
        cells = [[esc(path), f'<span class="mono">{esc(sample_value(value))}</span>']
                 for path, value in row.values]
        for path, stats in row.leaves:
            shown = (", ".join(number_text(v) for v in stats.value[:VALUES_SHOWN])
                     if isinstance(stats.value, (list, tuple)) else describe(stats))
            cells.append([esc(path), f'<span class="mono">{esc(shown)}</span>'])
        parts.append(f"<h3>row {row.index}</h3>" + table(("leaf", "values / statistics"),
                                                        cells))
    return "".join(parts) + "</section>"
