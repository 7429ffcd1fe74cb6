"""Typed errors for the user: each carries what went wrong and where, never a traceback of ours."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import CodeType
from typing import Any, TypeVar

from nanaudit.exitcodes import ExitCode
from nanaudit.report.sections import (
    ConfigFailure,
    ConfigProblem,
    ErrorInfo,
    NanauditFailure,
    UserCodeFailure,
    UserFrame,
)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the config: the key path it is at and what is wrong."""

    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}" if self.key else self.message


class NanauditError(Exception):
    """Base of every error nanaudit reports to the user without a traceback."""

    exit_code = ExitCode.INTERNAL

    def to_error_info(self) -> ErrorInfo:
        """The report's `error` for this error."""
        return NanauditFailure(type=type(self).__name__, message=str(self),
                               exit_code=self.exit_code)


class UsageError(NanauditError):
    exit_code = ExitCode.USAGE


class ConfigError(NanauditError):
    """The config is wrong; lists every problem found, each with its key path."""

    exit_code = ExitCode.CONFIG

    def __init__(self, problems: Sequence[Problem] | str, source: str | None = None):
        if isinstance(problems, str):
            problems = [Problem("", problems)]
        self.problems = list(problems)
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = f" in {self.source}" if self.source else ""
        if len(self.problems) == 1:
            return f"config error{where}: {self.problems[0]}"
        lines = [f"{len(self.problems)} config errors{where}:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)

    def to_error_info(self) -> ConfigFailure:
        return ConfigFailure(message=str(self), source=self.source,
                             problems=[ConfigProblem(p.key, p.message) for p in self.problems],
                             exit_code=self.exit_code)


class NothingAuditedError(NanauditError):
    exit_code = ExitCode.NOTHING_AUDITED


class FindingInterrupted(KeyboardInterrupt):
    """A signal arrived while a finding was being completed (its sample search): the finding
    so far travels with the interruption, so the partial report still names the op."""

    def __init__(self, finding: Any) -> None:
        super().__init__("interrupted during the sample search")
        self.finding = finding


_DEMO_DIR = os.path.join(_PACKAGE_DIR, "demo") + os.sep


def a_kind_of(value: object) -> str:
    """What a user's code gave, for a message: "an int", "a dict"."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def is_own_file(filename: str) -> bool:
    """Is this file nanaudit's own code? The bundled demo counts as the user's: it plays one.
    The one test of "user code or ours", for tracebacks and for the op tracer's source lines."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) and not path.startswith(_DEMO_DIR)


# nanaudit's functions that pass a call of the user's on (a patched `optimizer.step`, the mode
# that records the loss code): the frame an error of that call, or of its arguments, is raised
# in may be theirs. Marked with `delegates`; read by `raised_by_nanaudit`.
_DELEGATES: set[CodeType] = set()

_Callable = TypeVar("_Callable", bound=Callable[..., Any])


def delegates(fn: _Callable) -> _Callable:
    """Mark `fn` as passing a call of the user's on: an exception raised in its own frame (a C
    function it calls for them refusing their arguments, or their arguments not fitting) is
    still the user's."""
    _DELEGATES.add(fn.__code__)
    return fn


def raised_by_nanaudit(exc: BaseException) -> bool:
    """Was `exc` raised in nanaudit's own code (a hook the script's call ran), not in the user's
    nor by a call nanaudit passed on for them? Then it is a bug of ours, which must not be
    reported as the script's error (exit 4, "fix your code"). The frame it was raised in
    decides: one of nanaudit's files and not a delegate, nor the API a script calls itself
    (`Sentinel` raising NonFiniteError, a callback refusing its arguments: its errors are the
    script's to handle). An error raised deeper, in torch's Python code called from a hook of
    ours, still counts as the user's: there nanaudit's part cannot be told from a call it
    passed on."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    path = os.path.abspath(code.co_filename)
    return is_own_file(path) and not path.startswith(_PUBLIC_API) and path != _PACKAGE_INIT \
        and code not in _DELEGATES


# What a script calls of nanaudit itself: the integrations, and the package's lazy names.
_PUBLIC_API = os.path.join(_PACKAGE_DIR, "integrations") + os.sep
_PACKAGE_INIT = os.path.join(_PACKAGE_DIR, "__init__.py")


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the exception's traceback that are not nanaudit's own, nor torch's
    dispatch into a mode of ours: a torch function called while nanaudit's TorchFunctionMode
    records the loss code goes through `handle_torch_function` (torch/overrides.py) and the
    `return handle_torch_function(...)` line that called it, frames a plain `python` run of
    the script never has."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [is_own_file(f.filename) for f in frames]
    dispatch: set[int] = set()
    for i, frame in enumerate(frames[:-1]):
        if own[i + 1] and not own[i] and _dispatches(frame):
            dispatch.add(i)
            if i and "handle_torch_function" in (frames[i - 1].line or ""):
                dispatch.add(i - 1)
    return [f for i, f in enumerate(frames) if not own[i] and i not in dispatch]


_OVERRIDES = os.path.join("torch", "overrides.py")


def _dispatches(frame: traceback.FrameSummary) -> bool:
    """Is this torch's frame handing a call to a TorchFunctionMode (the next frame's)?"""
    return frame.name == "handle_torch_function" and frame.filename.endswith(_OVERRIDES)


@dataclass
class UserCodeError(NanauditError):
    """The user's code raised: we show their exception and their frames, not ours."""

    what: str
    exception: BaseException
    frames: list = field(default_factory=list)

    exit_code = ExitCode.USER_CODE

    def __post_init__(self) -> None:
        self.frames = user_frames(self.exception)
        Exception.__init__(self, str(self))

    def __str__(self) -> str:
        # The first line only: a dispatcher error lists every backend in 300 lines.
        first = (str(self.exception).strip().splitlines() or [""])[0][:500]
        return f"{self.what} raised {type(self.exception).__name__}: {first}"

    def formatted_traceback(self) -> str:
        lines = ["Traceback (user code, nanaudit frames removed):\n"]
        lines += traceback.format_list(self.frames)
        lines += traceback.format_exception_only(type(self.exception), self.exception)
        return "".join(lines)

    def to_error_info(self) -> UserCodeFailure:
        return UserCodeFailure(message=str(self), what=self.what,
                               exception=type(self.exception).__name__,
                               frames=[UserFrame(f.filename, f.lineno, f.name, f.line)
                                       for f in self.frames], exit_code=self.exit_code,
                               hint=known_failure_hint(self.exception))


