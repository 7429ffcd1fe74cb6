"""The rich console report: header, finding with the user's source line, op inputs, cause, fix,
timeline. User strings are always rich Text, never parsed as markup."""

from __future__ import annotations

import os

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from nanaudit.report.bad_steps_text import bad_step_rows, bad_steps_line, persistent_line
from nanaudit.report.model import Finding, Report, SourceLine, TensorStats
from nanaudit.report.sections import (
    CheckpointBisect,
    DataBisect,
    DistributedRun,
    InternalFailure,
    UserCodeFailure,
)
from nanaudit.report.text import (
    RELEASED,
    RELEASED_WHY,
    describe,
    describe_coordinate,
    finding_facts,
    headline,
    rows_label,
    sample_value,
    search_summary,
    sparkline,
    step_marks,
    summary_line,
    warning_line,
)
from nanaudit.report.vocabulary import Cause


def print_report(report: Report, console: Console, saved: frozenset[str] = frozenset()) -> None:
    """The console report; `saved`: the formats (json, junit, ...) written beside it, which
    its closing hints do not suggest again."""
    console.print(_header(report))
    style = {"clean": "bold green", "nonfinite": "bold red"}.get(report.status, "bold yellow")
    mark = {"clean": "✓", "nonfinite": "✗"}.get(report.status, "!")
    console.print(Text(f"{mark} {headline(report)}", style=style))
    if report.finding is not None:
        # A terminal gets a boxed panel; a CI log the same sections unboxed, so that no line
        # is wrapped or padded to the width of the longest one.
        console.print(_finding_panel(report.finding, boxed=console.is_terminal))
    if report.bad_steps is not None:
        console.print(_bad_steps(report))
    if report.bisect:
        console.print(_bisect_summary(report.bisect))
    if report.distributed is not None and report.distributed.ranks:
        console.print(_ranks(report.distributed))
    if report.warnings:
        console.print(_warnings(report))
    if report.timeline:
        console.print(_timeline(report))
    if isinstance(report.error, UserCodeFailure) and report.error.frames:
        console.print(Text(_user_traceback(report.error), style="red"))
    if isinstance(report.error, UserCodeFailure) and report.error.hint:
        console.print(Text(f"hint: {report.error.hint}", style="bold"))
    if isinstance(report.error, InternalFailure):
        console.print(Text(_short_traceback(report.error.traceback), style="red"))
        console.print(Text(report.error.hint, style="bold"))
    console.print(_next_steps(report, saved))


def _bisect_summary(section: DataBisect | CheckpointBisect) -> RenderableType:
    if isinstance(section, CheckpointBisect):
        return _checkpoint_summary(section)
    table = Table(title=f"bad batches ({len(section.bad_batches)} of "
                        f"{section.batches_audited} audited)", title_justify="left")
    for col in ("batch", "where", "op", "cause", "samples"):
        table.add_column(col)
    for f in section.bad_batches:
        batch = f.batch_index if f.batch_index is not None else f.step
        table.add_row(str(batch), f.where, Text(f.op or f.tensor or ""), f.cause,
                      Text(rows_label(f.samples) or "[]"))
    return table


def _checkpoint_summary(section: CheckpointBisect) -> Text:
    text = Text("bisect over checkpoints: ", style="bold")
    text.append(section.note)
    if section.first_bad:
        text.append(f"\n  first bad checkpoint: step {section.first_bad.step}")
    if section.last_good:
        state = "restored" if section.optimizer_state else "absent (fresh optimizer)"
        text.append(f"; last good: step {section.last_good.step}; replayed "
                    f"{section.steps_replayed} step(s); optimizer state {state}")
    return text


