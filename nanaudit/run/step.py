"""The step's vocabulary, shared by the loop, the replays and `Sentinel`: the RNG state captured
before a step, what tripped (`Trip`), the pre-step state a replay needs (`StepState`), a run's
outcome and the timeline's record of a step. Which check tripped is decided in verdict.py; the
step itself is a unit (units.py).
"""

from __future__ import annotations

import ctypes
import functools
import operator
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanaudit.errors import ConfigError, Problem
from nanaudit.report.bad_steps import BadStepLog
from nanaudit.report.model import TimelineEntry
from nanaudit.report.vocabulary import Check, StopReason
from nanaudit.run.check.verdict import Tripped
from nanaudit.run.deferred import ReadMode
from nanaudit.run.precision import ScaleStep
from nanaudit.run.timeline import Timeline


@dataclass
class RngState:
    """Every RNG a step may draw from: torch (CPU and CUDA), Python's `random` and NumPy's
    global state (SpecAugment, LayerDrop and Mixup draw from NumPy)."""

    python: Any
    torch_cpu: torch.Tensor
    cuda: list | None
    numpy: Any = None

    @classmethod
    def capture(cls) -> RngState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        # The generator's own get_state: `torch.get_rng_state()` wraps it at twice the cost.
        return cls(_PYTHON.state(), torch.default_generator.get_state(), cuda, _NUMPY.state())

    def restore(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)


class _ReusedState:
    """A global RNG's state, captured again only when it moved.

    `random.getstate()` (~10 us) and `numpy.random.get_state()` (~45 us: it copies the
    624-word key into a new array) would be a third of a small model's step, and most steps
    never draw from them. So a capture is reused while a fingerprint of the generator's C state
    (its position and two key words, read in place through ctypes in well under a
    microsecond) is unchanged: a draw moves the position, and a refill changes the key. Once
    the generator has moved during the run, every later step captures in full: a draw that
    only takes NumPy's cached second Gaussian moves no position, and only a run that draws
    can have one cached. The in-place view is checked against the real state once; where it
    does not match (another Python or NumPy build) every step captures in full."""

    def __init__(self, full_state: Callable[[], Any], owner: Callable[[], Any],
                 fingerprint_of: Callable[[Any], Callable[[], Any] | None]) -> None:
        self._full_state, self._owner_now, self._fingerprint_of = full_state, owner, fingerprint_of
        self._owner: Any = None
        self._fingerprint: Callable[[], Any] | None = None
        self._last: tuple[Any, Any] | None = None
        self._moving = False

    def state(self) -> Any:
        owner = self._owner_now()
        if owner is not self._owner:      # first use, or the generator object was replaced
            self._owner, self._last, self._moving = owner, None, False
            self._fingerprint = self._fingerprint_of(owner) if owner is not None else None
        if owner is None:
            return None                   # NumPy not imported: nothing to capture
        if self._fingerprint is None or self._moving:
            return self._full_state()
        fingerprint = self._fingerprint()
        if self._last is None:
            self._last = (fingerprint, self._full_state())
        elif self._last[0] != fingerprint:
            self._moving = True           # the run draws from it: capture every step
            return self._full_state()
        return self._last[1]


def _python_fingerprint(owner: Any) -> Callable[[], Any] | None:    # Any: gauss_next is unstubbed
    """CPython's Random object: PyObject header, `int index`, `uint32 state[624]`, read in
    place after a check against `getstate()`; None where the layout differs."""
    try:
        words = (ctypes.c_uint32 * 625).from_address(id(owner) + 16)
        _, saved, _ = owner.getstate()
        if list(words[1:]) != list(saved[:624]) or words[0] != saved[624]:
            return None
    except (ValueError, TypeError, IndexError):
        return None
    return lambda: (words[0], words[1], words[312], owner.gauss_next)


def _numpy_generator() -> Any:
    mtrand = sys.modules.get("numpy.random.mtrand")
    if mtrand is None:                # NumPy not imported, or its `random` not loaded yet
        numpy = sys.modules.get("numpy")
        mtrand = getattr(getattr(numpy, "random", None), "mtrand", None)
    return getattr(mtrand, "_rand", None)


def _numpy_fingerprint(owner: Any) -> Callable[[], Any] | None:
    """NumPy's legacy global generator: its MT19937 `key[624], pos`, read in place after a
    check against `get_state()`; None where the layout differs."""
    try:
        raw = (ctypes.c_uint32 * 625).from_address(owner._bit_generator.ctypes.state_address)
        state = owner.get_state()
        if list(raw[:624]) != state[1].tolist() or raw[624] != state[2]:
            return None
    except (AttributeError, TypeError, ValueError):
        return None
    return functools.partial(operator.itemgetter(624, 0, 311), raw)    # called in C


def _numpy_full_state() -> Any:
    numpy = sys.modules.get("numpy")
    return numpy.random.get_state() if numpy is not None else None


_PYTHON = _ReusedState(random.getstate, functools.partial(getattr, random, "_inst"),
                       _python_fingerprint)
_NUMPY = _ReusedState(_numpy_full_state, _numpy_generator, _numpy_fingerprint)


