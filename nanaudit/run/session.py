"""Build the run from a config: device, seed, the user's model, optimizer, loss and data
(sharded under torchrun), gathered in the `Session` every step reads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from nanaudit.config.entrypoints import class_target, resolve_callable
from nanaudit.config.schema import Config, Entrypoint
from nanaudit.config.validate import device_problem, optimizer_class_problems, data_accepts
from nanaudit.errors import ConfigError, Problem, call_user
from nanaudit.run.checkpoint import apply_model_state, load_checkpoint


def resolve_device(device: str):
    import torch
    problem = device_problem(device)
    if problem:
        raise ConfigError([problem])
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass
class Session:
    """Everything a step needs, built from the config. `make_data` starts the data afresh."""

    config: Config
    device: Any
    model: Any
    optimizer: Any
    loss_fn: Callable
    make_data: Callable[[], Iterable]
    param_names: dict          # id(parameter) -> qualified name
    precision: Any = None      # nanaudit.run.precision.Precision; built from the config if None
    coordinator: Any = None    # nanaudit.run.distributed.Coordinator under torchrun

    def __post_init__(self):
        if self.precision is None:
            from nanaudit.run.precision import Precision
            self.precision = Precision(self.config, self.device)

    @property
    def local_model(self):
        """The user's module itself, without a DistributedDataParallel wrapper."""
        return getattr(self.model, "module", self.model) if self.coordinator else self.model

    def compute_loss(self, batch):
        return self.loss_fn(self.model, batch, **dict(self.config.loss.args))

    @classmethod
    def for_loop(cls, model, optimizer, loss_fn: Callable, device, batches: Iterable = (),
                 label: str = "<your loop>", precision: Any = None, **options) -> "Session":
        """A session over objects a loop already holds (`Sentinel`, the benchmark): no YAML and
        no entrypoints. The config it carries only describes them (`label` stands where an
        entrypoint would) and takes the config's other keys (`watch=`, `grad_clip=`...)."""
        import torch
        from pathlib import Path
        entry = Entrypoint(f"{label}:loss_fn", label)
        config = Config(path=Path(label), model=entry, data=entry, loss=entry, **options)
        names = {id(p): n for n, p in model.named_parameters()}
        return cls(config, torch.device(device), model, optimizer, loss_fn,
                   lambda: batches, names, precision=precision)


def seed_everything(seed: int) -> None:
    import torch
    random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    try:
        import numpy
        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def build_session(config: Config, coordinator=None) -> Session:
    """Build model, optimizer, loss and data from the config; call within user_import_path.
    Under torchrun (`coordinator`), the model is wrapped in DDP and the data sharded."""
    import torch
    device = resolve_device(config.device)
    if coordinator is not None:
        device = coordinator.device(device)
    if config.seed is not None:
        seed_everything(config.seed)
    model_fn = resolve_callable(config.model, config.base_dir)
    model = call_user(f"model factory `{config.model.target}`", model_fn, **dict(config.model.args))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError([Problem(config.model.key, f"`{config.model.target}` returned a "
                                   f"{type(model).__name__}, not a torch.nn.Module")])
    checkpoint = load_checkpoint(config.checkpoint) if config.checkpoint else None
    if checkpoint is not None:
        apply_model_state(model, checkpoint, "checkpoint", str(config.checkpoint))
    model.to(device)
    model.train()
    optimizer = build_optimizer(config, model)
    wrapped = coordinator.wrap(model, device) if coordinator is not None else model
    if checkpoint is not None and optimizer is not None and "optimizer" in checkpoint.raw:
        call_user("loading the checkpoint's optimizer state", optimizer.load_state_dict,
                  checkpoint.raw["optimizer"])
    data_fn = resolve_callable(config.data, config.base_dir)
    loss_fn = resolve_callable(config.loss, config.base_dir)
    names = {id(p): n for n, p in model.named_parameters()}

    shards_itself = (coordinator is not None and data_accepts(data_fn, "rank")
                     and data_accepts(data_fn, "world_size"))

    def make_data():
        what = f"data factory `{config.data.target}`"
        kwargs = dict(config.data.args)
        if shards_itself:
            kwargs.update(rank=coordinator.rank, world_size=coordinator.world_size)
        data = call_user(what, data_fn, **kwargs)
        if not _is_iterable(data):
            raise ConfigError([Problem(config.data.key, f"`{config.data.target}` returned a "
                                       f"{type(data).__name__}, which is not iterable; return a "
                                       f"list, generator or DataLoader of batches")])
        if coordinator is not None:
            data = coordinator.shard(data, shards_itself)
        return data

    return Session(config, device, wrapped, optimizer, loss_fn, make_data, names,
                   coordinator=coordinator)


def _is_iterable(obj) -> bool:
    import torch
    if isinstance(obj, (str, bytes, torch.Tensor)):
        return False
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def build_optimizer(config: Config, model):
    import torch
    spec = config.optimizer
    if spec is None:
        return None
    if spec.factory:
        fn = resolve_callable(spec.factory, config.base_dir)
        opt = call_user(f"optimizer factory `{spec.factory.target}`", fn, model,
                        **dict(spec.factory.args))
        where, target = spec.factory.key, spec.factory.target
    else:
        cls = resolve_callable(Entrypoint(class_target(spec.class_path), "optimizer.class"),
                               config.base_dir)
        problems = optimizer_class_problems(cls, spec)
        if problems:
            raise ConfigError(problems, source=str(config.path))
        opt = call_user(f"optimizer `{spec.class_path}`", cls, model.parameters(),
                        **dict(spec.kwargs))
        where, target = "optimizer.class", spec.class_path
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError([Problem(where, f"`{target}` gave a {type(opt).__name__}, "
                                   f"not a torch.optim.Optimizer")])
    return opt
