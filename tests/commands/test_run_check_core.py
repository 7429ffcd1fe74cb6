"""`nanaudit run` reads what the step loop and `Sentinel` read, and decides as they do (the check
core, run/check/): a float buffer that goes non-finite is a finding, and a GradScaler whose
scale collapses is one, by the same rule and with the same cause and exit code as `scan`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.exitcodes import ExitCode
from nanaudit.script.target import ScriptOptions, ScriptTarget

# After a public pattern: a running statistic kept in a buffer (an EMA of the batch's spread,
# as normalizing layers keep), whose one-row batch gives std() of one element: NaN. The loss
# does not read the buffer, so it stays finite; the model's state does not.
EMA_BUFFER = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.register_buffer("spread", torch.ones(()))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.spread.mul_(0.9).add_(0.1 * x[:, 0].std())
            return self.fc(x)

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x = torch.randn(1 if step == 3 else 8, 4)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""

# After the `scan` example amp_scale_collapse: raw counts of 1000 under float16; the weight
# gradient overflows float16 whatever the scale, so the GradScaler skips every step.
SCALE_COLLAPSE = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(64, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for step in range(STEPS):
        x = torch.full((256, 64), 1000.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().sum()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""


# After rosinality/vq-vae-2-pytorch's Quantize without Laplace smoothing: an EMA codebook whose
# unused codes keep cluster_size 0, so the codebook buffer is 0/0 and inf at the first step,
# written under the forward with `.data.copy_`; the loss of that step is finite.
VQ_EMA = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Quantize(nn.Module):
        def __init__(self, dim, n_embed, decay=0.99):
            super().__init__()
            self.decay = decay
            embed = torch.randn(dim, n_embed)
            self.register_buffer("embed", embed)
            self.register_buffer("cluster_size", torch.zeros(n_embed))
            self.register_buffer("embed_avg", embed.clone())

        def forward(self, x):
            dist = (x.pow(2).sum(1, keepdim=True) - 2 * x @ self.embed
                    + self.embed.pow(2).sum(0, keepdim=True))
            index = (-dist).max(1)[1]
            onehot = F.one_hot(index, self.embed.shape[1]).type(x.dtype)
            quantize = F.embedding(index, self.embed.transpose(0, 1))
            if self.training:
                self.cluster_size.data.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.data.mul_(self.decay).add_(x.t() @ onehot, alpha=1 - self.decay)
                normalized = self.embed_avg / self.cluster_size.unsqueeze(0)
                self.embed.data.copy_(normalized)
            return x + (quantize - x).detach(), (quantize.detach() - x).pow(2).mean()

    torch.manual_seed(0)
    enc, q, dec = nn.Linear(16, 8), Quantize(8, 32), nn.Linear(8, 16)
    model = nn.ModuleDict({"enc": enc, "q": q, "dec": dec})
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(4):
        x = torch.randn(64, 16)
        quantized, diff = q(enc(x))
        loss = F.mse_loss(dec(quantized), x) + 0.25 * diff
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""

def _run(tmp_path: Path, code: str, **options):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path, run_script(ScriptTarget(path=str(path)), ScriptOptions(**options))


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_buffer_made_nonfinite_by_the_forward_is_a_finding(tmp_path):
    path, report = _run(tmp_path, EMA_BUFFER)
    assert exit_code(report) == ExitCode.NONFINITE
    f = report.finding
    assert (f.step, f.where, f.tensor) == (3, "forward", "spread")
    assert "buffer" in f.explanation and "spread" in f.explanation
    # The re-run traces step 3's forward: the std of one element.
    assert f.op == "aten.std.correction" and f.cause == "degenerate-reduction"
    assert f.source.line == _line(path, "x[:, 0].std()")


def test_a_buffer_finding_without_a_rerun_names_the_buffer_and_step(tmp_path):
    _, report = _run(tmp_path, EMA_BUFFER, rerun=False)
    assert exit_code(report) == ExitCode.NONFINITE
    f = report.finding
    assert (f.step, f.where, f.tensor, f.op) == (3, "forward", "spread", None)
    assert f.source is None


@pytest.mark.parametrize("steps", [12, 40])
def test_a_scale_collapse_is_a_finding_even_when_every_step_is_skipped(tmp_path, steps):
    _, report = _run(tmp_path, SCALE_COLLAPSE.replace("STEPS", str(steps)))
    assert exit_code(report) == ExitCode.NONFINITE
    f = report.finding
    assert "skipped 10 steps in a row" in f.explanation
    assert (f.where, f.op, f.cause) == ("backward", "aten.mm.default", "dtype-overflow")
    # No update ran: each step skipped is a step, as `scan` numbers them (its
    # amp_scale_collapse example trips at step 9 too); before, all ten were "tries" of step 0.
    assert report.steps_run == 10 and f.step == 9
    assert all(entry.skipped for entry in report.timeline)
    assert report.run.first_run.skipped == 10


def test_a_scale_collapse_without_a_rerun_is_still_a_finding(tmp_path):
    _, report = _run(tmp_path, SCALE_COLLAPSE.replace("STEPS", "12"), rerun=False)
    assert exit_code(report) == ExitCode.NONFINITE
    assert report.finding.where == "backward"
    assert "skipped 10 steps in a row" in report.finding.explanation


def test_a_large_finite_buffer_is_no_finding(tmp_path):
    # Its float32 sum of squares overflows (1e30 squared): the element-wise check confirms.
    _, report = _run(tmp_path, """
        import torch
        from torch import nn

        model = nn.Linear(4, 1)
        model.register_buffer("scale", torch.full((8,), 1e30))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """)
    assert exit_code(report) == ExitCode.CLEAN and report.steps_run == 3


# The EMA case under torchrun (DDP, gloo): rank 1's one-row batch at step 3 makes its own copy
# of the buffer NaN (DDP broadcasts rank 0's buffers at the next forward, so the check must see
# it at this step's read). The loss stays finite on both ranks.
DDP_EMA_BUFFER = """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.register_buffer("spread", torch.ones(()))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.spread.mul_(0.9).add_(0.1 * x[:, 0].std())
            return self.fc(x)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(6):
        x = torch.randn(1 if (rank == 1 and step == 3) else 8, 4, generator=g)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_under_torchrun_a_buffer_one_rank_made_nonfinite_names_that_rank(tmp_path):
    import json

    from helpers import launch_ranks
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(DDP_EMA_BUFFER))
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--no-rerun", "--json", out,
                                   path])
    assert codes == [1, 1], outputs
    rank0 = json.loads(out.read_text())
    rank1 = json.loads((tmp_path / "report.rank1.json").read_text())
    # Both ranks stop at step 3 and name rank 1 and its buffer: the flags carried its buffers.
    for report in (rank0, rank1):
        f = report["finding"]
        assert (f["step"], f["rank"], f["where"], f["tensor"]) == (3, 1, "forward", "spread"), f
        assert "buffer" in f["explanation"]


