"""The command line: the only package that touches click, the console, stdout/stderr and the
process's exit. Each command turns its options into one call of `nanaudit.commands`, which
returns a Report and never prints or exits; then the requested outputs are written and the
process exits with the report's code. terminal.py owns the console, outputs.py the formats,
streams.py stdout and stderr, signals.py the stop signals, process.py the exit.

torch is imported lazily inside the commands, so `nanaudit --help` stays instant.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from nanaudit._version import __version__
from nanaudit.cli.outputs import (
    FORMATS,
    STREAM_FORMATS,
    Requested,
    absolute,
    final_code,
    write,
)
from nanaudit.cli.process import (
    code_of,
    exit_with,
    is_rank_zero,
    leave_early_if_failed,
    leave_process_group,
)
from nanaudit.cli.script_command import ScriptCommand
from nanaudit.cli.signals import (
    Stop,
    finish_despite_sigterm,
    hand_over_early_signals,
    stoppable,
)
from nanaudit.cli.terminal import Terminal, progress_hooks
from nanaudit.config.schema import FAIL_ON
from nanaudit.exitcodes import EXIT_CODE_HELP, ExitCode
from nanaudit.report.bad_steps import MAX_BAD_STEPS

if TYPE_CHECKING:
    from rich.progress import Progress

    from nanaudit.report.model import Report


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODE_HELP)
@click.version_option(__version__, prog_name="nanaudit")
def main() -> None:
    """Audit a PyTorch training run for NaN/Inf: find the batch, sample, module and op that
    made it, explain the cause, and suggest the fix."""
    hand_over_early_signals(click.get_current_context().invoked_subcommand)


def report_options(fn: Callable) -> Callable:
    """The options of every command that writes a report: one per output format, then
    --fail-on and --quiet."""
    options = []
    for fmt in FORMATS:
        if fmt.option is not None and fmt.param is not None:
            options.append(click.option(fmt.option, fmt.param, metavar=fmt.metavar,
                                        help=fmt.help))
        elif fmt.name == STREAM_FORMATS[1]:
            options.append(click.option(
                "--format", "fmt", type=click.Choice(STREAM_FORMATS), default=None,
                help="github: print ::error annotations on stdout (on stderr when --json - "
                     "takes stdout; default when GITHUB_ACTIONS=true)."))
    options += [
        click.option("--fail-on", "fail_on", type=click.Choice(FAIL_ON), default=None,
                     help=f"{FAIL_ON[0]} (default): exit {int(ExitCode.NONFINITE)} only on a "
                          f"non-finite value; {FAIL_ON[1]}: also exit {int(ExitCode.WARNING)} "
                          f"when an early warning fires."),
        click.option("--quiet", "-q", is_flag=True, help="Only the machine outputs; no console "
                     "report or progress bar."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def keep_going_options(fn: Callable) -> Callable:
    """--keep-going, --max-bad-steps and --skip-list, for the commands that step a training
    run."""
    fn = click.option("--skip-list", "skip_list_path", metavar="PATH",
                      help="Write each bad step's batch and rows as JSON (bisect's format), "
                           "for a training loop to filter from its data.")(fn)
    fn = click.option("--max-bad-steps", type=click.IntRange(min=1), metavar="N",
                      help=f"With --keep-going: skip at most N bad steps (default "
                           f"{MAX_BAD_STEPS}); the next one stops the run.")(fn)
    return click.option("--keep-going", is_flag=True,
                        help="Skip a bad step's update and go on, recording each bad step as "
                             "a finding, until --max-bad-steps.")(fn)


def _write_bad_steps_skip_list(path: str | None, report: Report) -> list[str]:
    """--skip-list for scan and run: the bad steps of the report (none when clean)."""
    if not path:
        return []
    from nanaudit.report.skip_list import skip_entries
    if report.skip_list:            # kept going: every bad step's, past the findings kept whole
        return _write_skip_list(path, report.skip_list)
    findings = report.findings or ([report.finding] if report.finding is not None else [])
    return _write_skip_list(path, skip_entries(findings))


def _bad_steps_limit(keep_going: bool, max_bad_steps: int | None) -> int:
    """--max-bad-steps' value; given without --keep-going it is a usage error (exit 2)."""
    if max_bad_steps is not None and not keep_going:
        raise click.UsageError("--max-bad-steps needs --keep-going (without it the first bad "
                               "step stops the run)")
    return MAX_BAD_STEPS if max_bad_steps is None else max_bad_steps


def _ran(run: Callable[[], Report], stop: Stop, progress: Progress | None = None) -> Report:
    """The command's report; from its end on a signal is noted, not raised, and marks it."""
    try:
        report = run()
    finally:
        stop.hold()
        if progress:
            progress.stop()
    stop.note(report)
    return report


