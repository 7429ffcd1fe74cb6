"""`nanaudit run`: audit an unmodified training script in-process, then localize by re-running it.

The first run executes the script as `__main__` (its argv, `sys.path[0]` and `__file__` as
`python` would set them) under ScriptAuditor's global hooks and stops it at the first non-finite
value, before the update. A loss or gradient trip is then localized by running the script again
from the start in a fresh process (`python -m nanaudit.commands.rerun_script`) with the same argv,
environment and seeds, the OpTracer armed for the bad step only. The re-run must reproduce the
first run's losses before that step; if it does not, the script is not deterministic and the
report says so with what the first run saw, never a guess. Returns a Report; never prints or
exits (cli.py does).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nanaudit._version import __version__
from nanaudit.config.schema import WatchOptions
from nanaudit.errors import ConfigError, NanauditError, NothingAuditedError, UserCodeError
from nanaudit.localize.causes import fix_for
from nanaudit.localize.findings import attach_warnings
from nanaudit.report.model import (
    EarlyWarning,
    Finding,
    FirstRun,
    Report,
    Rerun,
    RerunStatus,
    SampleSearch,
    ScriptRun,
    Status,
)
from nanaudit.run.script_hooks import ScriptAuditor, ScriptStopped, ScriptTrip, same_value
from nanaudit.run.watch import MAX_WARNINGS, GrowthWatch

_RUNPY = os.path.abspath(runpy.__file__)


@dataclass(frozen=True)
class ScriptTarget:
    """What to run: a script path or a module (`-m`), and the script's own arguments."""

    path: str | None = None
    module: str | None = None
    args: tuple = ()

    @property
    def display(self) -> str:
        return f"-m {self.module}" if self.module else str(self.path)


@dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    rerun: bool = True
    max_rerun_steps: int | None = None     # do not re-run past this many steps
    fail_on: str | None = None
    rerun_timeout_s: float | None = None
    on_rerun: Callable[[int], None] | None = None   # told the step the re-run goes to


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch, before the script: a script that seeds itself overrides them."""
    import torch
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


def _rank() -> int | None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0"))
    return None


class _Interrupts:
    """Ctrl-C and SIGTERM during the script raise KeyboardInterrupt (so the partial report is
    written) and are remembered: a framework that catches it and returns normally (Lightning's
    graceful shutdown) still ends as interrupted."""

    def __init__(self):
        self.seen = False
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _raise(self, signum, frame):
        self.seen = True
        # The command's own handler (the CLI's) learns of it too: it names the signal in the
        # report and makes a second one exit at once.
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt()


def execute(target: ScriptTarget, auditor: ScriptAuditor, seed: int) -> None:
    """Run the script as `__main__` under the auditor's hooks; ScriptStopped ends it quietly.
    The script's exceptions become UserCodeError with its frames (runpy's and ours removed)."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    interrupts = _Interrupts().__enter__()
    auditor.install()
    try:
        seed_everything(seed)
        if target.module:
            sys.argv = [target.module, *target.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(target.path)
            sys.argv = [str(target.path), *target.args]
            sys.path.insert(0, os.path.dirname(path))
            runpy.run_path(path, run_name="__main__")
    except ScriptStopped:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise _user_error(target, exc, f"exited with status {exc.code}") from None
    except (KeyboardInterrupt, NanauditError):
        raise
    except Exception as exc:
        raise _user_error(target, exc) from exc
    finally:
        auditor.remove()
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        interrupts.__exit__()
    if interrupts.seen:
        raise KeyboardInterrupt()


def _user_error(target: ScriptTarget, exc: BaseException, note: str = "") -> UserCodeError:
    error = UserCodeError(f"the script `{target.display}`" + (f" {note};" if note else ""), exc)
    error.frames = [f for f in error.frames if os.path.abspath(f.filename) != _RUNPY
                    and not f.filename.startswith("<frozen runpy")]
    return error


def check_target(target: ScriptTarget) -> None:
    if target.module:
        import importlib.util
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target.module) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigError(f"no module named `{target.module}` (from {os.getcwd()})")
    elif not Path(target.path).is_file():
        raise ConfigError(f"no such script: {target.path}")


