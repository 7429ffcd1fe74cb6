"""Domain rules of the losses that can be undefined for a whole batch: an NLL loss whose every
target is ignored (or weighted 0) averages over nothing, and a CTC target that cannot fit its
input length makes the loss inf."""

from __future__ import annotations

from typing import Any

import torch

from nanaudit.localize.rules.registry import Reason, count, domain_rule
from nanaudit.report.vocabulary import Cause


@domain_rule("nll_loss_forward", "nll_loss2d_forward")
def nll_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    target = args[1].detach()
    ignore_index = args[4] if len(args) > 4 else -100
    weight = args[2] if len(args) > 2 else None
    valid = target != ignore_index
    if target.numel() == 0:
        # An empty selection (`output[mask]` with an empty index or mask), not ignored targets.
        return Reason(Cause.DEGENERATE_REDUCTION, f"the loss got no targets at all (input of "
                                                  f"shape {list(args[0].shape)}: an empty batch "
                                                  f"or selection): the mean over zero targets "
                                                  f"is 0/0 = NaN",
                      fix="skip an empty batch or selection (`if target.numel():`), or divide "
                          "`reduction='sum'` by `max(number of targets, 1)`")
    if count(valid) == 0:
        return Reason(Cause.DEGENERATE_REDUCTION, f"every one of the {target.numel()} target(s) "
                                                  f"equals ignore_index={ignore_index}: the mean "
                                                  f"over zero targets is 0/0 = NaN",
                      fix=f"skip a batch with no target to train on (`if (labels != "
                          f"{ignore_index}).any():`), or divide `reduction='sum'` by "
                          f"`max(number of valid targets, 1)`")
    if isinstance(weight, torch.Tensor) and float(weight[target[valid]].sum()) == 0:
        return Reason(Cause.DEGENERATE_REDUCTION, "the class weights of every valid target are "
                                                  "0: 0/0",
                      fix="skip a batch whose targets all have weight 0, or divide "
                          "`reduction='sum'` by `max(sum of their weights, eps)`")
    return None


@domain_rule("_ctc_loss", "ctc_loss")
def ctc_rule(base: str, args: tuple, kwargs: dict, phase: str) -> Any:
    targets, in_lens, tgt_lens = args[1], args[2], args[3]
    in_lens = torch.as_tensor(in_lens).tolist()
    tgt_lens = torch.as_tensor(tgt_lens).tolist()
    targets = targets.detach().cpu()
    bad = []
    offset = 0
    for b, (il, tl) in enumerate(zip(in_lens, tgt_lens)):
        row = targets[b, :tl] if targets.dim() == 2 else targets[offset:offset + tl]
        offset += tl
        repeats = int((row[1:] == row[:-1]).sum()) if tl > 1 else 0
        if tl + repeats > il:
            bad.append(f"sample {b}: target length {tl} + {repeats} repeat(s) > input length {il}")
    if not bad:
        return None
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return Reason(Cause.IMPOSSIBLE_CTC_TARGET, "; ".join(bad[:5]) + more)
