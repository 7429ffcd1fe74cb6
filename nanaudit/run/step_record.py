"""The record of the current step that every front end can replay it from, in-process.

At a check the update has not been applied: the parameters and the optimizer state are the
step's own. What a replay needs besides is held here, for the current window only (the
micro-batches since the last check): each model call's arguments and output (references), the
script's loss code after it (loss_code.py), the RNG states at the window's first call (the CPU
generator and every initialized CUDA one) and the model's buffers as they were before
that call (running statistics and batch counts: a copy of the buffers into tensors kept from
step to step, one `_foreach_copy_`, never a copy of the weights).

`replaying()` puts the window's start back (RNG streams, buffers, no gradients) for a replay and
afterwards the state the trip left (the RNG streams, the buffers and the gradients as the
script had them), so whatever follows starts from the true state. `restore_buffers()` alone is
what skipping a step needs (keep-going)."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from types import CodeType, FrameType
from typing import Any

import torch

from nanaudit.run.loss_code import (
    LossCode,
    autocast_state,
    is_user_file,
    storage_key,
    user_frame,
)

_any_autocast = torch._C._is_any_autocast_enabled
_cpu_state = torch.default_generator.get_state
# How many frames above a model call are kept to find the script's line in, should a replay ask
# (the hook, torch's call machinery, wrappers such as DDP's, then the script).
_SITE_DEPTH = 16


class ModelCall:
    """One micro-batch: the model call the script made (`entry`: what it called, a compile
    wrapper of `module`), its output (None until it returned), its loss code, the unscaled
    losses that reached backward, the RNG states as it began, and whether its loss was
    skipped before backward (the script's guard), and the user's line that called the model
    (a replayed op of a module of torch's names it). Slotted: one is made a micro-batch."""

    __slots__ = (
        "_site",
        "args",
        "autocast",
        "before",
        "code",
        "entry",
        "kwargs",
        "losses",
        "module",
        "output",
        "rng",
        "skipped",
        "trains",
    )

    def __init__(self, module: torch.nn.Module, entry: Any, args: tuple, kwargs: dict,
                 rng: tuple) -> None:
        self.module, self.entry, self.args, self.kwargs = module, entry, args, kwargs
        self.output: Any = None
        self.code = LossCode()
        self.losses: list[torch.Tensor] = []
        self.rng = rng
        self.skipped = False
        # the frozen calls (a teacher's, under no_grad) the script made since the previous
        # training call, each with the code after it: replayed before this one
        self.before: list[ModelCall] = []
        self.trains = True                  # False: a frozen call, replayed without autograd
        # the autocast regions the call ran in (one C call when none is: the common case)
        self.autocast = autocast_state() if _any_autocast() else ()
        # The frames' code and line up to the script's own (read now: a frame kept would keep
        # its locals alive), no deeper: the walk stops at the first user file (a cached C-level
        # test), a few frames above the hook instead of all _SITE_DEPTH of them each step.
        frame: FrameType | None = sys._getframe(1)
        site: list[tuple[CodeType, int]] = []
        while frame is not None and len(site) < _SITE_DEPTH:
            code = frame.f_code
            site.append((code, frame.f_lineno))
            if is_user_file(code.co_filename):
                break
            frame = frame.f_back
        self._site = site

    @classmethod
    def code_only(cls, rng: tuple) -> ModelCall:
        """The window of a step that calls no module (a model written as raw tensors, layers
        whose `forward` the script calls itself): its code from the step's start, no model
        call to make again (`module` stands in, without parameters)."""
        call = cls(_NO_MODEL, None, (), {}, rng)
        call._site, call.code = [], LossCode(whole_step=True)
        return call

    @property
    def model_called(self) -> bool:
        """False for a window of the step's code alone (`code_only`)."""
        return self.module is not _NO_MODEL

    @property
    def where(self) -> tuple[str, int, str] | None:
        """The script's line that made this call: (file, line, function); None if not seen."""
        return user_frame(self._site)

    def seed_replay(self) -> None:
        """The RNG streams as this call began (the data code between calls drew on them)."""
        _set_rng_states(self.rng)


_NO_MODEL = torch.nn.Module()         # a step-code window's module: no call, no parameters
# Frozen calls kept between two training calls, the latest: a teacher is called once or twice
# a micro-batch; an evaluation loop between steps would otherwise keep every batch it ran.
_FROZEN_KEPT = 4


class BufferCopy:
    """A module's buffers (running statistics, batch norm's count of batches) and the copies
    they are saved into (allocated once per module: walking a large model's buffers each step
    would cost more than the rest)."""

    def __init__(self, module: torch.nn.Module):
        # weakly: a copy kept for a model the script let go (an earlier fold's) frees it
        self.owner = weakref.ref(module)
        self.tensors = list(module.buffers())
        self.saved = [b.detach().clone() for b in self.tensors]
        # A copy into buffers that autograd does not track needs no `no_grad()` (a context
        # manager's enter and exit, each step); one that does (rare) keeps it.
        self._tracked = any(b.requires_grad for b in self.tensors)

    def save(self) -> None:
        self._copy(self.saved, self.tensors)

    def restore(self) -> None:
        """The buffers as they were when last saved."""
        self.put(self.saved)

    def put(self, values: list[torch.Tensor]) -> None:
        self._copy(self.tensors, values)

    def _copy(self, into: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        if not into:
            return
        if self._tracked:
            with torch.no_grad():
                torch._foreach_copy_(into, values)
        else:
            torch._foreach_copy_(into, values)


RngStates = tuple[torch.Tensor, "list[torch.Tensor] | tuple[()]"]


def rng_states() -> RngStates:
    """The CPU generator's state (a 5 KB copy, ~1 us: the only per-step RNG cost on CPU) and
    every initialized CUDA generator's."""
    if torch.cuda.is_initialized():
        return _cpu_state(), torch.cuda.get_rng_state_all()
    return _cpu_state(), ()


def _set_rng_states(states: RngStates) -> None:
    torch.set_rng_state(states[0])
    if states[1]:
        torch.cuda.set_rng_state_all(states[1])


class StepRecord:
    """The current window's calls, RNG states and buffers (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[ModelCall] = []
        # A step that calls no module: its code since the step's start (dropped at a call)
        self.code_window: ModelCall | None = None
        self._frozen: list[ModelCall] = []     # frozen calls since the last training call
        # The latest call of a model the script trains, made without autograd since the last
        # check (an evaluation, a sample drawn between steps): replayed only for an error the
        # script raised before the next training call (script/error_replay.py)
        self.evaluated: ModelCall | None = None
        self._rng: RngStates | None = None
        # The buffers of the window's modules, each saved before its first call in it: the
        # model's, and those of a piece its forward went on through (a decoder called on the
        # encoder's output); copies allocated once per module, kept while it is called.
        self._buffers: list[BufferCopy] = []
        self._copies: dict[int, BufferCopy] = {}

    @property
    def open(self) -> bool:
        return bool(self.calls)

    def called(self, module: torch.nn.Module, entry: Any, args: tuple,
               kwargs: dict) -> ModelCall:
        """A micro-batch's model call; the window's first takes the RNG states and buffers."""
        self.code_window = None
        rng = rng_states()
        if not self.calls:
            self._rng, self._buffers = rng, []
            copy = self._copies.get(id(module))
            if copy is None or copy.owner() is not module:
                self.piece(module)          # its copy made
            else:                           # the common path pays no call for it
                if copy.tensors:
                    copy.save()
                self._buffers.append(copy)
        call = ModelCall(module, entry, args, kwargs, rng=rng)
        call.before, self._frozen, self.evaluated = self._frozen, [], None
        self.calls.append(call)
        return call

    def piece(self, module: torch.nn.Module) -> None:
        """Save `module`'s buffers as they are before its first call in the window."""
        copy = self._copies.get(id(module))
        if copy is None or copy.owner() is not module:
            # a module not called before: the copies of those the script let go are let go
            self._copies = {key: c for key, c in self._copies.items() if c.owner() is not None}
            copy = self._copies[id(module)] = BufferCopy(module)
        if copy not in self._buffers:        # (kept with none: walked once, not each step)
            if copy.tensors:
                copy.save()
            self._buffers.append(copy)

    def frozen_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> ModelCall:
        """A call of a module made without autograd before a training call (a distillation
        teacher's, an EMA model's): its arguments, output and the code after it are kept, so
        that a value it made reaches the replay traced (the latest _FROZEN_KEPT only)."""
        call = ModelCall(module, module, args, kwargs, rng=rng_states())
        call.trains = False
        self._frozen = [*self._frozen[1 - _FROZEN_KEPT:], call]
        return call

    def evaluation_call(self, module: torch.nn.Module, args: tuple,
                        kwargs: dict) -> ModelCall:
        """A call of a trained module made without autograd between steps (an evaluation, the
        sampling of minGPT's or makemore's `generate`): the latest only, with the code after
        it, never part of a step's replay."""
        call = ModelCall(module, module, args, kwargs, rng=rng_states())
        call.trains = False
        self.evaluated = call
        return call

    def begin_code(self) -> ModelCall:
        """A step's start, before any model call: its code is the window (`code_window`),
        with the RNG states as it began (and no buffers: no module is called)."""
        rng = rng_states()
        self._rng, self._buffers = rng, []
        self.code_window = ModelCall.code_only(rng)
        return self.code_window

    @property
    def skipped(self) -> bool:
        """A micro-batch of the window (or the step's code, when it called no module)
        computed a loss and skipped its backward."""
        window = self.code_window
        return any(call.skipped for call in self.calls) or (window is not None
                                                             and window.skipped)

    @property
    def last(self) -> ModelCall | None:
        return self.calls[-1] if self.calls else None

    def close(self) -> None:
        """The window was checked (or skipped): drop its references."""
        self.calls = []
        self.code_window = self.evaluated = None
        self._frozen = []

    def restore_buffers(self) -> None:
        """The buffers as they were before the window's forwards."""
        for copy in self._buffers:
            copy.restore()

    @contextlib.contextmanager
    def replaying(self, params: list[torch.Tensor],
                  evaluation: bool = False) -> Iterator[frozenset]:
        """The window's start for a replay (RNG streams, buffers, `params` without gradients);
        afterwards the state the trip left, gradients included. `evaluation`: a replay of
        `evaluated` alone, which seeds its own RNG streams and reads the buffers as they are
        (the training window's start is before the update the evaluation came after). Yields
        the storages it puts back (the buffers'), which the replay may write."""
        assert evaluation or self._rng is not None, "a window with a call"
        now_rng = rng_states()
        buffers = list(self._buffers)
        now_buffers = [[b.detach().clone() for b in c.tensors] for c in buffers]
        grads = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            if not evaluation:
                assert self._rng is not None
                _set_rng_states(self._rng)
                self.restore_buffers()
            yield frozenset(storage_key(t) for copy in buffers for t in copy.tensors)
        finally:
            for p, g in zip(params, grads):
                p.grad = g
            for copy, values in zip(buffers, now_buffers):
                copy.put(values)
            _set_rng_states(now_rng)
