"""What a step reads besides the optimizer's parameters and gradients: the model's floating
buffers (BatchNorm's running statistics, an EMA a forward keeps). A forward can make one
non-finite while the loss stays finite (a running std of a one-row batch), and the next steps
normalize with it: the step loop, `Sentinel` and `nanaudit run` all read them.

Which buffers a model holds is found once (walking a module tree costs more than reading
them); each is then read live through its owner (`module._buffers[name]`), so a buffer the
script rebinds (`self.buf = new`) is followed, not a stale alias of it.
"""

from __future__ import annotations

import torch

from nanaudit.run.names import user_named


def float_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's floating buffers, in `model.buffers()` order."""
    return [b for b in model.buffers() if b.is_floating_point()]


class BufferScope:
    """The floating buffers of a set of models (the outermost modules a script called), by
    their user names, each read live from its owner."""

    def __init__(self) -> None:
        self._slots: list[tuple[dict, str, str]] = []    # (owner's _buffers, name, user name)
        self._roots: set[int] = set()

    def add(self, module: torch.nn.Module, prefix: str | None = None) -> None:
        """Add a model's floating buffers (once per model; a buffer two models share, once),
        named under `prefix` when given (the script's name for a model besides the step's)."""
        if id(module) in self._roots:
            return
        self._roots.add(id(module))
        seen = {id(t) for t in self.tensors()}
        owners = {id(b): (m._buffers, key) for m in module.modules()
                  for key, b in m._buffers.items() if b is not None}
        for name, b in user_named(module, module.named_buffers()):
            if b.is_floating_point() and id(b) not in seen and id(b) in owners:
                seen.add(id(b))
                self._slots.append((*owners[id(b)], f"{prefix}.{name}" if prefix else name))

    def holds(self, module: torch.nn.Module) -> bool:
        return id(module) in self._roots

    def tensors(self) -> list[torch.Tensor]:
        """The buffers as they are now (a rebound one's new tensor; none rebound to None)."""
        return [t for t in (owner.get(key) for owner, key, _ in self._slots)
                if t is not None and t.is_floating_point()]

    def nonfinite(self) -> list[tuple[str, torch.Tensor]]:
        """(user name, buffer) of those holding a non-finite element (syncs: after a trip)."""
        return [(name, t) for owner, key, name in self._slots
                if (t := owner.get(key)) is not None and t.is_floating_point()
                and not bool(torch.isfinite(t).all())]

    def __bool__(self) -> bool:
        return bool(self._slots)
