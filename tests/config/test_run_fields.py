"""`RunOptions` and `Config` share one definition of their common run-time fields: the same
type, the same default (RunOptions'), and `run_options` copies each of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from nanaudit.config.schema import RUN_FIELDS, Config, Entrypoint, RunOptions
from nanaudit.run.names import without_data_parallel


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_every_common_field_is_shared_with_the_same_type_and_default():
    config, run = _fields(Config), _fields(RunOptions)
    assert set(RUN_FIELDS) == set(config) & set(run)
    for name in RUN_FIELDS:
        assert config[name].type == run[name].type, name
        assert config[name].default == run[name].default, name
        assert config[name].default_factory == run[name].default_factory, name


def test_run_options_copies_every_shared_field():
    entry = Entrypoint(target="m:f", key="loss")
    config = Config(path=Path("c.yaml"), model=entry, data=entry, loss=entry, grad_clip=2.5,
                    precision="bf16", accumulate=3, sentinel_read="sync",
                    batch_dim={"*": 1}, checkpoint=Path("w.pt"))
    options = config.run_options()
    assert {n: getattr(options, n) for n in RUN_FIELDS} == \
        {n: getattr(config, n) for n in RUN_FIELDS}


class _Holder(torch.nn.Module):
    """A user's model with its own child called `module` (no wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)
        self.head = torch.nn.Linear(2, 1)


def test_only_a_data_parallel_wrapper_is_unwrapped():
    model = _Holder()
    assert without_data_parallel(model) is model
    assert without_data_parallel(torch.nn.DataParallel(model)) is model


def test_a_sessions_local_model_keeps_a_users_child_called_module():
    # Under torchrun (a coordinator) with a model no DDP wrapper holds (FSDP2 shards it in
    # place): its own `module` child is not the model.
    from nanaudit.run.session import Session
    model = _Holder()
    session = Session(options=RunOptions(), device=torch.device("cpu"), model=model,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      loss_fn=lambda m, b: m.head(b).sum(), make_data=list, param_names={},
                      coordinator=object())
    assert session.local_model is model
