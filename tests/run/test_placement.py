"""Where each torchrun rank runs, for any number of GPUs: NCCL only with a GPU per local rank."""

import pytest
import torch

from nanaudit.errors import ConfigError
from nanaudit.run.distributed import choose_placement


@pytest.mark.parametrize("gpus, local_world, backend, device, note", [
    (0, 2, "gloo", ["cpu", "cpu"], False),
    (1, 2, "gloo", ["cpu", "cpu"], True),          # two ranks on one GPU never finish joining
    (2, 2, "nccl", ["cuda:0", "cuda:1"], False),
    (8, 2, "nccl", ["cuda:0", "cuda:1"], False),
    (3, 4, "gloo", ["cpu"] * 4, True)])            # every local rank decides alike
def test_auto_on_any_gpu_count(gpus, local_world, backend, device, note):
    chosen = [choose_placement("auto", "auto", r, local_world, gpus) for r in range(local_world)]
    assert [c.backend for c in chosen] == [backend] * local_world
    assert [str(c.device) for c in chosen] == device
    assert all(bool(c.note) == note for c in chosen)
    if note:
        assert "no GPU of its own" in chosen[-1].note and "gloo" in chosen[-1].note


def test_cpu_pinned_is_gloo_on_the_cpu_whatever_the_gpus():
    for gpus in (0, 1, 4):
        chosen = choose_placement("auto", "cpu", 1, 2, gpus)
        assert (chosen.backend, chosen.device, chosen.note) == ("gloo", torch.device("cpu"), None)


@pytest.mark.parametrize("backend, device, key", [
    ("auto", "cuda", "device"), ("auto", "cuda:0", "device"), ("nccl", "auto", "distributed.backend")])
def test_cuda_asked_for_without_a_gpu_per_rank_is_a_config_error(backend, device, key):
    with pytest.raises(ConfigError) as caught:
        choose_placement(backend, device, 1, 2, 1)
    problem = caught.value.problems[0]
    assert problem.key == key and "local rank 1 of 2" in problem.message
    assert "1 visible" in problem.message


def test_nccl_on_the_cpu_is_a_config_error():
    with pytest.raises(ConfigError) as caught:
        choose_placement("nccl", "cpu", 0, 2, 2)
    assert caught.value.problems[0].key == "distributed.backend"


def test_explicit_cuda_with_a_gpu_per_rank():
    chosen = choose_placement("auto", "cuda", 1, 2, 2)
    assert (chosen.backend, str(chosen.device)) == ("nccl", "cuda:1")
    assert choose_placement("gloo", "cuda", 1, 2, 2).backend == "gloo"
