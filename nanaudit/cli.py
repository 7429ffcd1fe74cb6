"""The command line: the only module that touches click, the console and the exit code.

torch is imported lazily inside commands so `nanaudit --help` stays instant. Diagnostics go to
stderr; stdout carries only machine formats (`--json -`, GitHub annotations).

Signals: the first SIGINT or SIGTERM stops the run at the next Python instruction and the
partial report is written (exit 130 or 143); one that arrives while the reports are being
written lets them finish, and the run's own result stands; a second signal exits at once (the files are written atomically, so a report is
the old one or the new one, never half of each). Every requested output is checked before the
run, and a failure to write one is exit 9 whatever the scan found: CI must never read a stale
report from an earlier run and pass.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from nanaudit._version import __version__
from nanaudit.exitcodes import EXIT_CODE_HELP, ExitCode


class Terminal:
    """Owns the console: semantic levels on stderr, user strings never parsed as markup."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.err = Console(stderr=True, highlight=False, width=_log_width())

    def error(self, message: str) -> None:
        self.err.print(Text("error: ", style="bold red") + Text(message))

    def warning(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text("warning: ", style="bold yellow") + Text(message))

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text(message))

    def success(self, message: str) -> None:
        if not self.quiet:
            self.err.print(Text(message, style="bold green"))

    def progress(self):
        """A progress bar on stderr, or None when not a terminal or quiet."""
        if self.quiet or not self.err.is_terminal:
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
        return Progress(TextColumn("scanning"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=self.err, transient=True)


def _log_width() -> int | None:
    """Not a terminal (a CI log, a pipe) and no COLUMNS: do not wrap at rich's default 80
    columns, which cuts numbers and paths in half. A terminal, or COLUMNS, decides otherwise."""
    if os.environ.get("COLUMNS") or sys.stderr.isatty():
        return None
    return 1000


def _stoppable(command: str):
    """Cover a command from its first line: a signal that arrives before the run has a report
    (torch still importing, the outputs being checked) still leaves a partial report and exits
    130 or 143, not click's "Aborted!" with exit 1."""
    def wrap(fn):
        # The command gets the guard as `stop`: one handler for the whole command.
        @functools.wraps(fn)
        def guarded_command(**kwargs):
            with _Stop() as stop:
                try:
                    return fn(**kwargs, stop=stop)
                except KeyboardInterrupt:
                    _stopped_early(stop, command, kwargs)
        return guarded_command
    return wrap


def _stopped_early(stop: _Stop, command: str, options: dict) -> None:
    from nanaudit.commands.common import early_report
    stop.hold()
    terminal = Terminal(options.get("quiet") or options.get("json_path") == "-")
    target = options.get("config") or options.get("bundle") or " ".join(
        options.get("script_args") or ())
    report = early_report(target, command, stop.signal_name or "SIGINT")
    failed = _emit(report, terminal, options.get("json_path"), options.get("junit_path"),
                   options.get("markdown_path"), options.get("fmt"))
    _exit(_final_code(report, failed, terminal))


def _exit(code: ExitCode):
    sys.exit(int(code))


class _Stop:
    """SIGINT/SIGTERM handling for one command (see the module docstring)."""

    def __init__(self):
        self.signal_name: str | None = None
        self.holding = False
        self._previous: dict = {}

    def __enter__(self):
        if _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            sys.stderr.write(f"\nnanaudit: second {signal.Signals(signum).name}, exiting now\n")
            os._exit(128 + signum)
        self.signal_name = signal.Signals(signum).name
        if not self.holding:
            raise KeyboardInterrupt(self.signal_name)

    def hold(self) -> None:
        """From here on the first signal is noted, not raised: the reports are being written."""
        self.holding = True


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODE_HELP)
@click.version_option(__version__, prog_name="nanaudit")
def main():
    """Audit a PyTorch training run for NaN/Inf: find the batch, sample, module and op that
    made it, explain the cause, and suggest the fix."""


