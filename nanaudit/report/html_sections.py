"""The HTML report's sections beyond the finding: bisect's bad batches or checkpoint search,
every rank's status under torchrun, `nanaudit run`'s two runs, the early warnings, the error
that stopped a run, and the environment with how to reproduce it. Each returns one <section>
(or "" when the report has nothing for it); every user string is escaped here, once."""

from __future__ import annotations

import json
import os
import shlex

from nanaudit.report.bad_steps_text import bad_step_rows, bad_steps_line, persistent_line
from nanaudit.report.html_finding import finding_details
from nanaudit.report.html_text import esc, facts_table, table
from nanaudit.report.model import Report
from nanaudit.report.sections import (
    CheckpointBisect,
    ConfigFailure,
    DataBisect,
    DistributedRun,
    InternalFailure,
    ScriptRun,
    UserCodeFailure,
)
from nanaudit.report.text import describe_coordinate, module_label, warning_line


def _section(anchor: str, title: str, body: str) -> str:
    return f'<section id="{anchor}"><h2>{esc(title)}</h2>{body}</section>'


def bisect_section(section: DataBisect | CheckpointBisect | None) -> str:
    if isinstance(section, DataBisect):
        return _data_bisect(section)
    if isinstance(section, CheckpointBisect):
        return _checkpoint_bisect(section)
    return ""


def _data_bisect(section: DataBisect) -> str:
    skips = {entry.batch: entry for entry in section.skip_list}
    rows, details = [], []
    for f in section.bad_batches:
        index = f.batch_index if f.batch_index is not None else f.step
        skip = skips.get(index)
        ids = skip.sample_ids if skip is not None and skip.sample_ids else None
        confirmed = "" if skip is None or skip.confirmed is None else (
            "yes" if skip.confirmed else '<span class="warn">no</span>')
        rows.append([str(index), esc(f.samples if f.samples is not None else "—"),
                     esc(ids if ids is not None else "—"), f"<code>{esc(f.cause)}</code>",
                     f'<span class="mono">{esc(f.op or f.tensor or "")}</span>',
                     esc(module_label(f.module) or "—"), confirmed])
        details.append(f"<details><summary>batch {index}: {esc(f.cause)}</summary>"
                       f"{finding_details(f)}</details>")
    title = (f"Bisect: {len(section.bad_batches)} bad batch(es) of "
             f"{section.batches_audited} audited")
    body = (table(("batch", "rows", "sample ids", "cause", "op", "module", "confirmed"), rows,
                  numeric=(0,)) + "".join(details)) if rows else (
        "<p>every batch was finite against the starting weights.</p>")
    return _section("bisect", title, body)


def bad_steps_section(report: Report) -> str:
    """--keep-going: a table of every bad step; each whole finding expandable below it."""
    section = report.bad_steps
    if section is None:
        return ""
    rows, details = [], []
    for row in bad_step_rows(report):
        rows.append([esc(row.steps), esc(row.action), f"<code>{esc(row.cause)}</code>",
                     f'<span class="mono">{esc(row.op or "—")}</span>',
                     f'<span class="mono">{esc(row.at or "—")}</span>', esc(row.rows or "—")])
        if row.finding is not None:
            details.append(f"<details><summary>step {esc(row.steps)} ({esc(row.action)}): "
                           f"{esc(row.cause)}</summary>{finding_details(row.finding)}</details>")
    persistent = persistent_line(section, report.finding)
    body = (f"<p>{esc(bad_steps_line(section))}</p>"
            + (f'<p class="warn"><b>{esc(persistent)}</b></p>' if persistent else "")
            + table(("step", "update", "cause", "op", "line", "rows"), rows)
            + "".join(details))
    return _section("bad-steps", f"Bad steps: {section.count}", body)


