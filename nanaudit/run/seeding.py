"""Seeding every global RNG a training step may draw from, once before a run (`scan`, `bisect`,
`nanaudit run`): one routine, so that a seed the config or command line accepts never raises
inside the seeding and means the same thing everywhere. Imported without torch (the CLI's
start-up stays light); torch and NumPy are imported when it runs.
"""

from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, torch (CPU and every CUDA device) and NumPy's global RNG.

    Any int is taken: torch keeps seeds modulo 2**64 (it maps -1 to 2**64 - 1 itself) and
    NumPy's legacy seeding takes 0..2**32 - 1 only, so each gets the seed modulo its range;
    Python's `random` takes any int as it is."""
    import torch
    random.seed(seed)
    torch.manual_seed(seed % 2**64)    # seeds every CUDA device too
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % 2**32)
