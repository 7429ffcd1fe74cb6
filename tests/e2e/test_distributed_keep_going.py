"""`scan --keep-going` under two ranks (gloo, CPU): a backward NaN made by rank 1's batch at
step 2 reaches every rank's gradients through DDP's all-reduce; every rank skips that step
from the one exchange, the finding names rank 1, the run trains to its end and the replicas
stay equal. FSDP2 likewise, its ranks replaying together."""

import json
import math
import shutil
import textwrap

import pytest
import torch
from helpers import ROOT, launch_ranks

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
EXAMPLES = ROOT / "configs" / "examples"


def test_every_rank_skips_the_same_step_and_the_replicas_stay_equal(tmp_path, monkeypatch):
    shutil.copy(ROOT / "tests" / "e2e" / "keep_going_ddp.py", tmp_path)
    ddp = EXAMPLES / "ddp.py"
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {ddp}:magnitude_model
        data: {{entrypoint: "{ddp}:shard", args: {{poison_rank: 1, poison_step: 2,
                                                  poison_row: 6, zero_row: true}}}}
        loss: keep_going_ddp.py:mse_saving
        optimizer: {{class: torch.optim.SGD, lr: 0.01}}
        seed: 0
        device: cpu
        distributed: {{backend: gloo, timeout_s: 60}}
        """))
    monkeypatch.setenv("KEEP_GOING_STATES", str(tmp_path))
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--keep-going",
                                   "--no-repro", "--json", out], 2, 120)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    assert [r["steps_run"] for r in report["distributed"]["ranks"]] == [6, 6]
    (finding,) = report["findings"]
    assert (finding["step"], finding["rank"], finding["where"], finding["cause"],
            finding["action"]) == (2, 1, "backward", "sqrt-domain", "skipped")
    assert report["finding"] == finding
    states = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        assert torch.isfinite(states[0][key]).all(), key
        assert torch.equal(states[0][key], states[1][key]), key


def test_fsdp2_ranks_replay_and_skip_the_same_step_together(tmp_path):
    # FSDP2: the backward NaN of rank 1's batch at step 2 reaches both ranks' gradient shards
    # through the reduce-scatter; every rank replays at once (the finding is the same on each)
    # and skips the step; the run trains to its end.
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", EXAMPLES / "fsdp_backward_nan.yaml",
                                   "--keep-going", "--no-repro", "--json", out], 2, 120)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())
    assert [(r["steps_run"], r["status"]) for r in report["distributed"]["ranks"]] == [
        (6, "nonfinite"), (6, "nonfinite")]
    (finding,) = report["findings"]
    assert (finding["step"], finding["rank"], finding["where"], finding["cause"],
            finding["action"]) == (2, 1, "backward", "sqrt-domain", "skipped")
    after = [e for e in report["timeline"] if e["step"] > 2]
    assert after and all(math.isfinite(e["param_norm"]) and math.isfinite(e["loss"])
                         for e in after)


# Rank 1's data code standardizes a batch with a constant feature at step 2: 0/0 before the
# model. Rank 1 traces what made it (its own data, read again); every rank's report says so.
STANDARDIZED_SHARD = """
    import torch

    def shard(rank=0, world_size=1, steps=5, rows=8):
        g = torch.Generator().manual_seed(1000 + rank)
        for step in range(steps):
            x = torch.randn(rows, 8, generator=g)
            y = x[:, :1] * 2.0
            if rank == 1 and step == 2:
                x[:, 3] = 4.0                 # a constant feature in rank 1's batch
            yield {"x": (x - x.mean(0)) / x.std(0), "y": y}
"""


def test_every_ranks_report_names_what_made_a_peers_skipped_input(tmp_path):
    (tmp_path / "data.py").write_text(textwrap.dedent(STANDARDIZED_SHARD))
    ddp = EXAMPLES / "ddp.py"
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {ddp}:magnitude_model
        data: data:shard
        loss: {ddp}:mse
        optimizer: {{class: torch.optim.SGD, lr: 0.01}}
        seed: 0
        device: cpu
        distributed: {{backend: gloo, timeout_s: 60}}
        """))
    out = tmp_path / "report.json"
    codes, outputs = launch_ranks(["-m", "nanaudit", "scan", config, "--keep-going",
                                   "--no-repro", "--json", out], 2, 120)
    assert codes == [1, 1], outputs
    report = json.loads(out.read_text())          # rank 0's
    assert [r["steps_run"] for r in report["distributed"]["ranks"]] == [5, 5]
    (finding,) = report["findings"]
    assert (finding["step"], finding["rank"], finding["where"], finding["action"]) == (
        2, 1, "input", "skipped")
    assert (finding["op"], finding["cause"]) == ("aten.div.Tensor", "div-by-zero")
    assert finding["producer"]["made_by"] == "torch-op"
    assert finding["source"]["line"] == 11 and finding["source"]["file"].endswith("data.py")
    assert report["finding"] == finding


# `nanaudit run --keep-going` of a DDP loop over a DistributedSampler: samples 13 and 42 of
# the data set hold a NaN, one in a batch of each rank.
DDP_SAMPLER = """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    class Rows(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            x = torch.randn(4, generator=torch.Generator().manual_seed(i))
            if i in (13, 42):
                x[2] = float("nan")
            return x, x.sum(0, keepdim=True)

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(Rows(), shuffle=True, seed=1)
    for x, y in DataLoader(Rows(), batch_size=4, sampler=sampler):
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
"""


def test_run_names_each_ranks_bad_samples_on_every_ranks_report(tmp_path):
    # A batch bad before the model got it is not replayed: only its own rank saw its rows.
    # Before, the other rank's report had "[] (shapes [])" and no rows for that step; and a
    # rank still reading the exit barrier when rank 0 (the store's host) left printed C++
    # frames of the failed store call.
    script, out = tmp_path / "train.py", tmp_path / "report.json"
    script.write_text(textwrap.dedent(DDP_SAMPLER))
    codes, outputs = launch_ranks(["-m", "nanaudit", "run", "-q", "--keep-going", "--skip-list",
                                   tmp_path / "skip.json", "--json", out, script], 2, 120)
    assert codes == [1, 1], outputs
    assert not any("frame #" in err for _, err in outputs), outputs
    for path in (out, tmp_path / "report.rank1.json"):
        findings = json.loads(path.read_text())["findings"]
        named = sorted((f["rank"], f["producer"]["sample_indices"]) for f in findings)
        assert named == [(0, [13]), (1, [42])]
        assert all(f["samples"] and f["tensor"] == "input[0]" for f in findings)
    skip = json.loads((tmp_path / "skip.json").read_text())["skip"]
    assert sorted((e["rank"], e["sample_indices"]) for e in skip) == [(0, [13]), (1, [42])]