def _report_outputs(fn):
    options = [
        click.option("--json", "json_path", metavar="PATH",
                     help="Write the JSON report to PATH ('-' for stdout)."),
        click.option("--junit-xml", "junit_path", metavar="PATH", help="Write a JUnit XML report."),
        click.option("--markdown", "markdown_path", metavar="PATH",
                     help="Write a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)."),
        click.option("--format", "fmt", type=click.Choice(["console", "github"]), default=None,
                     help="github: print ::error annotations on stdout (default when "
                          "GITHUB_ACTIONS=true)."),
        click.option("--plot", "plot_path", metavar="PATH.png",
                     help="Draw loss, gradient norm, update ratio and activation maxima against "
                          "steps, warnings and the finding marked (needs matplotlib: "
                          "pip install 'nanaudit[plot]')."),
        click.option("--fail-on", "fail_on", type=click.Choice(["nonfinite", "warning"]),
                     default=None, help="nonfinite (default): exit 1 only on a non-finite value; "
                     "warning: also exit 7 when an early warning fires."),
        click.option("--quiet", "-q", is_flag=True, help="Only the machine outputs; no console "
                     "report or progress bar."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--steps", type=click.IntRange(min=1), help="Audit at most this many steps.")
@click.option("--device", help="Override the config's device (auto, cpu, cuda, cuda:N).")
@click.option("--seed", type=int, help="Override the config's seed.")
@click.option("--no-samples", is_flag=True, help="Skip isolating the offending batch rows.")
@click.option("--repro", "repro_dir", metavar="DIR", type=click.Path(file_okay=False),
              help="Write the repro bundle of a finding to DIR (default: repro-step<N> beside "
                   "the first report file, else under ./nanaudit-reports).")
@click.option("--no-repro", is_flag=True, help="Do not write a repro bundle.")
@_report_outputs
@_stoppable("scan")
def scan(config, steps, device, seed, no_samples, repro_dir, no_repro, json_path, junit_path,
         markdown_path, fmt, plot_path, fail_on, quiet, stop):
    """Run training steps from CONFIG under cheap sentinels; on the first non-finite value,
    replay that step with full instruments and report where the value was created."""
    from nanaudit.commands.common import ScanOptions
    from nanaudit.commands.scan import scan as run_scan
    terminal = Terminal(quiet or json_path == "-" or not _is_rank_zero())
    _check_outputs(terminal, [json_path, junit_path, markdown_path, plot_path], plot_path)
    progress, hooks = _progress_hooks(terminal)
    from nanaudit.commands.bundle import default_folder
    repro = (None if no_repro else Path(repro_dir) if repro_dir else
             default_folder([json_path, junit_path, markdown_path], 0).parent)
    options = ScanOptions(steps=steps, device=device, seed=seed, fail_on=fail_on,
                          samples=False if no_samples else None, repro_dir=repro,
                          repro_per_step=repro is not None and not repro_dir, **hooks)
    try:
        report = run_scan(config, options)
    finally:
        stop.hold()
        if progress:
            progress.stop()
    _note_signal(report, stop)
    _leave_early_if_failed(_code(report))
    failed = []
    if _is_rank_zero():
        failed = _emit(report, terminal, json_path, junit_path, markdown_path, fmt, plot_path)
        if repro_dir and report.repro_error:
            failed.append(report.repro_error)
    code = _final_code(report, failed, terminal)
    _leave_process_group(code)
    _exit(code)     # still under the guard: a late signal finds our handler, not the default


def _code(report) -> ExitCode:
    from nanaudit.commands.common import exit_code
    return exit_code(report)


def _note_signal(report, stop: _Stop) -> None:
    """A signal that arrived after the run's own handling (localizing, or at the very end)
    still marks the report partial: what the user stopped is not a clean result."""
    from nanaudit.commands.common import mark_interrupted
    if stop.signal_name is not None and report.status != "error":
        mark_interrupted(report, stop.signal_name)


def _final_code(report, failed: list, terminal: Terminal) -> ExitCode:
    """The report's exit code, unless a requested output could not be written."""
    if not failed:
        return _code(report)
    for message in failed:
        terminal.error(message)
    terminal.error(f"exit {int(ExitCode.OUTPUT)}: {len(failed)} requested output(s) could not "
                   f"be written; the scan itself ended {report.status} "
                   f"(exit {int(_code(report))})")
    return ExitCode.OUTPUT


def _check_outputs(terminal: Terminal, paths: list, plot_path) -> None:
    """Refuse, before any step runs, outputs that cannot be written."""
    from nanaudit.report.output import output_problem
    found = {p: output_problem(p) for p in paths if p and p != "-"}
    problems = [f"cannot write {p}: {problem}" for p, problem in found.items() if problem]
    if problems:
        for problem in problems:
            terminal.error(problem)
        _exit(ExitCode.OUTPUT)
    if plot_path:
        from nanaudit.report.plot import PlotUnavailable, check_available
        try:
            check_available()
        except PlotUnavailable as exc:
            terminal.error(str(exc))
            _exit(ExitCode.USAGE)


def _is_rank_zero() -> bool:
    """Under torchrun only rank 0 prints and writes reports; the others only exit."""
    return os.environ.get("RANK", "0") == "0"


def _leave_early_if_failed(code: ExitCode) -> None:
    """Under torchrun, a rank other than 0 whose own code failed ends its process now: its
    closed connections are what frees the peers blocked in a collective with it."""
    from nanaudit.run.distributed import current
    coordinator = current()
    if coordinator is not None and coordinator.failed and coordinator.rank != 0:
        _exit_now(code)


def _leave_process_group(code: ExitCode) -> None:
    """Under torchrun: meet the other ranks (after rank 0 wrote the report) and exit at once:
    the reports are written and flushed, and a slow interpreter teardown would let torchrun
    see one rank exit first and stop the others with SIGTERM."""
    from nanaudit.run.distributed import current
    coordinator = current()
    if coordinator is not None:
        coordinator.shutdown()
        _exit_now(code)


def _exit_now(code: ExitCode) -> None:
    """Flush and leave without interpreter teardown (torchrun ranks only)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _progress_hooks(terminal: Terminal):
    """A progress bar and the on_start/on_step callbacks that drive it (None when quiet)."""
    progress = terminal.progress()
    task = {}

    def on_start(total):
        if progress:
            progress.start()
            task["id"] = progress.add_task("scan", total=total)

    def on_step(step):
        if progress:
            progress.update(task["id"], completed=step + 1)
    return progress, {"on_start": on_start, "on_step": on_step}


def _emit(report, terminal: Terminal, json_path, junit_path, markdown_path, fmt,
          plot_path=None) -> list[str]:
    """Print the console report and write every requested output; returns the failures."""
    from nanaudit.report.console import print_report
    from nanaudit.report.formats import renderer_for
    from nanaudit.report.output import write_atomic
    failed = []
    if not terminal.quiet:
        print_report(report, terminal.err)
    elif report.status == "error" and report.error:
        terminal.error(report.error.message)
    outputs = [("json", json_path), ("junit", junit_path), ("markdown", markdown_path)]
    for name, path in outputs:
        if not path:
            continue
        text = renderer_for(name).render(report)
        if path == "-":
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except OSError as exc:     # a closed pipe (`| head`): the report did not arrive
                failed.append(f"cannot write the {name} report to stdout: {_os_reason(exc)}")
            continue
        try:
            write_atomic(path, text)
        except OSError as exc:
            failed.append(f"cannot write the {name} report to {path}: {_os_reason(exc)}")
    if fmt == "github" or (fmt is None and os.environ.get("GITHUB_ACTIONS") == "true"):
        sys.stdout.write(renderer_for("github").render(report))
    if plot_path:
        failed += _write_plot(report, plot_path)
    return failed


def _os_reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _write_plot(report, path) -> list[str]:
    from nanaudit.report.output import write_atomic_bytes
    from nanaudit.report.plot import PlotUnavailable, render_png
    try:
        write_atomic_bytes(path, render_png(report))
    except PlotUnavailable as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"cannot write the plot to {path}: {_os_reason(exc)}"]
    return []


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--checkpoints", type=click.Path(path_type=Path),
              help="A folder of checkpoints (step_000100.pt, ckpt-2000.pt): find the first bad "
                   "one by binary search and replay training from the last good one.")
@click.option("--pattern", help="Regex whose first group captures the step from a file name.")
@click.option("--steps", type=click.IntRange(min=1), help="Audit at most this many batches.")
@click.option("--device", help="Override the config's device.")
@click.option("--skip-list", "skip_list_path", metavar="PATH",
              help="Write the poisoned batches and rows as JSON, for a training loop to skip.")
@_report_outputs
@_stoppable("bisect")
def bisect(config, checkpoints, pattern, steps, device, skip_list_path, json_path, junit_path,
           markdown_path, fmt, plot_path, fail_on, quiet, stop):
    """Find every non-finite batch of CONFIG's data set against the starting weights (with
    its samples and cause), or with --checkpoints the first bad checkpoint and step."""
    from nanaudit.commands.bisect import bisect as run_bisect
    from nanaudit.commands.common import ScanOptions
    terminal = Terminal(quiet or json_path == "-")
    _check_outputs(terminal, [json_path, junit_path, markdown_path, plot_path, skip_list_path],
                   plot_path)
    progress, hooks = _progress_hooks(terminal)
    try:
        report = run_bisect(config, ScanOptions(steps=steps, device=device, fail_on=fail_on,
                                                **hooks), checkpoints, pattern)
    finally:
        stop.hold()
        if progress:
            progress.stop()
    _note_signal(report, stop)
    failed = _emit(report, terminal, json_path, junit_path, markdown_path, fmt, plot_path)
    if skip_list_path and report.bisect is not None and report.bisect.mode == "data":
        failed += _write_skip_list(skip_list_path, report.bisect.skip_list)
    _exit(_final_code(report, failed, terminal))


def _write_skip_list(path, skip_list) -> list[str]:
    import json

    from nanaudit.report.model import jsonable
    from nanaudit.report.output import write_atomic
    try:
        write_atomic(path, json.dumps({"skip": jsonable(skip_list)}, indent=2) + "\n")
    except OSError as exc:
        return [f"cannot write the skip list to {path}: {_os_reason(exc)}"]
    return []


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", default="nanaudit.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite existing files.")
def init(config, force):
    """Write a commented starter CONFIG (default nanaudit.yaml) and the entrypoint module it
    names (nanaudit_entry.py beside it); both run as written."""
    from nanaudit.commands.starter import render
    from nanaudit.report.output import write_atomic
    terminal = Terminal()
    module_path = config.with_name("nanaudit_entry.py")
    existing = [p for p in (config, module_path) if p.exists()]
    if existing and not force:
        terminal.error(f"{', '.join(map(str, existing))} already exist(s); pass --force to "
                       f"overwrite")
        _exit(ExitCode.USAGE)
    config_text, module_text = render(config.name, module_path.stem)
    try:
        write_atomic(config, config_text)
        write_atomic(module_path, module_text)
    except OSError as exc:
        terminal.error(f"cannot write the starter files: {exc}")
        _exit(ExitCode.USAGE)
    terminal.success(f"wrote {config} and {module_path}")
    terminal.info(f"next: nanaudit scan {config}  (then point model, data and loss at your code)")
    _exit(ExitCode.CLEAN)


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("bundle", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "model_target", metavar="MODULE:FACTORY",
              help="Build the model with this callable (bundles of Sentinel or a training "
                   "callback that could not record how; the saved weights are loaded into it).")
@click.option("--loss", "loss_target", metavar="MODULE:FN",
              help="Compute the loss as FN(model, batch) (bundles of Sentinel or a callback).")
@_report_outputs
@_stoppable("replay")
def replay(bundle, model_target, loss_target, json_path, junit_path, markdown_path, fmt,
           plot_path, fail_on, quiet, stop):
    """Localize again the step saved in a repro BUNDLE (written by `scan`, `Sentinel` or a
    training callback on a finding): same weights, batch and RNG state, without the data
    pipeline. Exits 1 when the non-finite value reproduces, 2 when the bundle needs --model
    or --loss (the message says which)."""
    from nanaudit.commands.replay import replay as run_replay
    terminal = Terminal(quiet or json_path == "-")
    _check_outputs(terminal, [json_path, junit_path, markdown_path, plot_path], plot_path)
    try:
        report = run_replay(bundle, model_target, loss_target)
    finally:
        stop.hold()
    _note_signal(report, stop)
    failed = _emit(report, terminal, json_path, junit_path, markdown_path, fmt, plot_path)
    _exit(_final_code(report, failed, terminal))


@main.command(epilog=EXIT_CODE_HELP, context_settings={"ignore_unknown_options": True,
                                                      "allow_interspersed_args": False})
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed Python, NumPy and torch before the script (its own seeds win).")
@click.option("--no-rerun", is_flag=True, help="Do not re-run the script to name the op.")
@click.option("--max-rerun-steps", type=click.IntRange(min=1),
              help="Do not re-run when localizing would repeat more than this many steps.")
@_report_outputs
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@_stoppable("run")
def run(seed, no_rerun, max_rerun_steps, json_path, junit_path, markdown_path, fmt,
        plot_path, fail_on, quiet, script_args, stop):
    """Run an unmodified training SCRIPT [ARGS]... (or -m MODULE [ARGS]..., as `python -m`)
    under nanaudit's checks at every optimizer step; on the first non-finite value stop it
    before the update, then re-run it from the start to that step with full instruments to
    name the op. nanaudit's options go before the script; everything after it is the script's."""
    from nanaudit.commands.run_script import RunOptions, ScriptTarget, rank_path, run_script
    terminal = Terminal(quiet or json_path == "-")
    _check_outputs(terminal, [json_path, junit_path, markdown_path, plot_path], plot_path)
    if script_args[:1] == ("-m",) and len(script_args) > 1:
        target = ScriptTarget(module=script_args[1], args=tuple(script_args[2:]))
    elif script_args and script_args[0] != "-m":
        target = ScriptTarget(path=script_args[0], args=tuple(script_args[1:]))
    else:
        terminal.error("nothing to run: give a script (`nanaudit run train.py ARGS...`) or "
                       "a module (`nanaudit run -m pkg.train ARGS...`)")
        _exit(ExitCode.USAGE)
    options = RunOptions(seed=seed, rerun=not no_rerun, max_rerun_steps=max_rerun_steps,
                         fail_on=fail_on, on_rerun=lambda step: terminal.info(
                             f"non-finite at optimizer step {step}: re-running the script from "
                             f"the start to localize it (--no-rerun skips this)"))
    try:
        report = run_script(target, options)
    finally:
        stop.hold()
    _note_signal(report, stop)
    rank = report.run.rank if report.run is not None else None
    if rank:
        # Under torchrun every rank reports what it saw: rank r writes PATH.rank<r>.json.
        json_path, junit_path, markdown_path, plot_path = (
            rank_path(p, rank) for p in (json_path, junit_path, markdown_path, plot_path))
    if rank is not None and _main_thread():
        # torchrun stops the other ranks with SIGTERM once one exits: finish the reports.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failed = _emit(report, terminal, json_path, junit_path, markdown_path, fmt, plot_path)
    _exit(_final_code(report, failed, terminal))


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
def validate(config):
    """Check CONFIG without running anything: keys, types, entrypoints and their signatures,
    checkpoint path and device. Lists every problem at once."""
    from nanaudit.config.validate import load_with_all_problems, validate_config
    from nanaudit.errors import ConfigError, NanauditError
    terminal = Terminal()
    try:
        loaded = load_with_all_problems(config)
        problems = validate_config(loaded)
        if problems:
            raise ConfigError(problems, source=str(config))
    except NanauditError as exc:
        terminal.error(str(exc))
        _exit(exc.exit_code)
    code = f"step {loaded.step.target}" if loaded.step else f"loss {loaded.loss.target}"
    terminal.success(f"{config}: valid (model {loaded.model.target}, data {loaded.data.target}, "
                     f"{code})")
    _exit(ExitCode.CLEAN)


if __name__ == "__main__":
    main()