def run_script(target: ScriptTarget, options: RunOptions = RunOptions()) -> Report:
    """`nanaudit run`: the first run, then the re-run of a loss or gradient trip."""
    import torch
    report = Report(tool_version=__version__, config=_summary(target, options),
                    torch_version=torch.__version__, device="", status=Status.ERROR, steps_run=0,
                    command="run")
    auditor = ScriptAuditor(rank=_rank())
    started = time.perf_counter()
    script_error = None
    try:
        check_target(target)
        try:
            execute(target, auditor, options.seed)
        except UserCodeError as error:
            # A script that raised because of a non-finite value (BCELoss refusing a NaN, a
            # weight an update made NaN): the value is the finding, the exception its effect.
            if auditor.after_error(error.exception) is None:
                raise
            script_error = error
        if auditor.trip is None:
            auditor.finish()
        _record(report, auditor)
        first_run_s = time.perf_counter() - started
        report.run.first_run = FirstRun(steps=len(auditor.timeline),
                                        duration_s=round(first_run_s, 3),
                                        host_reads=auditor.host_reads, skipped=auditor.skipped)
        if auditor.trip is None:
            if auditor.step == 0:
                raise NothingAuditedError(
                    f"the script `{target.display}` finished without stepping an optimizer "
                    f"or calling backward: nanaudit checks at each `optimizer.step()` (at each "
                    f"backward in a script that builds no optimizer), so nothing was audited "
                    f"(does it train? are its arguments right?)")
            attach_timeline_warnings(report, None, auditor.optimizer_count)
            report.status = Status.CLEAN
            return _done(report, started)
        report.status = Status.NONFINITE
        report.finding = first_run_finding(auditor.trip)
        if script_error is not None:
            _attach_script_error(report, script_error)
        if auditor.trip.check in ("loss", "gradient", "error"):
            report.run.rerun = localize_by_rerun(target, options, auditor.trip,
                                                 auditor.timeline, report)
        attach_timeline_warnings(report, auditor.trip, auditor.optimizer_count)
    except KeyboardInterrupt:
        _record(report, auditor)
        report.status = Status.INTERRUPTED
    except Exception as exc:
        from nanaudit.commands.common import error_info
        _record(report, auditor)
        report.status = Status.ERROR
        report.error = error_info(exc)
        if isinstance(exc, UserCodeError):
            report.error.traceback = exc.formatted_traceback()
    return _done(report, started)


def _attach_script_error(report: Report, error: UserCodeError) -> None:
    """The script's exception, raised because of the value the finding names: its frames stay
    in the report; the finding's cause comes from the value."""
    from nanaudit.commands.common import error_info
    report.error = error_info(error)
    report.error.traceback = error.formatted_traceback()


def rank_path(path: str | None, rank: int) -> str | None:
    """Where rank `rank` writes a report file given as PATH (stdout stays rank 0's)."""
    if not path or path == "-":
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def _record(report: Report, auditor: ScriptAuditor) -> None:
    report.timeline = auditor.timeline
    report.steps_run = len(auditor.timeline)
    report.device = auditor.device or report.device
    if report.run is None:
        report.run = ScriptRun()
    if auditor.rank is not None:
        report.run.rank = auditor.rank


def _done(report: Report, started: float) -> Report:
    report.duration_s = time.perf_counter() - started
    return report


def _summary(target: ScriptTarget, options: RunOptions) -> dict:
    return {"path": target.display, "script": target.path, "module": target.module,
            "argv": list(target.args), "seed": options.seed, "rerun": options.rerun,
            "max_rerun_steps": options.max_rerun_steps, "fail_on": options.fail_on or "nonfinite"}


# --- what the first run saw --------------------------------------------------------------------

def _short(items, limit: int = 8) -> str:
    items = list(items)
    return "[" + ", ".join(map(str, items[:limit])) + (", ..." if len(items) > limit else "") + "]"