def _finish(report: Report, outputs: Requested, terminal: Terminal) -> NoReturn:
    exit_with(final_code(report, outputs.emit(report, terminal), terminal))


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
@keep_going_options
@report_options
@stoppable("scan")
def scan(config: Path, steps: int | None, device: str | None, seed: int | None,
         no_samples: bool, repro_dir: str | None, no_repro: bool, keep_going: bool,
         max_bad_steps: int | None, skip_list_path: str | None, fail_on: str | None,
         quiet: bool, stop: Stop, **formats: Any) -> None:
    """Run training steps from CONFIG under cheap sentinels; on the first non-finite value,
    replay that step with full instruments and report where the value was created."""
    from nanaudit.commands.bundle import default_folder
    from nanaudit.commands.common import ScanOptions
    from nanaudit.commands.scan import scan as run_scan
    outputs = Requested.from_options(formats)
    terminal = Terminal(quiet or outputs.quiets_console or not is_rank_zero())
    limit = _bad_steps_limit(keep_going, max_bad_steps)
    outputs.check(terminal, also={"--skip-list": skip_list_path},
                  folder=None if no_repro else repro_dir)
    skip_list_path = absolute(skip_list_path) if skip_list_path else None
    progress, on_start, on_step = progress_hooks(terminal)
    repro = (None if no_repro else Path(absolute(repro_dir or str(
        default_folder(outputs.without("plot").files(), 0).parent))))
    options = ScanOptions(steps=steps, device=device, seed=seed, fail_on=fail_on,
                          samples=False if no_samples else None, repro_dir=repro,
                          repro_per_step=repro is not None and not repro_dir,
                          on_start=on_start, on_step=on_step, keep_going=keep_going,
                          max_bad_steps=limit)
    report = _ran(lambda: run_scan(config, options), stop, progress)
    leave_early_if_failed(code_of(report))
    failed = []
    if is_rank_zero():
        failed = outputs.emit(report, terminal)
        failed += _write_bad_steps_skip_list(skip_list_path, report)
        if repro_dir and report.repro_error:
            failed.append(report.repro_error)
    code = final_code(report, failed, terminal)
    leave_process_group(code)
    exit_with(code)     # still under the guard: a late signal finds our handler, not the default


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
@report_options
@stoppable("bisect")
def bisect(config: Path, checkpoints: Path | None, pattern: str | None, steps: int | None,
           device: str | None, skip_list_path: str | None, fail_on: str | None, quiet: bool,
           stop: Stop, **formats: Any) -> None:
    """Find every non-finite batch of CONFIG's data set against the starting weights (with
    its samples and cause), or with --checkpoints the first bad checkpoint and step."""
    from nanaudit.commands.bisect import bisect as run_bisect
    from nanaudit.commands.common import ScanOptions
    from nanaudit.report.sections import DataBisect
    outputs = Requested.from_options(formats)
    terminal = Terminal(quiet or outputs.quiets_console)
    outputs.check(terminal, also={"--skip-list": skip_list_path})
    skip_list_path = absolute(skip_list_path) if skip_list_path else None
    progress, on_start, on_step = progress_hooks(terminal)
    options = ScanOptions(steps=steps, device=device, fail_on=fail_on, on_start=on_start,
                          on_step=on_step)
    report = _ran(lambda: run_bisect(config, options, checkpoints, pattern), stop, progress)
    failed = outputs.emit(report, terminal)
    if skip_list_path and isinstance(report.bisect, DataBisect):
        failed += _write_skip_list(skip_list_path, report.bisect.skip_list)
    exit_with(final_code(report, failed, terminal))


def _write_skip_list(path: str, skip_list: Any) -> list[str]:
    from nanaudit.report.skip_list import skip_list_text
    problem = write("the skip list", path, skip_list_text(skip_list).encode("utf-8"))
    return [problem] if problem else []


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", default="nanaudit.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Overwrite existing files.")
def init(config: Path, force: bool) -> None:
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
        exit_with(ExitCode.USAGE)
    config_text, module_text = render(config.name, module_path.stem)
    try:
        write_atomic(config, config_text)
        write_atomic(module_path, module_text)
    except OSError as exc:
        terminal.error(f"cannot write the starter files: {exc}")
        exit_with(ExitCode.USAGE)
    terminal.success(f"wrote {config} and {module_path}")
    terminal.info(f"next: nanaudit scan {config}  (then point model, data and loss at your code)")
    exit_with(ExitCode.CLEAN)


@main.command(epilog=EXIT_CODE_HELP, help=(
    "Localize again the step saved in a repro BUNDLE (written by `scan`, `Sentinel` or a "
    "training callback on a finding): same weights, batch and RNG state, without the data "
    f"pipeline. Exits {int(ExitCode.NONFINITE)} when the non-finite value reproduces, "
    f"{int(ExitCode.USAGE)} when the bundle needs --model or --loss (the message says which) "
    f"or names code from outside the bundle, this folder and the installed packages (a "
    f"replay imports and runs what the bundle names: see --trust-entrypoints)."))
@click.argument("bundle", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "model_target", metavar="MODULE:FACTORY",
              help="Build the model with this callable (bundles of Sentinel or a training "
                   "callback that could not record how; the saved weights are loaded into it).")