# Failures of training code that are not a non-finite value but come from the data's shape,
# and what to do: (the exception's class, a phrase of its message, the hint).
KNOWN_FAILURES = (
    ("ValueError", "Expected more than 1 value per channel when training",
     "a training batch of one sample reached a BatchNorm layer, which needs more than one "
     "value per channel: drop the data's last incomplete batch (`DataLoader(..., "
     "drop_last=True)`), or pick a batch size that leaves no batch of one"),
)


def known_failure_hint(exc: BaseException) -> str | None:
    """The hint for a failure KNOWN_FAILURES lists, else None."""
    name, text = type(exc).__name__, str(exc)
    return next((hint for kind, phrase, hint in KNOWN_FAILURES
                 if kind == name and phrase in text), None)


USER_FAILURES = (Exception, SystemExit, GeneratorExit)
"""What the user's code raises as its own failure: any Exception, and the two BaseExceptions it
raises on its own account: `sys.exit` (argparse, a factory parsing its argv, a library that
exits) and GeneratorExit. Neither is nanaudit's (commands return, only the CLI exits), so
either is the user's error, exit 4, with every report written; KeyboardInterrupt is a stop."""


def own_error_within(exc: BaseException) -> NanauditError | None:
    """Our own error (a refusal a hook raised inside the user's code) that a library wrapped on
    its way out, if `exc` holds one: torch's pipeline stage re-raises whatever its forward
    raised as `RuntimeError("[Stage 0] failed to run forward")` from it (torch 2.11), and the
    refusal must still be ours (its exit code, its message), not the user's error."""
    seen: set[int] = set()
    inner: BaseException | None = exc
    while inner is not None and id(inner) not in seen:
        if isinstance(inner, NanauditError):
            return inner
        seen.add(id(inner))
        inner = inner.__cause__ or inner.__context__
    return None


@delegates
def call_user(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call user code; any exception it raises becomes a UserCodeError naming `what` (one a
    hook of ours raised is ours: raised as it is, a bug to report)."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, NanauditError):
        raise
    except USER_FAILURES as exc:
        if raised_by_nanaudit(exc):
            raise
        raise (own_error_within(exc) or UserCodeError(what, exc)) from exc