def first_run_finding(trip: ScriptTrip) -> Finding:
    """The finding from the first run alone: the step, the check, the tensors, the rows."""
    if trip.check == "input":
        return Finding(step=trip.step, where="input", value=trip.value, cause="nonfinite-input",
                       explanation=(f"the floating inputs of the first module call of step "
                                    f"{trip.step} hold non-finite values before the model runs: "
                                    f"{_short(trip.tensors)} (shapes {trip.input_shapes})"
                                    + (f", row(s) {_short(trip.rows)}" if trip.rows else "")),
                       fix=fix_for("nonfinite-input"), tensor=trip.tensors[0] if trip.tensors
                       else None, samples=trip.rows or None, tensors=trip.tensors, rank=trip.rank)
    if trip.check in ("optimizer", "parameter"):
        if trip.check == "optimizer" and trip.manual:
            when = (f"after the script's own update of step {trip.step} (it builds no "
                    f"torch.optim optimizer; the gradients were finite)")
        elif trip.check == "optimizer":
            when = (f"after {trip.optimizer}.step() of step {trip.step} (its gradients were "
                    f"finite)")
        else:
            when = f"before step {trip.step}'s update"
        cause = "optimizer-update" if trip.check == "optimizer" else "nonfinite-parameter"
        error = f"; the script then raised {trip.error}" if trip.error else ""
        return Finding(step=trip.step, where=trip.check, value=trip.value, cause=cause,
                       explanation=f"the parameters {_short(trip.tensors)} hold non-finite values "
                                   f"{when}{error}", fix=fix_for(cause),
                       tensor=trip.tensors[0] if trip.tensors else None, tensors=trip.tensors,
                       rank=trip.rank)
    if trip.check == "error":
        return Finding(step=trip.step, where=trip.where, value=trip.value, cause="unknown",
                       fix=fix_for("unknown"), tensor=trip.tensors[0], tensors=trip.tensors,
                       rank=trip.rank,
                       explanation=(f"the script raised {trip.error} during optimizer step "
                                    f"{trip.step}, with non-finite values in its frames: "
                                    f"{_short(trip.tensors, 4)}"))
    what = "loss" if trip.check == "loss" else "gradients"
    grads = (f"; the gradients of {_short(trip.tensors)} are non-finite" if trip.tensors else "")
    grads += "".join(f"; {note}" for note in trip_notes(trip))
    return Finding(step=trip.step, where="forward" if trip.check == "loss" else "backward",
                   value=trip.value, cause="unknown", fix=fix_for("unknown"),
                   explanation=(f"the {what} of optimizer step {trip.step} hold {trip.value} "
                                f"(loss {_fmt(trip.loss)}, gradient norm {_fmt(trip.grad_norm)})"
                                f"{grads}"),
                   tensor="loss" if trip.check == "loss" else (trip.tensors or [None])[0],
                   tensors=trip.tensors, rank=trip.rank)


def trip_notes(trip: ScriptTrip) -> list:
    """Where in the step the value appeared, when the step is not one forward and backward."""
    notes = []
    if trip.evaluation:
        notes.append(f"at call {trip.evaluation + 1} of the step's closure (the optimizer "
                     f"evaluates it several times a step, as LBFGS does; the earlier calls "
                     f"were finite)")
    if trip.skipped:
        notes.append("the GradScaler skipped this step, but its loss was already non-finite "
                     "before any scaling: every later step would be skipped too")
    if trip.error:
        notes.append(f"the script then raised {trip.error}")
    return notes


# --- the re-run ---------------------------------------------------------------------------------