@click.option("--loss", "loss_target", metavar="MODULE:FN",
              help="Compute the loss as FN(model, batch) (bundles of Sentinel or a callback).")
@click.option("--trust-entrypoints", "trust", is_flag=True,
              help="Import whatever the bundle's config and meta.json name, even code outside "
                   "the bundle, this folder and the installed packages (only for a bundle "
                   "whose author you trust: its code runs).")
@report_options
@stoppable("replay")
def replay(bundle: Path, model_target: str | None, loss_target: str | None, trust: bool,
           fail_on: str | None, quiet: bool, stop: Stop, **formats: Any) -> None:
    from nanaudit.commands.replay import replay as run_replay
    outputs = Requested.from_options(formats)
    terminal = Terminal(quiet or outputs.quiets_console)
    outputs.check(terminal)
    report = _ran(lambda: run_replay(bundle, model_target, loss_target, trust), stop)
    _finish(report, outputs, terminal)


@main.command(cls=ScriptCommand, epilog=EXIT_CODE_HELP,
              context_settings={"ignore_unknown_options": True,
                                "allow_interspersed_args": False})
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed Python, NumPy and torch before the script (its own seeds win).")
@click.option("--no-rerun", is_flag=True,
              help="Do not replay the bad step nor re-run the script to name the op.")
@click.option("--rerun", "force_rerun", is_flag=True,
              help="Name the op by re-running the script from the start, not by replaying the "
                   "bad step in-process.")
@click.option("--max-rerun-steps", type=click.IntRange(min=1),
              help="Do not re-run when localizing would repeat more than this many steps.")
@keep_going_options
@report_options
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@stoppable("run")
def run(seed: int, no_rerun: bool, force_rerun: bool, max_rerun_steps: int | None,
        keep_going: bool, max_bad_steps: int | None, skip_list_path: str | None,
        fail_on: str | None, quiet: bool, script_args: tuple[str, ...], stop: Stop,
        **formats: Any) -> None:
    """Run an unmodified training SCRIPT [ARGS]... (or -m MODULE [ARGS]..., as `python -m`)
    under nanaudit's checks at every optimizer step; on the first non-finite value stop it
    before the update, then replay that step in-process with full instruments to name the op
    (or re-run the script from the start where only that can). nanaudit's options go before
    the script; everything after it is the script's."""
    from nanaudit.commands.run import run_script
    from nanaudit.script.target import ScriptOptions, ScriptTarget, rank_path
    outputs = Requested.from_options(formats)
    terminal = Terminal(quiet or outputs.quiets_console)
    limit = _bad_steps_limit(keep_going, max_bad_steps)
    outputs.check(terminal, also={"--skip-list": skip_list_path})
    skip_list_path = absolute(skip_list_path) if skip_list_path else None
    if script_args[:1] == ("-m",) and len(script_args) > 1:
        target = ScriptTarget(module=script_args[1], args=tuple(script_args[2:]))
    elif script_args and script_args[0] != "-m":
        target = ScriptTarget(path=script_args[0], args=tuple(script_args[1:]))
    else:
        terminal.error("nothing to run: give a script (`nanaudit run train.py ARGS...`) or "
                       "a module (`nanaudit run -m pkg.train ARGS...`)")
        exit_with(ExitCode.USAGE)
    options = ScriptOptions(seed=seed, rerun=not no_rerun, force_rerun=force_rerun,
                            max_rerun_steps=max_rerun_steps, fail_on=fail_on,
                            keep_going=keep_going, max_bad_steps=limit,
                            on_rerun=lambda step: terminal.info(
                                f"non-finite at optimizer step {step}: re-running the script "
                                f"from the start to localize it (--no-rerun skips this)"))
    report = _ran(lambda: run_script(target, options), stop)
    # This process's rank (a report adopted from a process the script started is that
    # process's account: the run's own process writes where it was asked to)
    rank = report.run.rank if report.run is not None and not report.run.process else None
    if rank:
        # Under torchrun every rank reports what it saw: rank r writes PATH.rank<r>.json.
        outputs = outputs.relocated(lambda path: rank_path(path, rank))
    if rank is not None:
        finish_despite_sigterm()
    if rank and skip_list_path:
        skip_list_path = rank_path(skip_list_path, rank)
    failed = outputs.emit(report, terminal) + _write_bad_steps_skip_list(skip_list_path, report)
    code = final_code(report, failed, terminal)
    leave_process_group(code)      # a script's process group: the ranks leave together
    exit_with(code)


@main.command(epilog=EXIT_CODE_HELP)
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
def validate(config: Path) -> None:
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
        exit_with(exc.exit_code)
    code = f"step {loaded.step.target}" if loaded.step else f"loss {loaded.own_code.target}"
    terminal.success(f"{config}: valid (model {loaded.model.target}, data {loaded.data.target}, "
                     f"{code})")
    exit_with(ExitCode.CLEAN)
