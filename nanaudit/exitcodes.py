"""The process exit codes: one meaning each. `--help` and the README table are generated from
(and tested against) this enum, so the three texts cannot drift (pytest documents its own
`ExitCode` the same way)."""

from enum import IntEnum


class ExitCode(IntEnum):
    """Each member's `doc` says when the process exits with it."""

    doc: str

    def __new__(cls, value: int, doc: str = "") -> "ExitCode":
        member = int.__new__(cls, value)
        member._value_ = value
        member.doc = doc
        return member

    CLEAN = 0, "clean: every audited step was finite"
    NONFINITE = 1, "a non-finite value was found (the finding is in the report)"
    USAGE = 2, "usage error (a command-line option, a missing optional package)"
    CONFIG = 3, "config error (file, key, entrypoint, checkpoint, device)"
    USER_CODE = 4, "the user's code raised an exception (its frames are shown)"
    NOTHING_AUDITED = 5, "nothing was audited (the data yielded no batches)"
    INTERNAL = 6, "internal error: a bug in nanaudit, please report it"
    WARNING = 7, "an early warning fired and --fail-on is `warning` (values stayed finite)"
    DISTRIBUTED = 8, "torchrun: a peer rank died or timed out (the process group could not go on)"
    OUTPUT = 9, ("a requested output (report, plot, repro bundle, skip list) could not be "
                 "written, whatever the scan found")
    INTERRUPTED = 130, "interrupted by Ctrl-C (SIGINT): the partial report is valid"
    TERMINATED = 143, ("stopped by SIGTERM or SIGHUP (CI timeout, Kubernetes, `timeout`, a "
                       "closed terminal): the partial report is valid")


STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
"""The signals that stop a run with a partial report (by name: no import of `signal` here)."""


def stopped_by(signal_name: str) -> ExitCode:
    """The exit code of a run stopped by one of STOP_SIGNALS: Ctrl-C is 130, the others 143."""
    return ExitCode.INTERRUPTED if signal_name == "SIGINT" else ExitCode.TERMINATED


def exit_code_help() -> str:
    """The `Exit codes:` epilog of every command's --help (its first line stops click rewrapping
    the list)."""
    lines = ["\b", "Exit codes:"]
    lines += [f"  {code.value:<4} {code.doc}" for code in ExitCode]
    return "\n".join(lines)


EXIT_CODE_HELP = exit_code_help()
