"""`Sentinel`: nanaudit's checks inside your own training loop, raising before a bad update.

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    for step, batch in enumerate(loader):
        loss = compute_loss(model, batch)
        loss.backward()
        sentinel.check(step, batch, loss)     # raises NonFiniteError(report)
        optimizer.step(); optimizer.zero_grad()

With gradient accumulation, record each micro-batch after its backward and check once per
optimizer step:

    for index, batch in enumerate(loader):
        loss = compute_loss(model, batch) / accumulation
        loss.backward()
        sentinel.micro_batch(batch, loss)          # no host read
        if (index + 1) % accumulation == 0:
            sentinel.check_update(step)            # one host read; raises before the update
            optimizer.step(); optimizer.zero_grad(); step += 1

`check` is `micro_batch` + `check_update` for a window of one. `check_update` costs what a
`scan` step costs: one host read of a few device values (every micro-batch's finiteness flag
and loss, the weights' norm, the gradient norm, the GradScaler's scale), no per-tensor sync. On a
trip it builds the same Report as `scan`. With `loss_fn` (called as `loss_fn(model, batch)`)
the step is replayed under the op tracer to name the op, module, source line and samples; the
replay covers the whole accumulation window: a bad input or loss names its micro-batch from the
read itself, and non-finite accumulated gradients are traced to the first micro-batch whose own
gradients reproduce them, so a bug in an early micro-batch is never called transient. Without
`loss_fn` the report names the check that tripped and the tensors.

The replay needs each micro-batch's RNG state from before its forward. The sentinel captures it
at the end of each `micro_batch` / `check` (and when it is created), which is the start of the
next forward unless the loop draws random numbers in between; integrations call `capture_rng()`
at the batch start instead. If the replay still differs, the finding says `reproduced: false`.

Under AMP pass `scaler=`: a step whose gradients overflow is the GradScaler's skip, not a
finding, unless the scale collapses (below `scale_floor`, or `max_skipped` skips in a row), as
in `scan`; a non-finite input or loss is still a finding.

With `on_finding="skip"` a trip does not raise: `check` / `check_update` return False, the
loop leaves out that step's `optimizer.step()` (the one line `if sentinel.check(...):` before
it), and the sentinel has put the model's buffers (running statistics) back as they were
before the step's first forward, so the step leaves no trace. Each bad step is a full finding
in `sentinel.report.findings`; the replay that localizes it runs on a forked RNG, so the loop's
random streams are as they would be without nanaudit. After `max_bad_steps` skipped steps, or
a weight or buffer already non-finite before a step (skipping cannot help), it raises.

With `output_dir`, a trip also writes nanaudit.json, nanaudit.md, nanaudit.txt and the repro
bundle `repro-step<N>/` there before raising (`nanaudit replay` reads it; an importable
`loss_fn` is recorded by name, the model needs `--model module:factory` unless its class can
be rebuilt without arguments: see integrations/_output.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nanaudit.integrations.sentinel_ranks import (
    join_ranks,
    rank_trip,
    with_rank_flags,
)
from nanaudit.integrations.sentinel_replay import (
    RecordedBatch,
    ReplayTarget,
    localize_step,
    named_optimizers,
)
from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.model import Finding, Report
from nanaudit.report.vocabulary import BadStepAction, Check, Status
from nanaudit.run.batch import float_leaves
from nanaudit.run.check.decision import StepDecision, keep_going
from nanaudit.run.check.scaler import ScalerWatch
from nanaudit.run.check.scope import float_buffers
from nanaudit.run.check.verdict import tripped_check
from nanaudit.run.checks import all_finite, confirm_norms, dense_values, finite_norms
from nanaudit.run.sharded import local_shards
from nanaudit.run.step import RngState, ScanOutcome, StepState, Trip, timeline_entry
from nanaudit.run.step_record import BufferCopy
from nanaudit.run.timeline import Timeline, report_timeline


class NonFiniteError(RuntimeError):
    """A sentinel saw a non-finite value; `.report` holds the full nanaudit Report."""

    def __init__(self, report: Report) -> None:
        from nanaudit.report.text import finding_message, headline
        self.report = report
        self.finding: Finding | None = report.finding
        detail = finding_message(report.finding) if report.finding else ""
        super().__init__(f"{headline(report)}\n{detail}".strip())


class _Scope:
    """What one `check_update` looks at: every weight and float buffer of the model, and the
    gradients of the parameters the stepping optimizer owns (all of them by default)."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.state = list(model.parameters()) + float_buffers(model)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t.detach() for t in local_shards(self.state)]     # FSDP2: this rank's shards

    def grads(self) -> list[torch.Tensor]:
        return [g.detach() for g in local_shards([p.grad for p in self.params
                                                  if p.grad is not None])]

    def grad_values(self) -> list[torch.Tensor]:
        return [dense_values(g) for g in self.grads()]