def _ranks(section: DistributedRun) -> Text:
    text = Text(f"ranks ({section.world_size}, {section.backend})\n", style="bold")
    for r in section.ranks or ():
        mesh = f"  {describe_coordinate(r.mesh)}" if r.mesh else ""
        text.append(f"  rank {r.rank}  {r.status:<11} {r.steps_run} step(s)  "
                    f"{r.device} on {r.host}{mesh}\n")
    if section.note:
        text.append(f"  note: {section.note}\n")
    return text


def _header(report: Report) -> Text:
    text = Text("nanaudit ", style="bold")
    text.append(f"{report.tool_version} · {report.command} ")
    text.append(str(report.config.get("path", "")), style="cyan")
    if report.device:
        text.append(f" · device {report.device}")
    text.append(f" · torch {report.torch_version} · {report.steps_run} step(s) in "
                f"{report.duration_s:.1f}s")
    return text


def _finding_panel(f: Finding, boxed: bool = True) -> RenderableType:
    parts: list[RenderableType] = [_facts(f) if boxed else _fact_lines(f)]
    if f.source:
        parts.append(_source(f.source, highlighted=boxed))
    if f.inputs:
        heading = "inputs of the op that created it" if f.op else "tensors"
        parts.append(_stats_table(heading, f.inputs))
    if f.forward_inputs:
        parts.append(_stats_table(f"inputs of the forward op {f.forward_op}", f.forward_inputs))
    if f.sample_rows:
        parts.append(_samples(f))
    if f.cause == Cause.COMPILED_ONLY:
        parts.append(Text("made only by the compiled program (finite eagerly): see the "
                          "explanation", style="yellow"))
    elif f.reproduced is False:
        parts.append(Text("not reproduced on replay: see the explanation", style="yellow"))
    why = Text("why  ", style="bold")
    why.append(f.explanation)
    fix = Text("fix  ", style="bold green")
    fix.append(f.fix)
    parts += [why, fix]
    title = Text(f"finding: {f.cause}", style="bold red")
    if not boxed:
        return Group(title, *parts)
    return Panel(Group(*parts), title=title, border_style="red")


def _fact_rows(f: Finding) -> list[tuple[str, str]]:
    rows = list(finding_facts(f))
    if f.sample_search:
        rows.append(("sample search", search_summary(f.sample_search)))
    if len(f.tensors) > 1:
        rows.append(("all tensors", ", ".join(f.tensors[:12]) +
                     (" ..." if len(f.tensors) > 12 else "")))
    return rows


def _facts(f: Finding) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for label, value in _fact_rows(f):
        table.add_row(label, Text(value))
    return table


def _fact_lines(f: Finding) -> Text:
    """The facts for a log: a line each, the labels aligned (a grid would pad every line to
    the longest value, and wrap them all where one is long)."""
    rows = _fact_rows(f)
    width = max((len(label) for label, _ in rows), default=0) + 2
    text = Text()
    for n, (label, value) in enumerate(rows):
        text.append(label.ljust(width), style="bold")
        text.append(value + ("\n" if n < len(rows) - 1 else ""))
    return text


def _source(src: SourceLine, highlighted: bool = True) -> RenderableType:
    """The user's line in context: highlighted on a terminal; in a log, plain numbered lines
    (rich's Syntax pads every line to the console's width)."""
    title = Text(f"{src.file}:{src.line}", style="cyan")
    if not os.path.isfile(src.file):
        return Group(title, Text(src.code))
    first = max(1, src.line - 2)
    if highlighted:
        return Group(title, Syntax.from_path(src.file, line_numbers=True,
                                             line_range=(first, src.line + 2),
                                             highlight_lines={src.line}))
    with open(src.file, encoding="utf-8", errors="replace") as handle:
        lines = handle.read().splitlines()[first - 1:src.line + 2]
    shown = [f"{'❱' if n == src.line else ' '} {n:>4}  {text}"
             for n, text in enumerate(lines, start=first)]
    return Group(title, Text("\n".join(shown)))


