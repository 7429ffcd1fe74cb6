"""`nanaudit run`'s in-process replay under torchrun. DDP: the rank that made the value replays
its own step on its local module (the DDP wrapper's `.module`: no gradient all-reduce, no peer
waited on), so its gradients are its own, from before the reduction that mixed them into every
rank's. FSDP2, HSDP and tensor parallel (any device mesh, one dimension or two): every rank
replays the same step together, since each forward all-gathers the weights (or all-reduces TP's
partial sums) and each backward reduce-scatters the gradients with every peer; the step's own
reduce-scatter wrapper (run/sharded.PreReduceFlags) keeps each rank's own gradients before the
reduce-scatter as the values its walk starts from (tensor parallel alone: the gradients as the
step left them), and a walk that ends at a collective (TP's all-reduce of a peer's partial
sums, or of an input gradient) is a peer's value (localize/sharded_replay.made_here), as in
the re-run. Then every rank gets the finding through the rendezvous store, bounded by the
distributed timeout (a peer that died is a DistributedError, exit 8, never a hang).

When the step's flags named no rank (DDP's gradients are checked as reduced: each rank's own
are not flagged), every rank replays its own step, and the one whose replay traced the value to
its own op is the origin (`origin_entry`, the rule scan uses). The decision to fall back to the
re-run is taken from the gathered entries, so every rank takes it alike; when the ranks replay
together whether to replay at all is gathered first (one rank that cannot would leave its peers
in a collective).

DeepSpeed ZeRO-1 and ZeRO-2 keep every weight whole on every rank, as DDP does: the rank replays
its step on the engine's own module, and its backward computes the gradients with
`torch.autograd.grad` and sets them, so that no gradient is accumulated and DeepSpeed's hooks
(which run after each accumulation and reduce the gradient with every peer, into DeepSpeed's own
buckets) never run. ZeRO-3 is not replayed here (its forward gathers every rank's partition of
the weights, and its backward reduce-scatters into its partitions, through hooks of its own):
it keeps the re-run together."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from nanaudit.localize.sharded_replay import made_here, own_sink, traced_window
from nanaudit.localize.walk import Localization
from nanaudit.report.model import Finding
from nanaudit.report.sections import Rerun
from nanaudit.report.vocabulary import RerunStatus
from nanaudit.run.deepspeed_zero import is_engine
from nanaudit.run.rank_checks import RankChecks, gather_by_store, origin_entry

Replayed = tuple[Rerun | None, Finding | None]


def local_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a rank replays: DDP's wrapped module (its forward and backward alone, no
    collective), a DeepSpeed engine's own module, anything else as it is."""
    if isinstance(module, DistributedDataParallel) or is_engine(module):
        return cast(torch.nn.Module, module.module)
    return module


def local_call(module: torch.nn.Module, trains: bool) -> Callable[..., Any]:
    """What a replay calls for the script's call of `module`: its own call (forward and
    hooks) on `local_module`, except a LightningModule that DDP wraps: Lightning's strategies
    call it through DDP with its `forward` redirected, for that one call, to `training_step`
    (`validation_step` for a call without autograd), so that step is what is called again."""
    local: Any = local_module(module)
    if local is not module and _lightning_module(local):
        return local.training_step if trains else local.validation_step
    return local._call_impl


def local_backward(module: torch.nn.Module, func: Callable[..., Any]) -> Callable[..., Any]:
    """What a replay calls for the script's backward `func` (`Tensor.backward`,
    `torch.autograd.backward` or `torch.autograd.grad`) after a call of `module`: `func`
    itself, except `torch.autograd.grad`, whose gradients are set (_grads_set), and after a
    DeepSpeed engine's call, where the gradients of its module's parameters are computed by
    `torch.autograd.grad` and set: nothing is accumulated, so DeepSpeed's post-accumulation
    hooks, which reduce each gradient with every peer, do not run (see the module docstring)."""
    if func is _AUTOGRAD_GRAD:
        return _grads_set
    if not is_engine(module):
        return func

    def backward(*args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        # `Tensor.backward` by its signature: the one recorded may be a wrapper of it
        if "self" in given:
            outputs, seeds = [given["self"]], _listed(given["gradient"])
        else:
            outputs, seeds = _listed(given["tensors"]), _listed(given["grad_tensors"])
        leaves = [p for p in (_listed(given["inputs"]) or local_module(module).parameters())
                  if p.requires_grad]
        grads = torch.autograd.grad(outputs, leaves, seeds or None,
                                    retain_graph=given["retain_graph"],
                                    create_graph=given["create_graph"], allow_unused=True)
        for leaf, grad in zip(leaves, grads):
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    return backward


_AUTOGRAD_GRAD = torch.autograd.grad     # as torch has it (nanaudit's hooks wrap it later)


def _grads_set(*args: Any, **kwargs: Any) -> Any:
    """`torch.autograd.grad` as a replay calls it: the gradients it returns go into their
    leaves' `.grad`, as a script that takes its gradients so sets them (`p.grad = g`) before
    its step, where the check read them and the replay looks for the value (the replay puts
    the script's own gradients back afterwards)."""
    bound = inspect.signature(_AUTOGRAD_GRAD).bind(*args, **kwargs)
    inputs = bound.arguments["inputs"]
    leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)   # read once
    bound.arguments["inputs"] = leaves
    grads = _AUTOGRAD_GRAD(*bound.args, **bound.kwargs)
    for leaf, grad in zip(leaves, grads):
        if grad is not None and leaf.is_leaf:
            leaf.grad = grad if leaf.grad is None else leaf.grad + grad
    return grads