class Sentinel:
    """Cheap non-finite checks for a hand-written training loop (see the module docstring).

    `optimizer` may be one optimizer or a list (the timeline's lr is the first one's); pass the
    one about to step to `check_update(step, optimizer=...)` to check only its gradients. The
    timeline keeps the first steps and the last `history` ones whole, and summarizes the steps
    between (run/timeline.py), so a loop of any length keeps it in bounded memory."""

    def __init__(self, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer | None]
                 | None = None,
                 loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
                 scaler: Any = None, isolate_samples: bool = True, history: int = 1000,
                 max_skipped: int = 10, scale_floor: float = 1.0, output_dir: str | None = None,
                 on_finding: str = "raise", max_bad_steps: int = 10) -> None:
        if on_finding not in ("raise", "skip"):
            raise ValueError(f"on_finding is 'raise' or 'skip', not {on_finding!r}")
        if isinstance(optimizer, (list, tuple)):
            self.optimizers = [o for o in optimizer if o is not None]
        else:
            self.optimizers = [optimizer] if optimizer is not None else []
        self.optimizer = self.optimizers[0] if self.optimizers else None
        self.model, self.loss_fn, self.scaler = model, loss_fn, scaler
        self.isolate_samples = isolate_samples
        self.history = history
        self.max_skipped, self.scale_floor = max_skipped, scale_floor
        self.output_dir = output_dir
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._scopes: dict = {}
        self._last_step: int | None = None   # the step of the last check that passed
        self._rng = RngState.capture()
        self._window: list[RecordedBatch] = []
        self._last_window: list[RecordedBatch] = []
        self._seen = 0                       # micro-batches recorded so far (default index)
        # Skips and the collapse rule: the check core's, as the loop's and `nanaudit run`'s.
        self.scaler_watch = ScalerWatch(scale_floor, max_skipped, options="")
        self.steps_checked = 0
        self.timeline = Timeline(tail=max(history, 1))
        self.report: Report | None = None    # the last trip's report
        self.tripped: tuple[Trip, StepState] | None = None
        self.replaying: RecordedBatch | None = None   # the micro-batch a replay is running
        # FSDP2 under torchrun: the ranks decide together (sentinel_ranks.py)
        self.ranks = join_ranks(model)
        self._target = ReplayTarget(model, named_optimizers(self.optimizers), loss_fn,
                                    self.device, scaler, isolate_samples, self.ranks)
        # on_finding="skip": every bad step's finding, and the buffers before the step
        self.bad_steps = BadStepLog(max_bad_steps) if on_finding == "skip" else None
        self._buffers = BufferCopy(model) if self.bad_steps is not None else None

    @property
    def skipped(self) -> int:
        """The steps the GradScaler skipped so far."""
        return self.scaler_watch.skipped

    # --- recording --------------------------------------------------------------------------

    def capture_rng(self) -> None:
        """Take the RNG state for the next micro-batch now (call right before its forward)."""
        self._rng = RngState.capture()

    def micro_batch(self, batch: Any, loss: torch.Tensor,
                    index: int | None = None) -> RecordedBatch:
        """Record one micro-batch after its backward: its batch, loss and RNG state. No host
        read; `check_update` reads every recorded micro-batch at once. Returns the record."""
        finite = all_finite([t for _, t in float_leaves(batch)], self.device)
        value = loss.detach().reshape(()).to(torch.float64).to(self.device)
        record = RecordedBatch(self._seen if index is None else index, batch, self._rng, finite,
                            value)
        self._window.append(record)
        self._seen += 1
        self._rng = RngState.capture()
        return record

    def check(self, step: int, batch: Any, loss: torch.Tensor) -> bool:
        """Check the batch, weights, loss and gradients of `step`; call after backward and
        before `optimizer.step()`. Raises NonFiniteError with the report on a non-finite value
        (with on_finding="skip": returns False instead, and the step's update is left out)."""
        self.micro_batch(batch, loss)
        return self.check_update(step)

    # --- the check --------------------------------------------------------------------------

    def check_update(self, step: int, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Check the window's micro-batches, the weights and the accumulated gradients before
        the optimizer step of `step`: one host read. Raises NonFiniteError before the update;
        returns whether the loop applies it (False: a bad step skipped, on_finding="skip")."""
        started = time.perf_counter()
        # Several optimizers stepping after one backward share its micro-batches.
        window = self._window or self._last_window
        self._window, self._last_window = [], window
        scope = self._scope(optimizer)
        state_norm, grad_norm = finite_norms([scope.state_tensors(), scope.grad_values()],
                                             self.device)
        head = [state_norm, grad_norm]
        live_scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
        if live_scale is not None:
            head.append(live_scale.detach().reshape(()).to(torch.float64).to(self.device))
        parts = head + [m.finite for m in window] + [m.loss for m in window]
        stacked = torch.stack(parts)
        if self.ranks is not None:
            stacked = with_rank_flags(self.ranks, stacked, len(head), len(window))
        values = stacked.tolist()           # the one host read of the step
        norm, gnorm = values[0], values[1]
        scale = values[2] if live_scale is not None else None
        flags = values[len(head):len(head) + len(window)]
        losses = values[len(head) + len(window):len(parts)]
        norm, gnorm = confirm_norms(scope, norm, gnorm)
        self.steps_checked += 1
        if self.ranks is not None:
            trip, where = rank_trip(self.ranks, step, values[len(parts):], self._last_step,
                                    flags, losses, gnorm)
        else:
            trip, where = self._classify(step, flags, losses, norm, gnorm, scale)
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        self._record(step, mean_loss, gnorm, norm, started, scale)
        self.timeline[-1].skipped = (self.scaler is not None and not math.isfinite(gnorm)
                                     and (trip is None or trip.note is not None))
        return self._act(step, trip, window, where, scale)

    def _act(self, step: int, trip: Trip | None, window: list[RecordedBatch], where: int | None,
             scale: float | None) -> bool:
        """Act on the step's decision: apply, skip (keep going) or stop."""
        log = self.bad_steps
        if log is None:
            decision, reason = StepDecision.of(trip), None
        else:
            decision, reason = keep_going(trip.check if trip else None, log.skipped,
                                          log.max_bad_steps)
        match decision:
            case StepDecision.APPLY:
                self._last_step = step
                if self._buffers is not None:
                    self._buffers.save()
                return True
            case StepDecision.SKIP:
                assert trip is not None and log is not None and self._buffers is not None
                self._buffers.restore()
                log.record(self._finding(trip, window, where, scale), BadStepAction.SKIPPED)
                self._buffers.restore()          # the replay ran the model's forward again
                self.report = self.make_report("nonfinite")
                return False
            case StepDecision.STOP:
                assert trip is not None
                started = time.perf_counter()
                finding = self._finding(trip, window, where, scale)
                if log is not None:
                    log.record(finding, BadStepAction.STOPPED, reason)
                self.report = self.make_report("nonfinite", finding,
                                               time.perf_counter() - started)
                if self.output_dir is not None:
                    from nanaudit.integrations._output import write_sentinel_outputs
                    write_sentinel_outputs(self, self.output_dir)
                raise NonFiniteError(self.report)

    def _scope(self, optimizer: torch.optim.Optimizer | None) -> _Scope:
        key = id(optimizer) if optimizer is not None else None
        if key not in self._scopes:
            if optimizer is None:
                params = list(self.model.parameters())
            else:
                owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
                params = [p for p in self.model.parameters() if id(p) in owned]
            self._scopes[key] = _Scope(self.model, params)
        return self._scopes[key]

    def _classify(self, step: int, flags: list[float], losses: list[float], norm: float,
                  gnorm: float, scale: float | None) -> tuple[Trip | None, int | None]:
        """(Trip, index of the micro-batch it names, or None for a search) or (None, None)."""
        verdict = tripped_check(step, inputs_ok=[ok >= 1.0 for ok in flags],
                                weights_finite=math.isfinite(norm),
                                # The weights were fine at the last check; the update after
                                # it made them bad.
                                updated_at=self._last_step,
                                loss_finite=[math.isfinite(v) for v in losses],
                                grads_finite=math.isfinite(gnorm))
        if verdict is None:
            self.scaler_watch.applied()
            return None, None
        if verdict.part is not None:     # a micro-batch's own input or loss
            return Trip.found(verdict, losses[verdict.part], gnorm), verdict.part
        last_loss = losses[-1] if losses else None
        if verdict.check != Check.GRADIENT or self.scaler is None:
            return Trip.found(verdict, last_loss, gnorm), None
        # The GradScaler will skip this update and back off its scale: AMP's normal course,
        # unless the scale collapsed, which means the gradients overflow whatever the scale.
        collapsed = self.scaler_watch.skip_with(self.scaler, scale)
        if collapsed is None:
            return None, None
        return Trip(step, Check.GRADIENT, last_loss, gnorm, note=collapsed), None

    def _record(self, step: int, loss_value: float, gnorm: float, norm: float, started: float,
                scale: float | None) -> None:
        self.timeline.append(timeline_entry(step, loss_value, gnorm, norm, self.optimizer,
                                            started, scale))

    def _replaying(self, micro: RecordedBatch | None) -> None:
        self.replaying = micro        # the integrations name the micro-batch being replayed

    # --- the report -------------------------------------------------------------------------

    def _finding(self, trip: Trip, window: list[RecordedBatch], where: int | None,
                 scale: float | None) -> Finding:
        """The trip's finding (sentinel_replay.localize_step); its state kept for the
        integrations writing a repro bundle."""
        outcome = ScanOutcome(steps_run=self.steps_checked, timeline=self.timeline, trip=trip)
        finding, state = localize_step(self._target, outcome, window, where, scale, self._rng,
                                       on_replay=self._replaying)
        self.tripped = (trip, state)
        return finding

    def make_report(self, status: Status | str, finding: Finding | None = None,
                    duration_s: float = 0.0) -> Report:
        """The Report of this sentinel's run so far (integrations write a clean one at the end)."""
        return sentinel_report(self.timeline, self.steps_checked, self.device, Status(status),
                               finding, duration_s, self.bad_steps)


def sentinel_report(timeline: Timeline, steps: int, device: torch.device, status: Status,
                    finding: Finding | None, duration_s: float,
                    bad_steps: BadStepLog | None) -> Report:
    """The Report of a Sentinel's checks: its timeline, the finding, and (kept going) every
    bad step's finding."""
    from nanaudit._version import __version__
    rows, summary = report_timeline(timeline)
    report = Report(tool_version=__version__, config={"path": None, "api": "Sentinel"},
                    torch_version=torch.__version__, device=str(device), status=status,
                    steps_run=steps, command="sentinel", finding=finding, timeline=rows,
                    duration_s=duration_s, timeline_summary=summary)
    if bad_steps is not None:
        bad_steps.apply(report)      # kept going: every bad step's finding
    return report