def _stats_table(title: str, stats: list[TensorStats]) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False)
    for col in ("input", "shape", "dtype", "min", "max", "nan", "+inf", "-inf", "zeros", "neg"):
        table.add_column(col, justify="left" if col in ("input", "dtype") else "right")
    for s in stats:
        counts = [_count(s.nan), _count(s.posinf), _count(s.neginf), Text(str(s.zeros)),
                  Text(str(s.negatives))]
        if s.released:      # no values were read: no counts, and the row says why
            counts = [Text(RELEASED, style="dim")] + [Text("")] * 4
        table.add_row(Text(s.name), str(list(s.shape)), s.dtype, _num(s.min), _num(s.max),
                      *counts)
    if any(s.released for s in stats):
        table.caption = f"{RELEASED}: {RELEASED_WHY}"
        table.caption_justify = "left"
    return table


def _count(n: int | None) -> Text:
    return Text(str(n), style="bold red" if n else "")


def _samples(f: Finding) -> Table:
    table = Table(title="offending rows", title_justify="left", show_edge=False)
    table.add_column("row", justify="right")
    table.add_column("leaf")
    table.add_column("values / stats")
    for row in f.sample_rows:
        for path, value in row.values:
            table.add_row(str(row.index), Text(path), Text(sample_value(value)))
        for path, stats in row.leaves:
            shown = (", ".join(f"{v:.4g}" for v in stats.value) if stats.value is not None
                     else describe(stats))
            table.add_row(str(row.index), Text(path), Text(shown))
    return table


def _bad_steps(report: Report) -> RenderableType:
    """--keep-going: every bad step, one row each (the first finding is the panel above)."""
    assert report.bad_steps is not None
    table = Table(title=bad_steps_line(report.bad_steps), title_justify="left",
                  show_edge=False)
    for col in ("step", "update", "cause", "op", "line", "rows"):
        table.add_column(col, justify="right" if col == "step" else "left")
    for row in bad_step_rows(report):
        table.add_row(Text(row.steps), Text(row.action), Text(row.cause), Text(row.op),
                      Text(row.at), Text(row.rows))
    persistent = persistent_line(report.bad_steps, report.finding)
    return Group(table, Text(persistent, style="bold")) if persistent else table


def _warnings(report: Report) -> Text:
    text = Text(f"early warnings ({len(report.warnings)})\n", style="bold yellow")
    for w in report.warnings:
        text.append("  ▲ ", style="yellow")
        text.append(warning_line(w) + "\n")
    return text


def _timeline(report: Report) -> Text:
    tail = report.timeline[-60:]
    first = tail[0].step
    text = Text(f"timeline, steps {first}..{tail[-1].step}\n", style="bold")
    text.append("  loss      ")
    text.append(sparkline([e.loss for e in tail]))
    text.append(f"  last {_num(tail[-1].loss)}\n")
    text.append("  grad norm ")
    text.append(sparkline([e.grad_norm for e in tail], log=True))
    text.append(f"  last {_num(tail[-1].grad_norm)}")
    marks = step_marks(tail, report.warnings, report.finding)
    if marks:
        text.append("\n  marks     ")
        text.append(marks, style="yellow")
        legend = [f"{mark} {meaning}" for mark, meaning in
                  (("▲", "warning"), ("s", "update skipped"), ("✗", "finding")) if mark in marks]
        text.append("  " + "  ".join(legend), style="dim")
    summary = report.timeline_summary
    if summary is not None and summary.buckets:
        text.append("\n  earlier   ")
        text.append(summary_line(summary), style="dim")
    skipped = sum(e.skipped for e in report.timeline)
    if skipped:
        scales = [e.scale for e in report.timeline if e.scale is not None]
        scale = f"; loss scale {scales[0]:g} -> {scales[-1]:g}" if scales else ""
        # a GradScaler's or DeepSpeed's skip (its loss scale's, or its own overflow check's)
        text.append(f"\n  {skipped} step(s) skipped their update{scale}", style="dim")
    return text


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.4g}"


