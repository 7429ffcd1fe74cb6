"""What the script auditor knows of the script's training: the modules it called first and
their parameters' names, the optimizers it built and stepped (or its own update by hand), and
how an optimizer is described in a finding."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from nanaudit.run.live import LiveObjects
from nanaudit.run.names import user_named
from nanaudit.script.call_sites import CallSites
from nanaudit.script.held_modules import held_modules


class ManualUpdate:
    """The script's own update, for a script that builds no torch.optim optimizer: the
    parameters of the modules it called, as one group, in place of an optimizer's."""

    def __init__(self) -> None:
        self.param_groups: list = [{"params": []}]


class Ledger:
    """What the auditor knows of the script's training: the modules it called first (the
    outermost ones) and their parameters' names, the optimizers it built and stepped, and when
    each last updated. A script that builds no optimizer updates by hand: `manual` stands in."""

    def __init__(self, forgotten: list[Callable[[int], None]] | None = None,
                 last_look: Callable[[Any], bool] | None = None) -> None:
        self.names: dict[int, str] = {}          # id(parameter) -> qualified name
        # The names of the modules the script holds and of their parameters (learned at a
        # trip: held_modules.py), asked after the roots' own; the step last learned at.
        self.module_names: dict[int, str] = {}
        self._held_names: dict[int, str] = {}
        self._learned_at: int | None = None
        # Let go once only we hold them (live.py: a script training models in turn frees each);
        # a model while an optimizer still held trains it: its last update names its weights.
        self.roots = LiveObjects(forget=self._root_let_go, keep=self._trained_by_one_held)
        self.optimizers_made = 0                 # torch.optim optimizers the script built
        self.manual = ManualUpdate()
        # id -> every optimizer checked that the script still holds, for the end; one it let go
        # gets `last_look` first (its last update read: true keeps it, for the trip's account)
        self.stepped = LiveObjects(forget=self._optimizer_let_go, keep=last_look)
        # what else keeps something by an optimizer's id, told when it is let go
        self.forgotten = forgotten or []
        self.updated_at: dict[int, int] = {}     # id(optimizer) -> the step of its last update
        # id(optimizer) -> each group's learning rate as its latest update ran: a scheduler
        # (a warm-up, the Trainer's) sets the next step's before an update trip is read.
        self.update_rates: dict[int, list] = {}
        self.steps_taken = 0                     # post-hook calls, every one
        self.backwards = 0                       # backward calls that returned
        self.clips = False                       # the script called `clip_grad_norm_`
        self.by_hand_anyway = False              # optimizers built, yet updated by hand
        self.sites = CallSites()                 # the lines that built and stepped each one

    def updated(self, optimizer: Any, step: int) -> None:
        """`optimizer` applied its update of `step`, with its groups' learning rates as they
        are now (its post-hook: a scheduler steps after it)."""
        self.updated_at[id(optimizer)] = step
        self.update_rates[id(optimizer)] = [g.get("lr") for g in optimizer.param_groups]
        # the step's caller: out past the auditor, its hook and torch's step wrapper
        self.sites.stepped(optimizer, 4)

    def update_rate(self, optimizer: Any, group: int) -> Any:
        """Group `group`'s learning rate as `optimizer`'s latest update ran (None: unknown)."""
        rates = self.update_rates.get(id(optimizer))
        return rates[group] if rates is not None and group < len(rates) else None

    def called(self, module: torch.nn.Module) -> None:
        if id(module) not in self.roots:
            self.roots[id(module)] = module
            self._name_parameters(module)

    def _name_parameters(self, module: torch.nn.Module) -> None:
        for name, p in user_named(module, module.named_parameters()):
            self.names.setdefault(id(p), name)   # a parameter two roots share: the first's

    def _root_let_go(self, _key: int) -> None:
        """Its parameters' ids are free for others: named again from the live roots."""
        self.names.clear()
        for module in self.roots.values():
            self._name_parameters(module)

    def _trained_by_one_held(self, module: torch.nn.Module) -> bool:
        """Whether an optimizer still held trains `module`'s parameters (not the script's own
        update, which lists every root's)."""
        held = {id(p) for opt in self.stepped.values() if not isinstance(opt, ManualUpdate)
                for group in opt.param_groups for p in group["params"]}
        return any(id(p) in held for p in module.parameters())

    def _optimizer_let_go(self, key: int) -> None:
        self.updated_at.pop(key, None)
        self.update_rates.pop(key, None)
        for forget in self.forgotten:
            forget(key)
        self.roots.let_go()        # the models it alone kept

    def name(self, p: torch.Tensor) -> str:
        name = self.names.get(id(p)) or self._held_names.get(id(p))
        if name is None and self.learn_held(sys._getframe(1)):
            name = self._held_names.get(id(p))
        return name if name is not None else f"<parameter {tuple(p.shape)}>"

    def qualified_name(self, p: torch.Tensor) -> str:
        """`p`'s name with the variable holding its module (`generator.0.weight`) where the
        script's frames were read at the trip: the roots' own names repeat across models."""
        return self._held_names.get(id(p)) or self.name(p)

    def learn_held(self, frame: FrameType | None) -> bool:
        """Name the modules the script's frames hold (from `frame` outward) and their
        parameters, where the roots it called did not name them (held_modules.py); once a
        step. True when it looked."""
        if self._learned_at == self.steps_taken:
            return False
        self._learned_at = self.steps_taken
        for variable, held in held_modules(frame):
            for name, module in user_named(held, held.named_modules()):
                self.module_names.setdefault(id(module), f"{variable}.{name}" if name
                                             else variable)
            for name, p in user_named(held, held.named_parameters()):
                self._held_names.setdefault(id(p), f"{variable}.{name}")
        return True

    def tracer_names(self, frame: FrameType | None = None) -> dict[int, str]:
        """id -> name of every module of the models the script holds, for a tracer to name
        an op of a model other than the one it traces (a critic, a teacher called in the loss
        code): the one naming both the in-process replay and the re-run use. Learned from
        `frame` outward when given (once a step); else what the trip learned."""
        if frame is not None:
            self.learn_held(frame)
        return self.module_names

    @property
    def updates_by_hand(self) -> bool:
        """No optimizer built (or one built and never stepped: `cleared_by_hand`), and a
        module trained: each backward is the script's step."""
        return (not self.optimizers_made or self.by_hand_anyway) and bool(self.roots)

    def optimizer_made(self, optimizer: Any) -> None:
        self.optimizers_made += 1
        self.sites.built(optimizer, 3)       # out past the auditor and the wrapped __init__
        self.backwards = 0          # those before it were not for it (a warm-up, an init)

    def cleared_by_hand(self) -> bool:
        """A new loss after a backward, no optimizer stepped yet (nor skipped by a GradScaler),
        and every trained gradient cleared (`zero_grad()` sets them to None): the script used
        those gradients itself, updating by hand with an optimizer it built and never steps.
        (Gradient accumulation keeps them; a real step comes through the optimizer's hooks.)
        Read on the host, and only until the first optimizer step."""
        if not self.optimizers_made or self.stepped or self.by_hand_anyway \
                or not self.backwards:
            return False
        params = self.manual_step().param_groups[0]["params"]
        self.by_hand_anyway = bool(params) and all(p.grad is None for p in params)
        return self.by_hand_anyway

    def manual_step(self) -> ManualUpdate:
        """The script's own update: the trainable parameters of the modules it called."""
        seen, params = set(), []
        for module in self.roots.values():
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.manual.param_groups[0]["params"] = params
        return self.manual

    def forget_manual_steps(self) -> None:
        """An optimizer built after backward calls were checked as steps: those were not an
        optimizer's training steps (a warm-up, a gradient-based init)."""
        self.steps_taken = 0
        self.updated_at.clear()
        self.stepped.discard(id(self.manual))


def describe_optimizer(optimizer: Any, rates: list | None = None) -> str:
    """`Adam(lr=0.001, eps=1e-08, ...)`: its class and the hyper-parameters that matter;
    `rates`: its groups' learning rates as an update ran (Ledger.update_rates), else as now."""
    if isinstance(optimizer, ManualUpdate):
        return ""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if rates:
        group = {**group, "lr": rates[0]}
    hyper = ", ".join(f"{k}={group[k]:.4g}" for k in ("lr", "eps", "momentum", "weight_decay")
                      if isinstance(group.get(k), (int, float)))
    return f"{type(optimizer).__name__}({hyper})"
