"""How a rank of `scan` under torchrun spreads the model and the data: DDP or FSDP2 around the
model, its own shard of the data, and the flag of its own gradients before the ranks' are mixed.

"Bad own gradients" is measured by a DDP communication hook on each bucket *before* the
all-reduce averages the ranks' gradients together (FSDP2: before the reduce-scatter,
sharded.PreReduceFlags); after it, every rank's gradients hold the NaN and the rank that made
it can no longer be told. The flag joins the rank's row of the step's one exchange
(check/rank_row.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from nanaudit.config.schema import DistributedOptions
from nanaudit.run.mesh import PartialFlags, tensor_parallel
from nanaudit.run.sharded import PreReduceFlags, fsdp_modules, shard_model


class Parallelism:
    """One rank's model and data parallelism, and its own gradients' flag."""

    def __init__(self, options: DistributedOptions, rank: int, world_size: int):
        self.options, self.rank, self.world_size = options, rank, world_size
        self.local_grad_bad: torch.Tensor | None = None   # DDP: set by the comm hook
        self.pre_reduce: PreReduceFlags | None = None     # FSDP2: the reduce-scatters' flags
        self.partials: PartialFlags | None = None         # TP: the partial sums' (mesh.py)

    @property
    def sharded(self) -> bool:
        """FSDP2: each rank holds its own shard of the weights (sharded.py)."""
        return self.pre_reduce is not None

    def wrap(self, model: torch.nn.Module, device: torch.device,
             parallelize: Callable[..., Any] | None = None) -> torch.nn.Module:
        """DDP around the model; or FSDP2: the model the factory sharded itself, or sharded
        here (`distributed.fsdp`, `mesh`, `tp` with the user's `parallelize` plan), its
        reduce-scatters flagged."""
        options = self.options
        if (options.fsdp or options.mesh or options.tp > 1) and not fsdp_modules(model):
            shard_model(model, device, self.world_size, options.fsdp_param_dtype,
                        options.mesh, options.tp, parallelize)
        if tensor_parallel(model):
            self.partials = PartialFlags()
            self.partials.install(model)
        modules = fsdp_modules(model)
        if modules:
            self.pre_reduce = PreReduceFlags()
            self.pre_reduce.install(modules)
            return model
        if not self.options.ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids,
                                      find_unused_parameters=self.options.find_unused_parameters)
        self.local_grad_bad = torch.zeros((), dtype=torch.float64, device=device)
        ddp.register_comm_hook(self, _flag_then_allreduce)
        return ddp

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel group: the `tp` ranks of a group (the mesh's last,
        innermost dimension) see the same batches, as tensor parallelism needs."""
        return self.rank // self.options.tp

    @property
    def data_world(self) -> int:
        return self.world_size // self.options.tp

    def shard(self, data: Any, sharded_by_user: bool) -> Any:
        """This rank's group's part of the data: the user's own shard, a DistributedSampler
        for a DataLoader, or every data_world-th batch of any other iterable."""
        if sharded_by_user:
            return data
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        if isinstance(data, DataLoader) and data.batch_size is not None:
            sampler: DistributedSampler[Any] = DistributedSampler(
                data.dataset, num_replicas=self.data_world, rank=self.data_rank, shuffle=False,
                drop_last=data.drop_last)
            return DataLoader(data.dataset, batch_size=data.batch_size, sampler=sampler,
                              collate_fn=data.collate_fn, num_workers=data.num_workers,
                              drop_last=data.drop_last, pin_memory=data.pin_memory)
        return itertools.islice(data, self.data_rank, None, self.data_world)

    def own_gradient_flag(self, grad_norm: Callable[[], torch.Tensor]) -> torch.Tensor:
        """1.0 when this rank's own gradients (before averaging) held a non-finite value
        (under TP, above 1.0 when a partial input gradient did, mesh.PartialFlags);
        `grad_norm` gives the gradients' norm on the device when there is no DDP hook."""
        flag = self._reduction_flag(grad_norm)
        return self.partials.take_gradients(flag) if self.partials is not None else flag

    def partial_flag(self, device: torch.device) -> torch.Tensor | None:
        """TP: how early this step's first bad partial output came (None: no TP)."""
        return self.partials.take(device) if self.partials is not None else None

    def _reduction_flag(self, grad_norm: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.pre_reduce is not None:      # FSDP2: before the reduce-scatter
            return self.pre_reduce.take(grad_norm().device)
        if self.local_grad_bad is None:      # no DDP: the gradients are the local ones
            return (~torch.isfinite(grad_norm())).to(torch.float64)
        flag, self.local_grad_bad = self.local_grad_bad, torch.zeros_like(self.local_grad_bad)
        return flag


# Unannotated: DDP's register_comm_hook rejects a hook whose `bucket` or return annotation is
# not its own type, and this module's annotations are strings.
def _flag_then_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: note whether this rank's bucket is finite, then average as usual."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    buffer = bucket.buffer()
    bad = (~torch.isfinite(buffer)).any().to(torch.float64)
    flag = state.local_grad_bad
    if flag is not None:                 # `wrap` sets it before registering this hook
        state.local_grad_bad = torch.maximum(flag, bad.to(flag.device))
    # None is the default process group, as the hook's body handles; its stub says otherwise.
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]