def _checkpoint_bisect(section: CheckpointBisect) -> str:
    facts = [("checkpoints found", str(section.checkpoints)),
             ("loaded", f"{section.checkpoints_loaded} (a linear scan: {section.linear_loads})")]
    if section.first_bad:
        facts.append(("first bad", f"step {section.first_bad.step}: {section.first_bad.path}"))
    if section.last_good:
        facts.append(("last good", f"step {section.last_good.step}: {section.last_good.path}"))
        facts.append(("steps replayed", str(section.steps_replayed)))
        facts.append(("optimizer state", "restored" if section.optimizer_state
                      else "absent (a fresh optimizer)"))
    if section.reproduced is not None:
        facts.append(("replay reached a non-finite value", "yes" if section.reproduced
                      else "no"))
    bad_from = section.first_bad.step if section.first_bad else None
    path = [[str(i), str(step), '<span class="bad">non-finite</span>'
             if bad_from is not None and step >= bad_from else '<span class="ok">finite</span>']
            for i, step in enumerate(section.loaded_steps, start=1)]
    note = f"<p>{esc(section.note)}</p>" if section.note else ""
    return _section("bisect", "Bisect over checkpoints", note + facts_table(facts)
                    + "<h3>search path (checkpoints loaded, in order)</h3>"
                    + table(("#", "step", "weights"), path, numeric=(0, 1)))


def ranks_section(section: DistributedRun | None, finding_rank: int | None) -> str:
    if section is None:
        return ""
    lead = (f"<p>world size {section.world_size}, backend {esc(section.backend)}; this "
            f"report from rank {section.rank} (local rank {section.local_rank}) on "
            f"{esc(section.host)}.</p>")
    if section.note:
        lead += f'<p class="muted">{esc(section.note)}</p>'
    ranks = section.ranks or []
    # The mesh column only where a rank has a coordinate: a DDP run's table keeps its shape.
    meshed = any(r.mesh for r in ranks)
    rows = [[str(r.rank) + (' <span class="bad">(finding)</span>' if r.rank == finding_rank
                            else ""),
             f'<span class="{_status_class(r.status)}">{esc(r.status)}</span>',
             str(r.steps_run), esc(r.device), esc(r.host), str(r.warnings)]
            + ([esc(describe_coordinate(r.mesh)) if r.mesh else ""] if meshed else [])
            for r in ranks]
    headers = ("rank", "status", "steps", "device", "host", "warnings") + (
        ("mesh",) if meshed else ())
    body = table(headers, rows, numeric=(2, 5)) if rows else ""
    return _section("ranks", "Ranks", lead + body)


def _status_class(status: str) -> str:
    return {"clean": "ok", "nonfinite": "bad"}.get(status, "warn")


def script_section(run: ScriptRun | None) -> str:
    if run is None or (run.first_run is None and run.rerun is None):
        return ""
    facts = []
    if run.first_run is not None:
        first = run.first_run
        facts.append(("first run", f"{first.steps} step(s) in {first.duration_s:.1f} s, "
                                   f"{first.host_reads} host read(s), {first.skipped} skipped"))
    tail = ""
    if run.rerun is not None:
        rerun = run.rerun
        done = (f", {rerun.steps} step(s) in {rerun.duration_s:.1f} s"
                if rerun.steps is not None and rerun.duration_s is not None else "")
        traced = f", {rerun.ops_traced} op(s) traced" if rerun.ops_traced is not None else ""
        precision = f", {rerun.precision}" if rerun.precision else ""
        facts.append(("re-run", f"{rerun.status}{done}{traced}{precision}"))
        if rerun.model_skipped:
            facts.append(("model", f"not computed before the bad step ({rerun.stood_in} "
                                   f"call(s) stood in for)"))
        elif rerun.model_note:
            facts.append(("model", f"computed: {rerun.model_note}"))
        if rerun.note:
            facts.append(("note", rerun.note))
        if rerun.log_tail:
            tail = (f"<details><summary>the re-run's last output</summary>"
                    f"<pre>{esc(rerun.log_tail)}</pre></details>")
    return _section("script", "The script's runs", facts_table(facts) + tail)


def warnings_section(report: Report) -> str:
    if not report.warnings:
        return ""
    items = "".join(f'<li><span class="warn">▲</span> {esc(warning_line(w))}</li>'
                    for w in report.warnings)
    return _section("warnings", f"Early warnings ({len(report.warnings)})", f"<ul>{items}</ul>")


