"""Every finding of `nanaudit run` that the first run alone can state (the step, the check,
the tensors, the rows), and what the re-run adds to it or says instead; the localized finding
itself comes from localize (`traced_finding`), as for every other command."""

from __future__ import annotations

from collections.abc import Iterable

from nanaudit.localize.causes import clipping_known, divergence_fix, fix_for
from nanaudit.localize.early_warnings import attach_warnings
from nanaudit.localize.first_finding import Seen, first_finding
from nanaudit.localize.first_finding import short as short_list
from nanaudit.report.model import Finding, SampleSearch
from nanaudit.report.vocabulary import Cause, Check
from nanaudit.script.trip import ScriptTrip


def short(items: Iterable[object], limit: int = 8) -> str:
    """localize's list shortener, at the eight items `nanaudit run`'s findings show."""
    return short_list(items, limit)


def number(x: float | None) -> str:
    return "none" if x is None else f"{x:.6g}"


def first_run_finding(trip: ScriptTrip) -> Finding:
    """The finding from the first run alone: the step, the check, the tensors, the rows, built
    by localize's one builder from what the script's hooks saw, then the clauses that add."""
    seen, clauses = _seen(trip)
    finding = first_finding(seen)
    finding.micro_batch = trip.micro_batch
    for clause in clauses:
        finding.explain(clause)
    return finding


def _seen(trip: ScriptTrip) -> tuple[Seen, list[str]]:
    """What the first run saw of `trip`, in the script's terms, and the clauses that follow."""
    step, check, value, tensors, rank = trip.step, trip.check, trip.value, trip.tensors, trip.rank
    if check == Check.INPUT:
        return Seen(step, check, value, _input_text(trip), tensors, samples=trip.rows or None,
                    rank=rank), []
    if trip.in_buffers:
        first, *notes = trip_notes(trip)
        return Seen(step, check, value, first, tensors, rank=rank, in_forward=True), notes
    if check in (Check.OPTIMIZER, Check.PARAMETER):
        return Seen(step, check, value, _state_text(trip), tensors, rank=rank), list(trip.state)
    if check == Check.ERROR:
        return Seen(step, check, value,
                    f"the script raised {trip.error} during optimizer step {step}, with "
                    f"non-finite values in its frames: {short(tensors, 4)}", tensors,
                    tensor=tensors[0], rank=rank, where=trip.where), []
    what = "loss" if check == Check.LOSS else "gradients"
    grads = [f"the gradients of {short(tensors)} are non-finite"] if tensors else []
    seen = Seen(step, check, value,
                f"the {what} of optimizer step {step} hold {value} (loss "
                f"{number(trip.loss)}, gradient norm {number(trip.grad_norm)})", tensors,
                tensor="loss" if check == Check.LOSS else None, rank=rank)
    return seen, grads + trip_notes(trip)


def _input_text(trip: ScriptTrip) -> str:
    window = (f"micro-batch {trip.micro_batch} of step {trip.step}"
              if trip.micro_batch is not None else f"step {trip.step}")
    return (f"the floating inputs of the first module call of {window} hold non-finite "
            f"values before the model runs: {short(trip.tensors)} (shapes {trip.input_shapes})"
            + (f", row(s) {short(trip.rows)}" if trip.rows else ""))


def _state_text(trip: ScriptTrip) -> str:
    if trip.check == Check.OPTIMIZER and trip.manual:
        when = (f"after the script's own update of step {trip.step} (it builds no "
                f"torch.optim optimizer; the gradients were finite)")
    elif trip.check == Check.OPTIMIZER:
        when = f"after {trip.optimizer}.step() of step {trip.step} (its gradients were finite)"
    else:
        when = f"before step {trip.step}'s update"
    error = f"; the script then raised {trip.error}" if trip.error else ""
    return f"the parameters {short(trip.tensors)} hold non-finite values {when}{error}"


def trip_notes(trip: ScriptTrip) -> list[str]:
    """Where in the step the value appeared, when the step is not one forward and backward."""
    notes = []
    if trip.in_buffers:
        notes.append(f"the model's buffers {short(trip.tensors)} hold non-finite values after "
                     f"the forward of optimizer step {trip.step} (the loss was "
                     f"{number(trip.loss)}, the gradient norm {number(trip.grad_norm)}): the "
                     f"next steps' forwards would read them")
    if trip.evaluation:
        notes.append(f"at call {trip.evaluation + 1} of the step's closure (the optimizer "
                     f"evaluates it several times a step, as LBFGS does; the earlier calls "
                     f"were finite)")
    if trip.collapsed:
        notes.append(f"{trip.scaler}'s loss scale collapsed: {trip.collapsed}; the gradients "
                     f"overflow whatever the scale, so no update would ever run")
    if trip.skipped and trip.check == Check.INPUT:
        notes.append("the GradScaler skipped this step's update (the bad batch made its loss "
                     "non-finite)")
    elif trip.skipped:
        notes.append("the GradScaler skipped this step, but its loss was already non-finite "
                     "before any scaling: every later step would be skipped too")
    if trip.error:
        notes.append(f"the script then raised {trip.error}")
    if trip.unreached:
        notes.append("the script computed this loss and skipped it before backward (a guard "
                     "such as `if not torch.isfinite(loss): continue`): the value was made all "
                     "the same")
    return notes


def not_deterministic(finding: Finding, mismatch: str) -> None:
    """The re-run did not follow the first run: what the first run saw stands, unlocalized."""
    finding.reproduced = False
    finding.explain(f"the re-run from the start (same argv, environment and seeds) did not "
                    f"reproduce the first run ({mismatch}): the script is not deterministic, "
                    f"so this is what the first run saw and the op is not named")
    finding.fix = ("make the script deterministic: seed it (`torch.manual_seed`, the "
                   "DataLoader's `generator` and worker seeds) rather than from the clock or "
                   "os.urandom, and `torch.use_deterministic_algorithms(True)`; or move to a YAML "
                   "config (`nanaudit scan`), which replays the step from its saved state")


def link_warnings(finding: Finding, warnings: list, precision: str, optimizer: str,
                  clips: bool = False) -> None:
    """Link the early warnings that bear on `finding` to it, as `scan` links them: growth before
    an overflow in float32 makes it divergence, which names the weights, not particular rows.
    `precision`: the creating op's (fp16 / bf16 / fp32), "unknown" without a replay (then no
    cause is changed); `clips`: the script clips its gradients (a divergence's fix then does not
    advise it). Once per finding: a bad step's is linked when the run meets it."""
    if finding.first_warning is not None:
        return
    attach_warnings(finding, warnings, precision)
    if finding.cause == Cause.DIVERGENCE:
        if finding.fix == fix_for(Cause.DIVERGENCE):
            # the catalogue's words (growth on the timeline): say them in the script's terms;
            # a diagnosis that named the optimizer (weight_growth.py) keeps its own
            finding.fix = divergence_fix(optimizer, clips=clips)
        elif clips:
            finding.fix = clipping_known(finding.fix)
        finding.samples = None
        finding.sample_search = SampleSearch(None, 0, False,
                                             "divergence: the weights, not particular rows")
