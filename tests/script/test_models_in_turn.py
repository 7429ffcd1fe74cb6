"""A script that trains models in turn (k-fold cross-validation, a sweep) frees each when it is
done, and under `nanaudit run` too (run/live.py): the models it called and the optimizers it
stepped that only the auditor still holds are let go when the next one arrives, with what it
learned of each, and a later fold's bad step is named as any other."""

from __future__ import annotations

import gc
import json
import textwrap
import weakref

import torch
from torch import nn

from nanaudit.commands.run import run_script
from nanaudit.run.live import LiveObjects
from nanaudit.script.step_tap import _hook_once
from nanaudit.script.target import ScriptOptions, ScriptTarget

FOLDS = '''
import gc, json, sys, weakref
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.body(x)

kept = []

def train_fold(fold, data):
    torch.manual_seed(fold)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(data):
        out = model(x)
        scale = y.abs().sum(1, keepdim=True)
        if fold == {bad_fold} and step == 2:
            scale = scale.log() - 10
        loss = ((out - y) ** 2 * scale.sqrt()).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    kept.append((weakref.ref(model), weakref.ref(optimizer)))
    gc.collect()
    # the folds before this one: alive only if something still holds them
    alive = sum(m() is not None or o() is not None for m, o in kept[:-1])
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps(alive) + "\\n")

g = torch.Generator().manual_seed(0)
data = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]
for fold in range(5):
    train_fold(fold, data)
'''


def _folds(tmp_path, bad_fold: int):
    script = tmp_path / "folds.py"
    script.write_text(textwrap.dedent(FOLDS.format(bad_fold=bad_fold)))
    alive = tmp_path / "alive.jsonl"
    report = run_script(ScriptTarget(path=str(script), args=(str(alive),)), ScriptOptions())
    return report, [json.loads(line) for line in alive.read_text().splitlines()]


def test_the_models_and_optimizers_of_earlier_folds_are_freed_as_without_nanaudit(tmp_path):
    report, alive = _folds(tmp_path, bad_fold=-1)
    assert report.status == "clean" and report.steps_run == 20
    assert alive == [0, 0, 0, 0, 0]          # before: 0, 1, 2, 3, 4 (the ledger held them all)


def test_a_later_folds_loss_code_value_is_named_in_process(tmp_path):
    report, alive = _folds(tmp_path, bad_fold=3)
    f = report.finding
    assert (f.step, f.op, f.cause, f.localized_by) == (14, "aten.sqrt.default", "sqrt-domain",
                                                      "in-process")
    assert alive == [0, 0, 0]                # folds 0 to 2 ran to their end


def test_what_only_nanaudit_holds_is_let_go_and_forgotten_when_a_new_one_arrives():
    forgotten: list[int] = []
    live = LiveObjects(forget=forgotten.append)
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    live[id(a)] = a
    live[id(b)] = b
    key, gone = id(a), weakref.ref(a)
    del a                                    # the script let go: held for its report still
    assert gone() is not None and key in live and len(live) == 2
    c = nn.Linear(2, 2)
    live[id(c)] = c                          # a new one: `a` is let go (b, c: the script's)
    assert gone() is None and forgotten == [key]
    assert live.values() == [b, c] and key not in live
    live[id(c)] = c                          # registered again: nothing changes
    assert forgotten == [key] and len(live) == 2


def test_a_freed_models_hook_does_not_stand_for_a_new_model_at_its_id():
    # CPython reuses a freed object's address: the handle kept at that id was a dead model's.
    heard = []
    hooked: dict = {}
    old, new = nn.Linear(2, 2), nn.Linear(2, 2)
    _hook_once(hooked, old, lambda *args: heard.append("old"))
    hooked[id(new)] = hooked.pop(id(old))    # as if `new` were allocated where `old` was
    del old
    gc.collect()
    _hook_once(hooked, new, lambda *args: heard.append("new"))
    new(torch.ones(1, 2))
    assert heard == ["new"]
    _hook_once(hooked, new, lambda *args: heard.append("twice"))   # once per model
    new(torch.ones(1, 2))
    assert heard == ["new", "new"]