def _listed(value: Any) -> list:
    """A tensor, a sequence of them, or None, as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _lightning_module(module: torch.nn.Module) -> bool:
    classes = [getattr(sys.modules.get(name), "LightningModule", None)
               for name in ("lightning.pytorch", "pytorch_lightning")]
    return any(c is not None and isinstance(module, c) for c in classes)


def replayed_together(ranks: RankChecks | None) -> bool:
    """FSDP2, HSDP, tensor parallel: every rank replays the step at once (its forward
    gathers, or all-reduces partial sums, with its peers)."""
    return ranks is not None and (bool(ranks.fsdp) or ranks.mesh is not None)


def not_replayed_here(ranks: RankChecks) -> str | None:
    """Why the ranks' step is not replayed in-process (None: it is)."""
    if ranks.zero_stage == 3:
        return ("the in-process replay is not built for DeepSpeed ZeRO-3, whose forward gathers "
                "every rank's partition of the weights")
    return None


def replayed_on_ranks(ranks: RankChecks, origin: int | None, replay_here: Callable[[], Replayed],
                      refusal: Callable[[], str | None]) -> Replayed:
    """(the replay's record, the origin's finding) on every rank: replayed by `origin` (every
    rank when None, and always under FSDP2), gathered by all. `refusal()`: why this rank
    cannot replay its window (None: it can)."""
    why = not_replayed_here(ranks)
    together = replayed_together(ranks)
    if why is None and together:
        why = next((r for r in gather_by_store(ranks.coord, "replay-refusal", refusal()) if r),
                   None)
    if why is not None:
        return Rerun(status=RerunStatus.SKIPPED, note=why), None
    mine: Replayed = (_together(ranks, replay_here) if together else
                      _alone(ranks, replay_here) if origin in (None, ranks.rank) else
                      (None, None))
    if mine[1] is not None:
        mine[1].rank = ranks.rank
    entries = gather_by_store(ranks.coord, "in-process-replay", mine)
    found = [entry if entry[1] is not None else None for entry in entries]
    chosen = origin_entry(found, [entry is not None for entry in found], origin)
    if chosen is not None:
        return chosen
    # No rank's replay named the op: the origin's record says why (the re-run follows).
    record = entries[origin][0] if origin is not None else None
    return record or next((r for r, _f in entries if r is not None), None), None


def _together(ranks: RankChecks, replay_here: Callable[[], Replayed]) -> Replayed:
    """This rank's part of the FSDP2 replay every rank runs at once. The reduce-scatter
    wrapper keeps this rank's own gradients (and computes no flag: the next step's exchange
    sees none of the replay); afterwards every FSDP module is resharded as the trip left it
    (the replay's backward reshards; a forward replayed without backward would leave the
    root's weights gathered)."""
    try:
        with traced_window(ranks.flags, ranks.partials):
            return replay_here()
    finally:
        for module in ranks.fsdp:
            module.reshard()


def _alone(ranks: RankChecks, replay_here: Callable[[], Replayed]) -> Replayed:
    """This rank's replay of its own step. Under DeepSpeed the gradient hooks that flag its
    own gradients for the step's read see the replay's too: kept apart, not flagged."""
    with traced_window(ranks.flags, None):
        return replay_here()


def own_gradient(ranks: RankChecks | None, reduced: torch.Tensor) -> torch.Tensor | None:
    """The gradient a rank's replay walks back from: under FSDP2 the first non-finite input of
    its reduce-scatters, its own (None: its own were finite, the value came from a peer);
    elsewhere `reduced` (DDP's local module reduces nothing)."""
    if ranks is None or not ranks.fsdp:
        return reduced
    return own_sink(ranks.flags)


def made_on_this_rank(ranks: RankChecks | None, loc: Localization) -> bool:
    """Under FSDP2 a walk that ends at a collective's output is a peer's value; elsewhere every
    op a rank's replay traced is its own."""
    return not replayed_together(ranks) or made_here(loc)