def localize_by_rerun(target: ScriptTarget, options: RunOptions, trip: ScriptTrip,
                      timeline: list, report: Report) -> Rerun:
    """Re-run the script to step `trip.step` with the tracer armed for that step; adopt its
    finding when the losses before that step match the first run's."""
    steps = trip.step + 1
    if not options.rerun:
        report.finding.explanation += "; not re-run (--no-rerun): the op is not named"
        return Rerun(status=RerunStatus.SKIPPED, note="--no-rerun")
    if options.max_rerun_steps is not None and steps > options.max_rerun_steps:
        note = (f"not re-run: localizing step {trip.step} repeats {steps} steps, more than "
                f"--max-rerun-steps {options.max_rerun_steps}")
        report.finding.explanation += f"; {note}"
        return Rerun(status=RerunStatus.SKIPPED, note=note)
    if trip.rank is not None:
        note = ("not re-run under torchrun: a re-run needs every rank; run the script on one "
                "process, or move to a YAML config (`nanaudit scan`), to name the op")
        report.finding.explanation += f"; {note}"
        return Rerun(status=RerunStatus.SKIPPED, note=note)
    if options.on_rerun is not None:
        options.on_rerun(trip.step)
    started = time.perf_counter()
    result, log_tail = _rerun_process(target, options, trip, timeline)
    took = round(time.perf_counter() - started, 3)

    def ran(status: RerunStatus, **details) -> Rerun:
        return Rerun(steps=steps, duration_s=took, status=status, **details)
    if result is None or result.get("error"):
        error = (result or {}).get("error") or {}
        note = f"the re-run failed: {error.get('message', 'it wrote no result')}"
        report.finding.explanation += f"; {note}"
        return ran(RerunStatus.FAILED, note=note, log_tail=log_tail)
    mismatch = compare_losses(timeline, result["timeline"], trip.step, result.get("trip"),
                              result.get("reached", False))
    if mismatch is not None:
        _not_deterministic(report.finding, mismatch)
        return ran(RerunStatus.NONDETERMINISTIC, note=mismatch)
    finding = result.get("finding")
    if finding is None and not result.get("traced"):
        note = (f"the re-run reached step {trip.step} but no module was called between step "
                f"{trip.step - 1}'s update and step {trip.step}'s optimizer step: nothing was "
                f"traced, so the op is not named")
        report.finding.explanation += f"; {note}"
        return ran(RerunStatus.NOT_TRACED, note=note)
    if finding is None:
        note = (f"the re-run matched the first run's losses up to step {trip.step}, but its "
                f"step {trip.step} came out finite under the tracer: a non-deterministic kernel "
                f"or a transient fault, not a reproducible bug in this step")
        report.finding.reproduced = False
        report.finding.explanation += f"; {note}"
        return ran(RerunStatus.NOT_REPRODUCED, note=note)
    finding.tensors = finding.tensors or report.finding.tensors
    finding.rank = trip.rank
    finding.explanation += "".join(f"; {note}" for note in trip_notes(trip))
    report.finding = finding
    return ran(RerunStatus.REPRODUCED, ops_traced=result.get("ops_traced"),
               precision=result.get("precision"))


def _rerun_process(target, options, trip, timeline):
    """Run `python -m nanaudit.commands.rerun_script SPEC` in the same folder and environment."""
    with tempfile.TemporaryDirectory(prefix="nanaudit-rerun-") as folder:
        spec_path, result_path = Path(folder) / "spec.pkl", Path(folder) / "result.pkl"
        log_path = Path(folder) / "rerun.log"
        spec = {"target": target, "seed": options.seed, "step": trip.step, "check": trip.check,
                "evaluation": trip.evaluation,
                "result": str(result_path), "losses": [e.loss for e in timeline[:trip.step]]}
        spec_path.write_bytes(pickle.dumps(spec))
        with open(log_path, "wb") as log:
            try:
                subprocess.run([sys.executable, "-m", "nanaudit.commands.rerun_script", str(spec_path)],
                               cwd=os.getcwd(), env=dict(os.environ), stdout=log,
                               stderr=subprocess.STDOUT, timeout=options.rerun_timeout_s,
                               check=False)
            except subprocess.TimeoutExpired:
                pass
        tail = log_path.read_text(errors="replace")[-2000:]
        if not result_path.exists():
            return None, tail
        # Written by our own child process, from the spec above.
        return pickle.loads(result_path.read_bytes()), tail


