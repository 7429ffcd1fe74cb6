"""The baseline the `nanaudit run` benchmarks divide by: a script run in this process as
`python script.py ARGS` runs it, seeded as `nanaudit run` seeds it (so both variants see the
same batches), with none of nanaudit's machinery. One copy, so every benchmark's "plain" is the
same thing."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from nanaudit.run.seeding import seed_everything


def run_plain(path: Path, argv: Sequence[str]) -> None:
    """Run `path` as `__main__` with `argv`; sys.argv is restored after."""
    saved = sys.argv[:]
    try:
        seed_everything(0)
        sys.argv = [str(path), *argv]
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
