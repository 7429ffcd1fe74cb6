"""A script that trains models in turn (k-fold cross-validation, a sweep) frees each when it is
done, and under `nanaudit run` too (run/live.py): the models it called and the optimizers it
stepped that only the auditor still holds are let go when the next one arrives, with what it
learned of each, and a later fold's bad step is named as any other. An optimizer let go gets the
read the end of the script gives those still held: a fold whose last update left non-finite
weights (which the script saved) is a finding."""

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


# Three folds of the same four batches, each fold's weights saved by the script.
THREE_FOLDS = '''    torch.save(model.state_dict(), f"fold{fold}.pt")

g = torch.Generator().manual_seed(0)
data = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]
for fold in range(3):
    train_fold(fold, data)
'''

LAST_UPDATE = '''
import torch
from torch import nn

def train_fold(fold, data):
    torch.manual_seed(fold)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step, (x, y) in enumerate(data):
        if fold == 1 and step == len(data) - 1:
            for group in optimizer.param_groups:
                group["lr"] = 1e38           # a schedule's last value gone wrong
        loss = ((model(x) - y) ** 2).mean() * 100
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
''' + THREE_FOLDS


def _run_in(tmp_path, monkeypatch, code: str):
    """`code` run under `run` from `tmp_path` (where it saves its folds)."""
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "folds.py"
    script.write_text(code)
    return run_script(ScriptTarget(path=str(script)), ScriptOptions())


def test_a_let_go_folds_last_update_to_inf_weights_is_the_finding(tmp_path, monkeypatch):
    # Fold 1's last update overflows its weights and the script saves them; the next fold's
    # optimizer lets fold 1's go, and its weights are read first (before: "clean", exit 0).
    report = _run_in(tmp_path, monkeypatch, LAST_UPDATE)
    f = report.finding
    assert report.status != "clean"
    assert (f.step, f.where, f.cause, f.tensor, f.value) == (7, "optimizer", "optimizer-update",
                                                             "0.weight", "inf")
    assert f.op == "aten.add_.Tensor" and "lr 1e+38" in f.explanation
    assert (tmp_path / "fold1.pt").exists() and not (tmp_path / "fold2.pt").exists()


TWO_OPTIMIZERS = '''
import torch
from torch import nn

def train_fold(fold, data):
    torch.manual_seed(fold)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    parts = [model[0], model[2]] if fold == 1 else [model]    # fold 1: one optimizer a layer
    optimizers = [torch.optim.SGD(p.parameters(), lr=0.01, momentum=0.9) for p in parts]
    for step, (x, y) in enumerate(data):
        if fold == 1 and step == len(data) - 1:
            for group in optimizers[0].param_groups:
                group["lr"] = 1e38           # the first layer's schedule gone wrong
        loss = ((model(x) - y) ** 2).mean() * 100
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
''' + THREE_FOLDS


def test_of_two_optimizers_let_go_at_once_the_bad_one_stops_the_next_fold(tmp_path, monkeypatch):
    # Fold 2's one optimizer lets both of fold 1's go at once; the bad one is read first, the
    # clean one after it must not clear its trip (the run would go on through fold 2, and the
    # end of the run would name it).
    f = _run_in(tmp_path, monkeypatch, TWO_OPTIMIZERS).finding
    # fold 1 steps two optimizers an iteration: the first's last update is step 10
    assert (f.step, f.cause, f.tensor) == (10, "optimizer-update", "0.weight")
    assert (tmp_path / "fold1.pt").exists() and not (tmp_path / "fold2.pt").exists()


def test_a_let_go_object_is_kept_while_its_owner_asks():
    asked: list = []
    live = LiveObjects(keep=lambda obj: asked.append(obj.out_features) or obj.out_features == 3)
    a, b = nn.Linear(2, 3), nn.Linear(2, 2)
    live[id(a)] = a
    live[id(b)] = b
    gone_a, gone_b = weakref.ref(a), weakref.ref(b)
    del a, b
    c = nn.Linear(2, 2)
    live[id(c)] = c                          # both only held here: `a` kept, `b` let go
    assert asked == [3, 2] and gone_a() is not None and gone_b() is None and len(live) == 2
    live.keep = None
    live.let_go()
    assert gone_a() is None and live.values() == [c]


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