def timeline_warnings(timeline: list, options: WatchOptions = WatchOptions()) -> list:
    """`scan`'s early warnings from the first run's timeline, on the host, after the run: loss
    spikes and gradient growth (GrowthWatch), and an update that changed the weights' norm by
    more than `update_ratio` of it. Each entry holds the norm as the previous update left it,
    and | |w'| - |w| | <= |w' - w|, so the norms bound |update| / |weights| from below."""
    growth, warnings, previous, high = GrowthWatch(options), [], None, False
    for entry in timeline:
        if entry.skipped:
            continue
        warnings += growth.observe(entry.step, entry.loss, entry.grad_norm)
        norm = entry.param_norm
        if (previous is not None and previous.param_norm and norm is not None
                and math.isfinite(norm) and math.isfinite(previous.param_norm)
                and options.update_ratio):
            change = abs(norm - previous.param_norm) / previous.param_norm
            # Warned once as it rises above the threshold, as `scan` warns, not every step.
            was_high, high = high, change > options.update_ratio
            if high and not was_high:
                rate = f" (lr {previous.lr:.4g})" if previous.lr is not None else ""
                warnings.append(EarlyWarning(
                    kind="update-ratio", step=previous.step, began=previous.step, value=change,
                    threshold=options.update_ratio,
                    message=(f"the update of step {previous.step}{rate} took the weights' norm "
                             f"from {previous.param_norm:.4g} to {norm:.4g}: |update| / "
                             f"|weights| >= {change:.3g} (> {options.update_ratio:g}); healthy "
                             f"training is near 1e-3")))
        previous = entry
    return warnings[:MAX_WARNINGS]


def attach_timeline_warnings(report: Report, trip: ScriptTrip | None, optimizers: int) -> None:
    """The warnings of a one-optimizer run (several optimizers' steps interleave on one
    timeline), linked to the finding as `scan` links them: growth before an overflow in float32
    makes it divergence, which names the weights, not particular samples."""
    if optimizers != 1:
        return
    report.warnings = timeline_warnings(report.timeline)
    finding = report.finding
    if finding is None or trip is None:
        return
    # The creating op's precision, from the re-run (an fp32 input cast to float16 by autocast
    # overflows float16's range, not by divergence); unknown without one: no cause is changed.
    rerun = report.run.rerun
    precision = (rerun.precision if rerun is not None else None) or "unknown"
    attach_warnings(finding, report.warnings, precision)
    if finding.cause == "divergence":
        finding.fix = divergence_fix(trip.optimizer)
        finding.samples = None
        finding.sample_search = SampleSearch(None, 0, False,
                                             "divergence: the weights, not particular rows")


def divergence_fix(optimizer: str) -> str:
    """The fix for a divergence, in the script's terms: its optimizer and rate."""
    fix = "lower the learning rate or warm it up"
    if optimizer:
        fix += f" (the optimizer at this step: {optimizer})"
    if "Adam" in optimizer:
        # Adam divides by the gradient's own scale: its update is about lr per weight.
        fix += "; clipping the gradients does not shrink an Adam update, the rate does"
    else:
        fix += ", or clip the gradients (`torch.nn.utils.clip_grad_norm_`)"
    return fix


def _fmt(x) -> str:
    return "none" if x is None else f"{x:.6g}"


def compare_losses(first: list, rerun: list, step: int, rerun_trip, reached: bool) -> str | None:
    """None when the re-run followed the first run to `step`; else what differed."""
    for old, new in zip(first[:step], rerun[:step]):
        if not same_value(old.loss, new.loss):
            return (f"the loss at step {old.step} was {_fmt(old.loss)} in the first run and "
                    f"{_fmt(new.loss)} in the re-run")
    if rerun_trip is not None:
        return (f"the re-run went non-finite earlier, at step {rerun_trip.step} "
                f"({rerun_trip.check})")
    if not reached:
        return (f"the re-run ended after {len(rerun)} step(s) without reaching step {step}")
    return None


def _not_deterministic(finding: Finding, mismatch: str) -> None:
    finding.reproduced = False
    finding.explanation += (f"; the re-run from the start (same argv, environment and seeds) "
                            f"did not reproduce the first run ({mismatch}): the script is not "
                            f"deterministic, so this is what the first run saw and the op is "
                            f"not named")
    finding.fix = ("make the script deterministic: seed it (`torch.manual_seed`, the "
                   "DataLoader's `generator` and worker seeds) rather than from the clock or "
                   "os.urandom, and `torch.use_deterministic_algorithms(True)`; or move to a YAML "
                   "config (`nanaudit scan`), which replays the step from its saved state")


def rerun_failure(exc: BaseException) -> dict:
    """The error the re-run child reports back (its own frames are nanaudit's)."""
    if isinstance(exc, NanauditError):
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "InternalError", "message": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()}
