"""`distributed.mesh` (HSDP's 2-D mesh, issue 37): each problem named by its key path."""

from nanaudit.config.sections import distributed, mesh_dims
from nanaudit.errors import Problem


def test_hsdp_mesh_is_read_in_its_dimensions_order():
    problems: list[Problem] = []
    options = distributed({"mesh": {"dp_shard": 2, "dp_replicate": 3}}, problems)
    assert problems == [] and list(options.mesh.items()) == [("dp_replicate", 3), ("dp_shard", 2)]
    assert distributed({}, problems).mesh is None and problems == []


def test_bad_mesh_entries_are_named_by_their_key_path():
    problems: list[Problem] = []
    assert mesh_dims({"dp_replicate": 0, "dp_shard": 2, "tp": 2}, problems) is None
    keys = sorted(p.key for p in problems)
    assert keys == ["distributed.mesh.dp_replicate", "distributed.mesh.tp"], problems
    problems = []
    assert mesh_dims({"dp_shard": 4}, problems) is None
    assert [(p.key, "missing dp_replicate" in p.message) for p in problems] == [
        ("distributed.mesh", True)]
    problems = []
    assert mesh_dims([2, 2], problems) is None and problems[0].key == "distributed.mesh"


def test_a_mesh_that_does_not_cover_the_world_is_a_config_error():
    import pytest
    import torch
    from torch import nn

    from nanaudit.errors import ConfigError
    from nanaudit.run.sharded import shard_model
    with pytest.raises(ConfigError) as caught:
        shard_model(nn.Linear(2, 2), torch.device("cpu"), 2, "fp32",
                    {"dp_replicate": 2, "dp_shard": 2})
    assert caught.value.problems[0].key == "distributed.mesh"
    assert "4 ranks, but torchrun started 2" in caught.value.problems[0].message