@dataclass
class Trip:
    """What tripped a sentinel: the step and the check (a sentinel's, or Check.SCHEDULE)."""

    step: int
    check: Check
    loss: float | None = None
    grad_norm: float | None = None
    note: str | None = None       # why a GradScaler's skipped steps became a finding
    rank: int | None = None       # under torchrun: the rank whose values tripped (None: all)
    micro_batch: int | None = None   # with accumulation: the micro-batch whose input/loss tripped
    optimizer: str | None = None     # with several optimizers: the one whose check tripped
    loss_name: str | None = None     # `step:` returning named losses: the one that tripped

    @classmethod
    def found(cls, tripped: Tripped, loss: float | None, grad_norm: float | None,
              rank: int | None = None) -> Trip:
        """The Trip of a verdict. Bad weights carry no loss or gradient norm: those are the
        reading step's, not the step that made the weights."""
        if tripped.check in (Check.PARAMETER, Check.OPTIMIZER):
            return cls(tripped.step, tripped.check, rank=rank)
        return cls(tripped.step, tripped.check, loss, grad_norm, rank=rank)


@dataclass
class StepState:
    """All a replay needs from the loop: the (micro-)batch on the device, the RNG state and
    the buffers from before its forward, and where in the step it sits."""

    step: int
    batch: Any
    rng: RngState
    scale: float | None = None    # the loss scale the step ran with (GradScaler)
    buffers: list | None = None   # [(live buffer, its value before the forward)]
    batch_index: int | None = None   # the data index of this (micro-)batch
    micro_batch: int | None = None   # its place in an accumulation window
    window: int = 1                  # micro-batches in the window (the loss is scaled by 1/N)
    halt_at: int | None = None       # `step:`: the optimizer step (in call order) that tripped
    undo: list = field(default_factory=list)   # `step:`: callables putting updates back

    def rewind(self) -> None:
        """Put the RNG, the buffers and any update made before the trip back as they were
        before the step, so every replay starts from the same state."""
        for put_back in self.undo:
            put_back()
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in self.buffers], [v for _, v in self.buffers])
        self.rng.restore()


@dataclass(frozen=True)
class StepUndo:
    """What a skipped step (keep-going) puts back once its replays are done, so that it leaves
    no trace: the RNG streams as the step itself left them (the replays draw nothing the run
    sees) and the buffers as they were before the step's first forward. The parameters and
    the optimizer state need nothing: the update never ran."""

    rng: RngState
    buffers: list | None = None   # [(live buffer, its value before the step's first forward)]

    def restore(self) -> None:
        if self.buffers:
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in self.buffers], [v for _, v in self.buffers])
        self.rng.restore()


@dataclass
class ScanOutcome:
    steps_run: int = 0
    timeline: Timeline = field(default_factory=Timeline)
    trip: Trip | None = None
    state: StepState | None = None
    interrupted: bool = False
    warnings: list = field(default_factory=list)   # [EarlyWarning]
    read_mode: ReadMode | None = None   # how the sentinels were read (sync or deferred)
    host_syncs: int = 0                 # blocking reads of device values the loop made
    steps_run_again: int = 0            # keep-going, deferred: steps run twice (one wasted)
    data_rng: RngState | None = None    # the RNGs as the data was started (to read it again)
    bad_steps: BadStepLog | None = None   # keep-going: the bad steps met so far (None: stop)
    stop_reason: StopReason | None = None   # keep-going: why the trip stopped the run


def scalar_loss(value: Any, entry_key: str = "loss") -> torch.Tensor:
    """The loss tensor from what the loss callable returned (a tensor or a mapping with 'loss')."""
    if isinstance(value, dict) and "loss" in value:
        value = value["loss"]
    if not isinstance(value, torch.Tensor):
        raise ConfigError([Problem(entry_key, f"the loss callable returned a "
                                   f"{type(value).__name__}; expected a scalar tensor or a "
                                   f"mapping with a 'loss' tensor")])
    if value.numel() != 1 or not value.is_floating_point():
        raise ConfigError([Problem(entry_key, f"the loss must be a floating-point scalar tensor, "
                                   f"got shape {tuple(value.shape)} of {value.dtype}; reduce it "
                                   f"with .mean() or .sum()")])
    if not value.requires_grad:
        raise ConfigError([Problem(entry_key, "the loss does not require grad: it is not "
                                   "connected to any trainable parameter")])
    return value.reshape(()) if value.dim() else value


def current_lr(optimizer: torch.optim.Optimizer | None) -> float | None:
    """The first param group's learning rate (a Python float: no sync)."""
    if optimizer is not None and optimizer.param_groups:
        value = optimizer.param_groups[0].get("lr")
        return float(value) if isinstance(value, (int, float)) else None
    return None


def timeline_entry(step: int, loss: float | None, gnorm: float | None, norm: float | None,
                   optimizer: torch.optim.Optimizer | None, started: float,
                   scale: float | None = None, scaler_step: ScaleStep | None = None,
                   ended: float | None = None, lr: float | None = None,
                   **fields: Any) -> TimelineEntry:
    """The timeline's record of one step (the step loop's and the Sentinel's). `lr`: the one
    the step's update used, read before a scheduler moved it (default: the optimizer's now)."""
    ended = time.perf_counter() if ended is None else ended
    return TimelineEntry(step=step, loss=loss, grad_norm=gnorm, param_norm=norm,
                         lr=current_lr(optimizer) if lr is None else lr,
                         time_ms=round((ended - started) * 1000, 3), scale=scale,
                         skipped=bool(scaler_step and scaler_step.skipped), **fields)


@dataclass
class ReplayHooks:
    """What an instrumented replay needs told: when backward starts and ends (the tracer's
    phases), and a batch of rows to use instead of the recorded one (sample search)."""

    before_backward: Callable[[], None] | None = None
    after_backward: Callable[[], None] | None = None
