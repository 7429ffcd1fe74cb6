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


def test_tensor_parallel_needs_a_plan_and_reads_it():
    problems: list[Problem] = []
    options = distributed({"mesh": {"dp_replicate": 1, "dp_shard": 2}, "tp": 2,
                           "parallelize": "plans:tp_plan"}, problems)
    assert problems == [] and (options.tp, options.parallelize) == (2, "plans:tp_plan")
    assert distributed({}, problems).tp == 1 and problems == []
    distributed({"tp": 2}, problems)
    assert [p.key for p in problems] == ["distributed.parallelize"]
    assert "fn(model, tp_mesh)" in problems[0].message
    problems = []
    distributed({"tp": 0, "parallelize": 3}, problems)
    assert sorted(p.key for p in problems) == ["distributed.parallelize", "distributed.tp"]


def test_a_tp_mesh_that_does_not_cover_the_world_names_tp_and_the_numbers():
    from nanaudit.config.sections import mesh_world_problems
    hsdp = {"dp_replicate": 1, "dp_shard": 2}
    assert mesh_world_problems(hsdp, 2, 4) == [] and mesh_world_problems(None, 2, 4) == []
    (problem,) = mesh_world_problems(hsdp, 2, 8)
    assert problem.key == "distributed.tp"
    assert problem.message == ("dp_replicate 1 x dp_shard 2 x tp 2 is 4 ranks, "
                               "but torchrun started 8")
    (alone,) = mesh_world_problems(None, 3, 4)
    assert alone.key == "distributed.tp" and "tp 3 does not divide the 4 ranks" in alone.message
    (plain,) = mesh_world_problems(hsdp, 1, 4)
    assert plain.key == "distributed.mesh" and "2 ranks, but torchrun started 4" in plain.message


def test_scan_refuses_a_tp_mesh_larger_than_the_world_with_exit_3(tmp_path):
    """Validation before any rank is launched: the config error and its documented exit code."""
    import pytest
    import torch
    from torch import nn

    from nanaudit.errors import ConfigError
    from nanaudit.run.sharded import shard_model
    with pytest.raises(ConfigError) as caught:
        shard_model(nn.Linear(2, 2), torch.device("cpu"), 2, "fp32",
                    {"dp_replicate": 1, "dp_shard": 2}, tp=2, parallelize=lambda m, mesh: None)
    assert [p.key for p in caught.value.problems] == ["distributed.tp"]
    assert caught.value.exit_code == 3


def test_validate_resolves_the_tp_plan_and_binds_it_as_fn_model_tp_mesh(case):
    from helpers import LINEAR_CASE, run_cli
    good = case(LINEAR_CASE + "\ndef plan(model, tp_mesh):\n    pass\n",
                distributed={"tp": 2, "parallelize": "case:plan"})
    assert run_cli("validate", good).code == 0
    bad = case(LINEAR_CASE + "\ndef plan(model):\n    pass\n",
               distributed={"tp": 2, "parallelize": "case:plan"})
    result = run_cli("validate", bad)
    assert result.code == 3 and "distributed.parallelize" in result.stdout + result.stderr
    missing = case(LINEAR_CASE, distributed={"tp": 2, "parallelize": "case:no_such_plan"})
    result = run_cli("validate", missing)
    assert result.code == 3 and "no_such_plan" in result.stdout + result.stderr