# A GradScaler whose first scales overflow (AMP's calibration: skipped steps, no findings),
# then a division by zero in the loss code at the loop's step 6.
SCALER_CALIBRATING = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
    for step in range(10):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 8)).float()
        loss = (out / (out - out)).mean() if step == 6 else out.pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
"""


def test_a_step_the_gradscaler_skips_is_a_step_as_the_loop_counts_it(tmp_path):
    """The finding's step is the script's own loop's (and `scan`'s, the Trainer's): before,
    the scaler's calibration skips went uncounted and the finding said step 0."""
    _, report = _run(tmp_path, SCALER_CALIBRATING)
    assert exit_code(report) == ExitCode.NONFINITE
    assert (report.finding.step, report.finding.op) == (6, "aten.div.Tensor")
    skipped = [entry.step for entry in report.timeline if entry.skipped]
    assert skipped[:2] == [0, 1] and [entry.step for entry in report.timeline] == list(range(7))


def test_the_timeline_has_the_gradscalers_scale_on_every_step_applied_or_skipped(tmp_path):
    """Each step's entry carries the loss scale it ran with, as `scan`'s does: read with the
    step's one read on the steps the scaler applied (before, only the skipped ones had it),
    and equal to what the script's own `get_scale()` said before each `scaler.step`."""
    scales = tmp_path / "scales.txt"
    code = SCALER_CALIBRATING.replace("if step == 6 else", "if step == 99 else").replace(
        "range(10)", "range(16)").replace(
        'init_scale=2.0 ** 24)', 'init_scale=2.0 ** 24, growth_interval=2)').replace(
        "        scaler.step(optimizer)\n",
        f"        open({str(scales)!r}, 'a').write(f'{{scaler.get_scale()}}\\n')\n"
        "        scaler.step(optimizer)\n")
    _, report = _run(tmp_path, code)
    assert exit_code(report) == ExitCode.CLEAN
    expected = [float(x) for x in scales.read_text().split()]
    assert [entry.scale for entry in report.timeline] == expected
    applied = [entry.scale for entry in report.timeline if not entry.skipped]
    assert applied and all(scale is not None for scale in applied)
    assert len(set(applied)) > 1            # it grew while the steps applied


@pytest.mark.parametrize("force_rerun", [False, True])
def test_a_codebook_buffer_divided_by_a_zero_count_is_named_where_it_reached_the_buffer(
        tmp_path, force_rerun):
    path, report = _run(tmp_path, VQ_EMA, force_rerun=force_rerun)
    f = report.finding
    assert (f.step, f.where, f.tensor, f.module) == (0, "forward", "q.embed", "q")
    assert (f.op, f.cause) == ("aten.div.Tensor", "div-by-zero")
    assert f.source.line == _line(path, "self.embed_avg / self.cluster_size")
    assert f.localized_by == ("re-run" if force_rerun else "in-process")
    # The infinity went into the codebook (through copy_), not into the loss, which was finite.
    assert "reached the buffer q.embed through copy" in f.explanation
    assert "reached the loss" not in f.explanation
