"""One seeding routine for every run: Python's `random`, torch (every device) and NumPy's
global generator, from any int the user gives (negative, or wider than a generator takes)."""

from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    """Seed Python, torch and (when installed) NumPy. NumPy takes 0 <= seed < 2**32 and torch a
    64-bit value, so each gets the seed reduced to its range: the same int always gives the
    same streams, and no seed the command line accepts makes seeding itself raise."""
    import torch
    random.seed(seed)
    torch.manual_seed(seed % 2**64)          # seeds every CUDA device too
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)