def _user_traceback(error: UserCodeFailure) -> str:
    lines = ["Traceback (user code):"]
    for fr in error.frames:
        lines.append(f'  File "{fr.file}", line {fr.line}, in {fr.function}')
        if fr.code:
            lines.append(f"    {fr.code}")
    exception = error.exception
    # The message is "<what> raised <Exception>: <text>"; <what> may hold a colon itself.
    marker = f" raised {exception}: "
    text = (error.message.split(marker, 1)[-1] if marker in error.message
            else error.message.split(": ", 1)[-1])
    lines.append(f"{exception}: {text}")
    return "\n".join(lines)


def _short_traceback(text: str, frames: int = 3) -> str:
    """The last few frames of our own traceback: enough to recognise a bug; the JSON has all."""
    lines = text.rstrip().splitlines()
    if not lines:
        return ""
    starts = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    keep = starts[-frames:] if starts else []
    return "\n".join(["Traceback (last frames; the full one is in the --json report):"]
                     + (lines[keep[0]:] if keep else lines[-1:]))


def _clean_hint(report: Report, saved: frozenset[str]) -> str:
    """Whether more steps would audit more: not when the data ran out before the step limit."""
    ci = "" if "junit" in saved else "run this in CI with --junit-xml"
    limit = report.config.get("steps")
    if limit is not None and report.steps_run >= limit:
        return (f"next: the {limit}-step limit was reached; raise `steps:` (or --steps) to "
                f"audit longer" + (f", or {ci}" if ci else ""))
    done = (f"every step the script took was audited ({report.steps_run})"
            if report.command == "run" else
            f"every batch the data yielded was audited ({report.steps_run})")
    return f"next: {done}" + (f"; {ci}" if ci else "")


def _next_steps(report: Report, saved: frozenset[str]) -> Text:
    f = report.finding
    if report.status == "clean":
        return Text(_clean_hint(report, saved), style="dim")
    if f is None:
        return Text("")
    hints = []
    if f.source and f.reproduced is not False and f.cause == Cause.DIVERGENCE:
        # The op only overflowed where the grown weights met it: the fix is the optimizer's.
        hints.append(f"change the optimizer as the fix says ({os.path.basename(f.source.file)}:"
                     f"{f.source.line} is where the grown weights overflowed, not the bug)")
    elif f.source and f.cause == Cause.OPTIMIZER_UPDATE:
        # the line is the step that applied the update; the fix is where it was built
        hints.append(f"change the optimizer as the fix says ({os.path.basename(f.source.file)}:"
                     f"{f.source.line} is the step that applied the update)")
    elif f.source and f.reproduced is not False:
        hints.append(f"edit {os.path.basename(f.source.file)}:{f.source.line} as the fix says")
    elif f.cause == Cause.COMPILED_ONLY:
        hints.append("change how the model is compiled as the fix says (your code as written "
                     "stays finite)")
    if f.samples and report.command != "bisect":
        window = (f"micro-batch {f.micro_batch} of step {f.step}"
                  if f.micro_batch is not None and f.batch_index is None else f"step {f.step}")
        hints.append(f"inspect batch rows {rows_label(f.samples)} of {window}")
    elif f.samples:
        hints.append(f"inspect rows {rows_label(f.samples)} of batch {f.step} (and the skip list)")
    if f.cause == Cause.NONFINITE_PARAMETER:
        hints.append("nanaudit bisect CONFIG --checkpoints DIR finds where the state went bad")
    repro = report.repro
    if repro and report.command == "scan" and os.path.isdir(repro):
        hints.append(f"repro bundle in {repro} (python {repro}/repro.py; nanaudit replay "
                     f"{repro})")
    elif report.repro_error:
        hints.append(report.repro_error)
    if "json" not in saved:
        hints.append("--json PATH saves this report for CI and other tools")
    return Text("next: " + "; ".join(hints), style="dim") if hints else Text("")
