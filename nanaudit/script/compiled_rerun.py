"""The re-run's bad step of a `torch.compile`d model in a script, when its eager trace is finite.

The re-run runs the script compiled, as the first run did, up to step N, so it follows the
first run exactly; the op tracer then runs step N eagerly (run/compiled.py). When that traced
step comes out finite, the first run's value exists only in the compiled program. nanaudit does
not own the script's step, but it owns the step's first module call: when the window arms, the
model's parameters, buffers and RNG state are kept, with the call's arguments, and the
gradient that reached the call's outputs in the traced backward. After the script, the call is
replayed from that state through the compiled entry the script called (its own backend and
settings), forward and then backward with the kept output gradient, and narrowed stage by stage
(localize/compiled.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from nanaudit.localize.causes import fix_for
from nanaudit.localize.compiled import narrow, step_phase
from nanaudit.localize.compiled_finding import compiled_only_finding
from nanaudit.report.model import Finding
from nanaudit.report.sections import CompiledReplay
from nanaudit.report.vocabulary import Cause, Check, CompiledOutcome, Where
from nanaudit.run.checks import value_kind
from nanaudit.run.compiled import CompiledModel, find_compiled
from nanaudit.run.step import RngState


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


class CompiledStep:
    """Step N's first call of a compiled model, kept to replay it (see the module docstring).
    `entry`: what the script called (the `torch.compile` wrapper, or the module itself)."""

    def __init__(self, compiled: CompiledModel, module: torch.nn.Module, entry: Any,
                 args: tuple, kwargs: dict):
        self.compiled, self.module, self.entry = compiled, module, entry
        self.args, self.kwargs = args, kwargs
        with torch.no_grad():
            self.state = [(t, t.detach().clone()) for t in
                          [*module.parameters(), *module.buffers()]]
        self.rng = RngState.capture()
        self.output_grads: list[torch.Tensor | None] | None = None
        self.seen: str | None = None     # the kind of value the last replay saw
        self._handle: Any = module.register_forward_hook(self._output)

    def _output(self, module: Any, args: Any, output: Any) -> None:
        """The traced call's outputs: keep the gradient backward brings to each (one call)."""
        self.close()
        outputs = _floats(output)
        self.output_grads = [None] * len(outputs)
        for i, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(lambda grad, i=i: self._keep(i, grad))

    def _keep(self, index: int, grad: torch.Tensor) -> None:
        assert self.output_grads is not None
        self.output_grads[index] = grad.detach()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def replay(self) -> bool:
        """The call again from the kept state: are its outputs, or the parameters' gradients
        from the kept output gradients, non-finite?"""
        with torch.no_grad():
            for tensor, value in self.state:
                tensor.copy_(value)
        self.rng.restore()
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        outputs = _floats(self.entry(*self.args, **self.kwargs))
        bad = [t for t in outputs if not bool(torch.isfinite(t.detach()).all())]
        if bad:
            self.seen = value_kind(bad[0].detach())
            return True
        pairs = [(t, g) for t, g in zip(outputs, self.output_grads or [])
                 if g is not None and t.requires_grad]
        if not pairs:
            return False
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        grads = [p.grad for p in params if p.grad is not None
                 and not bool(torch.isfinite(p.grad).all())]
        self.seen = value_kind(grads[0]) if grads else None
        return bool(grads)


def compiled_step(module: torch.nn.Module, entry: Any, args: tuple,
                  kwargs: dict) -> CompiledStep | None:
    """The kept call when the armed module (or the entry the script called) is compiled."""
    compiled = find_compiled(entry) or find_compiled(module)
    if compiled is None:
        return None
    return CompiledStep(compiled, module, entry, args, kwargs)


def compiled_rerun_finding(kept: CompiledStep, step: int, check: Check) -> Finding:
    """Step N's finding when its eager trace was finite (see the module docstring)."""
    kept.close()
    phase = step_phase(check)
    tensor = "loss" if phase == Where.FORWARD else None
    narrowed = narrow(kept.compiled, kept.replay, None, phase, kept.module)
    value = kept.seen or "nan"
    if narrowed.replay.outcome == CompiledOutcome.COMPILED_ONLY:
        return compiled_only_finding(narrowed, step, value, phase, tensor, [])
    section = narrowed.replay
    section.outcome = CompiledOutcome.COMPILED_ONLY
    failed = next((r.note for r in section.replays if r.stage == "compiled"
                   and r.nonfinite is None), None)
    replayed = (f"the compiled model call could not be replayed alone ({failed})" if failed else
                "the compiled model call alone, replayed from that state, gives finite outputs "
                "and gradients, so the value is made where the step computes on the compiled "
                "outputs (its loss), which differ from eager's in the last bits")
    return Finding(
        step=step, where=phase, value=value, cause=Cause.COMPILED_ONLY, reproduced=False,
        tensor=tensor, compiled=section,
        explanation=(f"the first run's compiled step {step} made a non-finite value, and the "
                     f"re-run followed the first run's losses to that step; traced eagerly from "
                     f"the same state, step {step} is finite: the value exists only in the "
                     f"compiled program; {replayed}"),
        fix=("guard the loss against values at the edge of its domain (the compiled outputs "
             "are not bit-equal to eager's); " + fix_for(Cause.COMPILED_ONLY)))


def eager_section(kept: CompiledStep | None) -> CompiledReplay | None:
    """The section of a finding the eager trace reproduced, for a compiled model."""
    if kept is None:
        return None
    kept.close()
    return CompiledReplay(kept.compiled.backend_name, CompiledOutcome.EAGER)
