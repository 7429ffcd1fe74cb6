"""The process exit codes: one meaning each, documented in the README and `--help`."""

from enum import IntEnum


class ExitCode(IntEnum):
    CLEAN = 0            # every audited step was finite
    NONFINITE = 1        # a non-finite value was found (the finding is in the report)
    USAGE = 2            # bad command-line usage
    CONFIG = 3           # the config file or an entrypoint it names is wrong
    USER_CODE = 4        # the user's code (model, data, loss, optimizer) raised
    NOTHING_AUDITED = 5  # the data yielded no batches
    INTERNAL = 6         # nanaudit itself failed: a bug, please report it
    WARNING = 7          # --fail-on warning: no non-finite value, but an early warning fired
    DISTRIBUTED = 8      # under torchrun: a peer rank failed or timed out without a report
    INTERRUPTED = 130    # Ctrl-C: the partial report is still valid


EXIT_CODE_HELP = """\b
Exit codes:
  0    clean: every audited step was finite
  1    a non-finite value was found
  2    usage error
  3    config error (file, key, entrypoint, checkpoint, device)
  4    the user's code raised an exception
  5    nothing was audited (the data yielded no batches)
  6    internal error in nanaudit
  7    an early warning fired and --fail-on is `warning` (values stayed finite)
  8    torchrun: a peer rank died or timed out (the process group could not go on)
  130  interrupted (the partial report is valid)"""
