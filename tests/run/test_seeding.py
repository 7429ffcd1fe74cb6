"""One seeding routine for every command: any int seeds Python, torch and NumPy alike."""

import random

import numpy
import pytest
import torch

from nanaudit.run.seeding import seed_everything


def _draws():
    return random.random(), torch.rand(1).item(), numpy.random.rand()


@pytest.mark.parametrize("seed", [-1, 2**40, 2**64 - 1, -(2**63), 0, 7])
def test_any_int_seeds_every_rng_the_same_way_each_time(seed):
    seed_everything(seed)
    first = _draws()
    seed_everything(seed)
    assert _draws() == first
    # Each RNG gets the seed in its own range: torch modulo 2**64 (as torch.manual_seed maps
    # a negative seed itself), NumPy's legacy seeding modulo 2**32.
    assert torch.initial_seed() == seed % 2**64
    numpy.random.seed(seed % 2**32)
    random.seed(seed)
    torch.manual_seed(seed % 2**64)
    assert _draws() == first


def test_seeds_beyond_torchs_range_are_taken_too():
    seed_everything(2**70)          # `nanaudit run --seed` takes any int
    assert torch.initial_seed() == 2**70 % 2**64