def error_section(report: Report) -> str:
    error = report.error
    if error is None:
        return ""
    parts = [f"<pre>{esc(error.message)}</pre>"]
    if isinstance(error, ConfigFailure):
        if error.source:
            parts.append(f'<p>in <span class="mono">{esc(error.source)}</span></p>')
        parts.append(table(("key", "problem"), [[f"<code>{esc(p.key or '(file)')}</code>",
                                                 esc(p.message)] for p in error.problems]))
    elif isinstance(error, UserCodeFailure):
        frames = [[f'<span class="mono">{esc(fr.file)}:{esc(fr.line)}</span>',
                   esc(fr.function), f'<span class="mono">{esc(fr.code or "")}</span>']
                  for fr in error.frames]
        parts.append(f"<p>raised by {esc(error.what)}: {esc(error.exception)}</p>")
        if error.hint:
            parts.append(f"<p><b>{esc(error.hint)}</b></p>")
        if frames:
            parts.append(table(("where", "function", "line"), frames))
        if error.traceback:
            parts.append(f"<details><summary>traceback</summary><pre>{esc(error.traceback)}"
                         f"</pre></details>")
    elif isinstance(error, InternalFailure):
        parts.append(f"<p><b>{esc(error.hint)}</b></p><details><summary>traceback</summary>"
                     f"<pre>{esc(error.traceback)}</pre></details>")
    title = f"{error.type} (exit {int(error.exit_code)})"
    return _section("error", title, "".join(parts))


def environment_section(report: Report) -> str:
    config = report.config
    world = report.distributed.world_size if report.distributed is not None else 1
    precision = config.get("precision") or (
        report.run.rerun.precision if report.run and report.run.rerun else None)
    facts = [("nanaudit", report.tool_version), ("torch", report.torch_version),
             ("device", report.device or "—"), ("world size", str(world)),
             ("precision", precision or "—"),
             ("seed", "—" if config.get("seed") is None else str(config["seed"])),
             ("command", report.command), ("steps audited", str(report.steps_run)),
             ("duration", f"{report.duration_s:.1f} s")]
    if report.sentinel_read is not None:
        facts.append(("sentinel read", f"{report.sentinel_read.mode}: "
                                       f"{report.sentinel_read.reason}"))
    commands = reproduce_commands(report)
    how = (f"<h3>reproduce</h3><pre>{esc(chr(10).join(commands))}</pre>" if commands else "")
    if report.repro_error:
        how += f'<p class="warn">no repro bundle: {esc(report.repro_error)}</p>'
    shown = json.dumps(config, indent=2, default=str, ensure_ascii=False)
    return _section("environment", "Environment and reproduction", facts_table(facts) + how
                    + f"<details><summary>config</summary><pre>{esc(shown)}</pre></details>")


def reproduce_commands(report: Report) -> list[str]:
    """The command that made this report and, with a repro bundle, the ones that replay it."""
    config, commands = report.config, []
    path = config.get("path")
    if report.command == "run" and (config.get("script") or config.get("module")):
        target = (["-m", config["module"]] if config.get("module") else [config["script"]])
        seed = config.get("seed")
        args = ["--seed", str(seed)] if seed not in (None, 0) else []
        commands.append(_launcher(report) + shlex.join(
            ["run", *args, *map(str, target), *map(str, config.get("argv") or [])]))
    elif path and report.command in ("scan", "bisect", "replay"):
        extra = []
        if isinstance(report.bisect, CheckpointBisect):
            ref = report.bisect.first_bad or report.bisect.last_good
            if ref is not None:
                extra = ["--checkpoints", os.path.dirname(ref.path) or "."]
        commands.append(_launcher(report) + shlex.join([report.command, str(path), *extra]))
    if report.repro and report.command != "replay":
        script = os.path.join(report.repro, "repro.py")
        commands.append(shlex.join(["python", script]))
        if report.finding is not None and report.finding.samples:
            commands.append(shlex.join(["python", script, "--rows"]))
        commands.append(shlex.join(["nanaudit", "replay", report.repro]))
    return commands


def _launcher(report: Report) -> str:
    world = report.distributed.world_size if report.distributed is not None else 1
    return f"torchrun --nproc-per-node {world} -m nanaudit " if world > 1 else "nanaudit "
