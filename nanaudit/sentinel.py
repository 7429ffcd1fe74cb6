"""`Sentinel`: nanaudit's checks inside your own training loop, raising before a bad update.

    sentinel = Sentinel(model, optimizer, loss_fn=compute_loss)
    for step, batch in enumerate(loader):
        loss = compute_loss(model, batch)
        loss.backward()
        sentinel.check(step, batch, loss)     # raises NonFiniteError(report)
        optimizer.step(); optimizer.zero_grad()

`check` costs what a `scan` step costs: one host read of a few device values (batch
finiteness, the weights' norm, the loss, the gradient norm), no per-tensor sync. On a trip it
builds the same Report as `scan`: with `loss_fn` (called as `loss_fn(model, batch)`) the step
is replayed under the op tracer to name the op, module, source line and samples; without it the
report names the check that tripped and the tensors.

The replay needs the RNG state from before the step's forward. The sentinel captures it at the
end of each `check` (and when it is created), which is the start of the next forward unless the
loop draws random numbers in between; if that makes the replay differ, the finding says
`reproduced: false` rather than guess.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from nanaudit.config import Config, Entrypoint
from nanaudit.report import Finding, Report, TimelineEntry
from nanaudit.runner import (RngState, ScanOutcome, StepState, Trip, classify_step,
                             confirm_norms, timeline_entry)
from nanaudit.sentinels import Sentinels, all_finite
from nanaudit.tree import float_leaves


class NonFiniteError(RuntimeError):
    """A sentinel saw a non-finite value; `.report` holds the full nanaudit Report."""

    def __init__(self, report: Report):
        from nanaudit.render.text import finding_message, headline
        self.report = report
        self.finding: Finding | None = report.finding
        detail = finding_message(report.finding) if report.finding else ""
        super().__init__(f"{headline(report)}\n{detail}".strip())


class Sentinel:
    """Cheap non-finite checks for a hand-written training loop (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
                 scaler: Any = None, isolate_samples: bool = True, history: int = 1000):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.scaler = scaler
        self.isolate_samples = isolate_samples
        self.history = history
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._sentinels = Sentinels(model, self.device)
        self._checked_once = False
        self._rng = RngState.capture()
        self.timeline: list[TimelineEntry] = []

    def check(self, step: int, batch: Any, loss: torch.Tensor) -> None:
        """Check the batch, weights, loss and gradients of `step`; call after backward and
        before `optimizer.step()`. Raises NonFiniteError with the report on a non-finite value."""
        started = time.perf_counter()
        batch_ok = all_finite([t for _, t in float_leaves(batch)], self.device)
        # The weights as this step's forward saw them (a bad previous update shows here) and
        # the gradients, in one fused reduction, read with the batch flag and loss at once.
        state_norm, grad_norm = self._sentinels.norms()
        values = torch.stack([batch_ok, state_norm,
                              loss.detach().reshape(()).to(torch.float64).to(self.device),
                              grad_norm]).tolist()
        ok_batch, norm, loss_value, gnorm = values
        norm, gnorm = confirm_norms(self._sentinels, norm, gnorm)
        trip = classify_step(step, ok_batch, norm, loss_value, gnorm, self._checked_once)
        if trip is not None and trip.check == "gradient" and self.scaler is not None:
            trip = None          # the GradScaler will skip this step and back off its scale
        self._record(step, loss_value, gnorm, norm, started)
        if trip is not None:
            raise NonFiniteError(self._report(trip, StepState(step, batch, self._rng)))
        self._checked_once = True
        self._rng = RngState.capture()

    def _record(self, step, loss_value, gnorm, norm, started) -> None:
        self.timeline.append(timeline_entry(step, loss_value, gnorm, norm, self.optimizer,
                                            started))
        del self.timeline[:-self.history]

    def _report(self, trip: Trip, state: StepState) -> Report:
        from nanaudit import __version__
        from nanaudit.findings import build_finding, unreplayed_finding
        session = self._session()
        outcome = ScanOutcome(steps_run=len(self.timeline), timeline=self.timeline, trip=trip,
                              state=state)
        started = time.perf_counter()
        if trip.check in ("loss", "gradient") and self.loss_fn is None:
            finding = unreplayed_finding(trip, "pass `loss_fn=` to Sentinel (called as "
                                               "loss_fn(model, batch))")
        else:
            finding = build_finding(session, outcome, self.isolate_samples)
        return Report(tool_version=__version__, config={"path": None, "api": "Sentinel"},
                      torch_version=torch.__version__, device=str(self.device),
                      status="nonfinite", steps_run=trip.step + 1, command="sentinel",
                      finding=finding, timeline=list(self.timeline),
                      duration_s=time.perf_counter() - started)

    def _session(self):
        from nanaudit.loader import Session
        entry = Entrypoint("<your loop>:loss_fn", "Sentinel(loss_fn=...)")
        config = Config(path=Path("<Sentinel>"), model=entry, data=entry, loss=entry)
        loss_fn = self.loss_fn or (lambda model, batch: None)
        names = {id(p): n for n, p in self.model.named_parameters()}
        return Session(config, self.device, self.model, self.optimizer, loss_fn,
                       lambda: [], names)

