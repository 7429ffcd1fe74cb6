"""A script that trains in processes it starts with `multiprocessing` (pytorch/examples'
mnist_hogwild: `Process`es sharing one model; the DDP tutorial: `mp.spawn` of the ranks) is
audited in each of them (script/processes.py): a bad step is named in the process that made it,
in-process, and the report says which process; before, `run` said it audited nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
from helpers import free_port

from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget

HANG_S = 300      # a guard against a hang, not a speed bound (CI's workers share 2 cores)

HOGWILD = '''
import multiprocessing as mp
import sys
import torch
from torch import nn

def train(rank, model, steps):
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        x = torch.rand(16, 4) + 0.5
        if rank == {bad_rank} and step == 2:
            x[3, 1] = 0.0                       # the data's own zero
        loss = (model(x) * x.log()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    {after}

if __name__ == "__main__":
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model.share_memory()
    context = mp.get_context("{method}")
    workers = [context.Process(target=train, args=(rank, model, 5), name=f"trainer-{{rank}}")
               for rank in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with open(sys.argv[1], "w") as f:              # the parent goes on as it would
        f.write(" ".join(str(w.exitcode) for w in workers))
'''


def _hogwild(tmp_path, bad_rank: int, method: str = "fork", after: str = "pass"):
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD.format(bad_rank=bad_rank, method=method, after=after))
    exits = tmp_path / "exits.txt"
    report = run_script(ScriptTarget(path=str(script), args=(str(exits),)), ScriptOptions())
    return report, exits.read_text().split() if exits.exists() else None


@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=pytest.mark.slow),
                                    pytest.param("forkserver", marks=pytest.mark.slow)])
def test_a_trainers_bad_step_is_named_in_that_process(tmp_path, method):
    # spawn (mnist_hogwild's own) and forkserver (Python 3.14's default): a child patched by
    # what its parent sends for it
    report, exits = _hogwild(tmp_path, bad_rank=1, method=method)
    f = report.finding
    # the first trip stops the run: the parent's code after its joins did not run either
    assert report.status == "nonfinite" and exits is None
    assert (f.step, f.where, f.op, f.cause, f.localized_by) == (
        2, "forward", "aten.log.default", "log-domain", "in-process")
    assert report.run.process.startswith("trainer-1 (pid ")
    assert "made in trainer-1 (pid" in f.explanation
    assert "the script started 2 process(es) with multiprocessing, 2 of which trained" in \
        f.explanation


def test_a_trainer_that_keeps_going_skips_its_bad_step_and_ends_as_it_would(tmp_path):
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD.format(bad_rank=0, method="fork", after="pass"))
    exits = tmp_path / "exits.txt"
    report = run_script(ScriptTarget(path=str(script), args=(str(exits),)),
                        ScriptOptions(keep_going=True))
    assert exits.read_text().split() == ["0", "0"]        # trainer-0 went on past step 2
    assert report.status == "nonfinite" and report.run.process.startswith("trainer-0 (pid ")
    assert [(f.step, f.op, f.action) for f in report.findings] == [
        (2, "aten.log.default", "skipped")]
    assert report.steps_run == 5


def test_clean_trainers_are_audited_not_nothing(tmp_path):
    report, exits = _hogwild(tmp_path, bad_rank=-1)
    assert report.status == "clean" and exits == ["0", "0"]
    assert report.steps_run == 5 and report.run.process.startswith("trainer-")


def test_a_trainers_own_error_is_its_error_as_without_nanaudit(tmp_path):
    report, exits = _hogwild(tmp_path, bad_rank=-1,
                             after="raise ValueError('the eval set is missing')")
    assert exits == ["1", "1"]                  # each child failed as it would have
    assert report.status == "error" and report.steps_run == 5
    assert "ValueError: the eval set is missing" in report.error.message


DDP_SPAWN = '''
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

def demo_basic(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    for step in range(6):
        x = torch.randn(20, 10)
        if rank == 1 and step == 3:
            x[4] = 0.0
        optimizer.zero_grad()
        out = model(x)
        length = torch.sqrt((x * x).sum(1, keepdim=True) + 0 * out[:, :1])
        loss = (out * length).pow(2).mean()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(demo_basic, args=(2,), nprocs=2, join=True)
    print("not reached: the join raises when a rank stops")
'''


@pytest.mark.distributed
@pytest.mark.slow
def test_mp_spawn_ddp_ranks_replay_the_bad_step_together(tmp_path, capsys):
    # The ranks join their group themselves (no torchrun env): each child's checks exchange
    # flags once it did, so rank 1's own gradient is named, not rank 0's all-reduced copy.
    script = tmp_path / "ddp_spawn.py"
    script.write_text(textwrap.dedent(DDP_SPAWN))
    report = run_script(ScriptTarget(path=str(script), args=(str(free_port()),)),
                        ScriptOptions())
    f = report.finding
    assert report.status == "nonfinite" and report.error is None   # the join's raise: the stop
    assert (f.step, f.rank, f.where, f.forward_op, f.cause, f.samples) == (
        3, 1, "backward", "aten.sqrt.default", "sqrt-domain", [4])
    assert f.localized_by == "in-process" and f.source.line == 23
    assert [r.status for r in report.distributed.ranks] == ["nonfinite", "nonfinite"]
    assert "not reached" not in capsys.readouterr().out


# The same ranks, rank 1's loss code taking the log of its zero row's squared length at step 3
# and the script asserting its loss is finite (rank 0 meanwhile waits in DDP's all-reduce).
DDP_SPAWN_ASSERT = DDP_SPAWN.replace(
    "        length = torch.sqrt((x * x).sum(1, keepdim=True) + 0 * out[:, :1])\n"
    "        loss = (out * length).pow(2).mean()\n",
    "        length = torch.log((x * x).sum(1, keepdim=True) + 0 * out[:, :1])\n"
    "        loss = (out * length).pow(2).mean()\n"
    "        assert torch.isfinite(loss), f'loss diverged at step {step}'\n")
assert DDP_SPAWN_ASSERT != DDP_SPAWN


@pytest.mark.distributed
@pytest.mark.slow
def test_a_ranks_own_assert_under_mp_spawn_is_analysed_and_reported_where_asked(tmp_path):
    # Before: mp.spawn's `_wrap` turned rank 1's AssertionError into exit status 1 before the
    # audit saw it: exit 4, "the script raised ProcessRaisedException", no op. And a report
    # adopted from a rank was written to r.rank1.json, not the r.json the user asked for.
    (tmp_path / "ddp_spawn.py").write_text(textwrap.dedent(DDP_SPAWN_ASSERT))
    done = subprocess.run([sys.executable, "-m", "nanaudit", "run", "-q", "--json", "r.json",
                           "ddp_spawn.py", str(free_port())], cwd=tmp_path,
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 1, done.stderr
    assert not list(tmp_path.glob("r.rank*.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    f = report["finding"]
    assert (f["step"], f["rank"], f["where"], f["op"], f["cause"], f["samples"]) == (
        3, 1, "forward", "aten.log.default", "log-domain", [4])
    assert f["localized_by"] == "in-process" and f["source"]["line"] == 23
    assert "AssertionError: loss diverged at step 3" in f["explanation"]
    # both ranks counted, whether or not rank 0 wrote its report before the join stopped it
    assert "the script started 2 process(es) with multiprocessing" in f["explanation"]
    assert report["run"]["process"].startswith("SpawnProcess")
    assert report["error"]["exception"] == "AssertionError"    # the rank's, not the join's


POOL = '''
import multiprocessing as mp
import torch
from torch import nn

def trial(lr):
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(3):
        loss = model(torch.ones(8, 4)).pow(2).mean() * torch.tensor(lr).log()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return float(loss)

if __name__ == "__main__":
    with mp.get_context("fork").Pool(2) as pool:
        print(pool.map(trial, [0.1, 0.0]))        # log(0): the second trial goes NaN
'''


def test_a_pools_workers_are_left_alone_never_a_hang(tmp_path, capsys):
    # A trip that stopped a task would leave `pool.map` waiting for ever: a pool's workers are
    # not audited (as before), and the script ends as it would.
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    report = run_script(ScriptTarget(path=str(script)), ScriptOptions())
    assert report.status == "error" and "without stepping an optimizer" in report.error.message
    assert "nan]" in capsys.readouterr().out        # the trial went on, as without nanaudit


QUEUE = '''
import multiprocessing as mp
import torch
from torch import nn

def train(results):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.rand(8, 4) + 0.5
        if step == 2:
            x[1, 0] = 0.0
        loss = (model(x) * x.log()).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    results.put(float(loss))

if __name__ == "__main__":
    context = mp.get_context("{method}")
    results = context.Queue()
    worker = context.Process(target=train, args=(results,))
    worker.start()
    print("result", results.get())       # blocks until the trainer puts its loss
    worker.join()
'''


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_parent_waiting_on_a_stopped_trainers_result_is_stopped_too(tmp_path, method):
    # The trainer stopped at its trip never puts its result: the parent, blocked in the
    # queue's `get`, is stopped by the first child to trip, never left waiting for ever.
    (tmp_path / "trainer.py").write_text(QUEUE.format(method=method))
    done = subprocess.run([sys.executable, "-m", "nanaudit", "run", "-q", "--json", "r.json",
                           "trainer.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=HANG_S)
    report = json.loads((tmp_path / "r.json").read_text())
    f = report["finding"]
    assert done.returncode == 1 and "result" not in done.stdout, done.stderr
    assert (f["step"], f["op"], f["cause"], report["status"]) == (
        2, "aten.log.default", "log-domain", "nonfinite")
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr


LIGHTNING_SPAWN = '''
import torch
from torch import nn
import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        scale = x.abs().sum(1, keepdim=True)
        if self.global_step == 3 and self.global_rank == 1:
            scale[5] = 0.0
        loss = ((out - y) ** 2 * torch.sqrt(scale + 0 * out)).mean()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False)
    trainer.fit(Model(), DataLoader(data, batch_size=8))
'''


@pytest.mark.distributed
@pytest.mark.slow
def test_lightning_ddp_spawn_replays_the_training_step_on_its_rank(tmp_path):
    # Lightning calls a DDP-wrapped LightningModule with its `forward` redirected to
    # `training_step` for that one call: the replay calls that step (rank_replay.local_call),
    # where it called the module's missing `forward` before.
    pytest.importorskip("lightning")
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING_SPAWN)
    report = run_script(ScriptTarget(path=str(script)), ScriptOptions())
    f = report.finding
    assert (f.step, f.rank, f.where, f.forward_op, f.cause, f.samples) == (
        3, 1, "backward", "aten.sqrt.default", "sqrt-domain", [5])
    assert f.localized_by == "in-process" and f.source.function == "training_step"


# A plain loop with a DataLoader's worker (a process that only loads data), killed outright at
# step 2 (as an out-of-memory killer or `kill -9` would): it started no process that trains.
KILLED = '''
import os
import signal
import torch
from torch import nn

data = torch.utils.data.DataLoader(torch.randn(32, 4), batch_size=8, num_workers=1)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step, x in enumerate(data):
    if step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def test_a_run_killed_outright_leaves_no_folder_unless_the_script_started_a_trainer(tmp_path):
    # The children's folder is made at the first process that may train, not for every run:
    # before, each `run` made one, and a killed one (an FSDP rank a test kills) left it behind.
    (tmp_path / "train.py").write_text(KILLED)
    # A short temporary folder of its own: the worker hands its batch over a Unix socket made
    # there, whose path may not pass 108 characters (under tmp_path it did, and hung).
    with tempfile.TemporaryDirectory(prefix="na-") as temporary:
        # (no pipes: the orphaned worker would hold them open until it notices)
        done = subprocess.run([sys.executable, "-m", "nanaudit", "run", "-q", "train.py"],
                              cwd=tmp_path, env={**os.environ, "TMPDIR": temporary},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=HANG_S)
        assert done.returncode == -9
        assert [p for p in os.listdir(temporary) if p.startswith("nanaudit-")] == []


# A script that reaps the process it started itself (`os.waitpid`): multiprocessing can no
# longer wait for it (ECHILD), and says it is alive for ever.
REAPED = '''
import multiprocessing as mp
import os
import torch
from torch import nn

def idle():
    pass

if __name__ == "__main__":
    helper = mp.get_context("fork").Process(target=idle)
    helper.start()
    os.waitpid(helper.pid, 0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(4, 3)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


def test_a_process_the_script_reaped_itself_is_waited_for_once_not_for_ever(tmp_path):
    # Before: the wait at the script's end joined it again and again at full CPU; in CI it
    # also joined a process an earlier test had left in the same interpreter, and never ended.
    (tmp_path / "train.py").write_text(REAPED)
    done = subprocess.run([sys.executable, "-m", "nanaudit", "run", "-q", "--json", "r.json",
                           "train.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "clean" and report["steps_run"] == 3
