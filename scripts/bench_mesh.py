"""Benchmark `nanaudit run` on 2-D device meshes under torchrun: what the checks add to a step,
and how many collectives they add per step (issue 37).

A training script is written to a temporary folder (no downloads): 4 residual MLP blocks
(d 128, ff 512, ~0.5M parameters, batch 16 per data-parallel group, AdamW) on 4 gloo ranks on
the CPU, laid out as
  hsdp     `fully_shard` per block and on the root over a ("dp_replicate", "dp_shard") = (2, 2)
           mesh
  fsdp-tp  `parallelize_module` (`up` ColwiseParallel, `down` RowwiseParallel) on the tp
           sub-mesh, then `fully_shard` on the dp sub-mesh of ("dp", "tp") = (2, 2)
It runs as `python script.py` and as `python -m nanaudit run -q script.py`, interleaved round
by round (bench_fsdp.launch). Reported, as medians over rounds: rank 0's median step time
after two warm-up steps (wall and process CPU time, the optimizer step and so nanaudit's check
and exchange included), each as a ratio to the plain script, and the collectives each run
issued per step on every process group (each group's sequence number as the script ends).

    python scripts/bench_mesh.py                  # both layouts, 5 rounds x 20 steps
    python scripts/bench_mesh.py --quick          # a smoke run

`--trip N [N ...]`: the time from a trip to the report instead. At step N the last rank's
batch has a zero row under a `sqrt` of each row's length (backward-only: its gradient is NaN
and reaches that rank's own gradients before FSDP's reduce-scatter), and each variant runs the
script to it, interleaved round by round: `plain` (the script alone, stopped after step N),
`run` (`nanaudit run`: every rank replays step N together, in-process) and `rerun` (the same
with `--rerun`: every rank runs the script again from the start). Reported per N: each
variant's whole-launch wall time (median), run / plain, and the localization's own duration
from rank 0's report.

    python scripts/bench_mesh.py --trip 20 200 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import textwrap
from pathlib import Path

from bench_fsdp import launch

SCRIPT = '''
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Block(nn.Module):
    def __init__(self, d, ff):
        super().__init__()
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, d=128, ff=512, layers=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, ff) for _ in range(layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--layout", choices=["hsdp", "fsdp-tp"], default="hsdp")
parser.add_argument("--times")
parser.add_argument("--bad", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = Model()
if args.layout == "hsdp":
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    dp, group = mesh, rank
else:
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp, group = mesh["dp"], mesh["dp"].get_local_rank()
for block in model.blocks:
    fully_shard(block, mesh=dp)
fully_shard(model, mesh=dp)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(group)
times, cpu = [], []
for step in range(args.steps):
    started, started_cpu = time.perf_counter(), time.process_time()
    x = torch.randn(16, 128, generator=g)
    out = model(x)
    loss = (out - x[:, :1]).pow(2).mean()
    if step == args.bad:
        keep = torch.ones(16, 1)
        keep[0] = 0 if rank == world - 1 else 1
        loss = loss + 1e-3 * torch.sqrt((out * keep).pow(2).sum(1)).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - started)
    cpu.append(time.process_time() - started_cpu)
if rank == 0 and args.times:
    groups = {}
    for pg in dist.distributed_c10d._world.pg_map:
        key = ",".join(map(str, dist.get_process_group_ranks(pg)))
        groups[key] = groups.get(key, 0) + pg._get_sequence_number_for_group()
    with open(args.times, "w") as f:
        json.dump({"median_step_s": statistics.median(times[2:]),
                   "median_step_cpu_s": statistics.median(cpu[2:]), "steps": len(times),
                   "collectives": groups}, f)
dist.destroy_process_group()
'''
RANKS = 4


def one_run(script: Path, audited: bool, layout: str, steps: int, folder: Path) -> dict:
    times = folder / "times.json"
    script_args = [str(script), "--steps", str(steps), "--layout", layout, "--times", str(times)]
    argv = (["-m", "nanaudit", "run", "-q", "--json", str(folder / "report.json"),
             *script_args] if audited else script_args)
    launch(argv, RANKS)
    timed = json.loads(times.read_text())
    if audited:
        report = json.loads((folder / "report.json").read_text())
        assert report["status"] == "clean", report.get("error")
    return timed


def bench(script: Path, layout: str, rounds: int, steps: int, folder: Path) -> dict:
    runs: dict = {"plain": [], "nanaudit": []}
    for _ in range(rounds):
        for variant in runs:
            runs[variant].append(one_run(script, variant == "nanaudit", layout, steps, folder))
    result: dict = {}
    for variant, timed in runs.items():
        result[variant] = {
            "step_ms": round(statistics.median(t["median_step_s"] for t in timed) * 1e3, 3),
            "step_cpu_ms": round(statistics.median(t["median_step_cpu_s"] for t in timed) * 1e3,
                                 3),
            "collectives_per_step": {group: round(count / steps, 2) for group, count
                                     in timed[0]["collectives"].items()}}
    plain, audited = result["plain"], result["nanaudit"]
    result["ratio"] = {key: round(audited[key] / plain[key], 3)
                       for key in ("step_ms", "step_cpu_ms")}
    result["added_collectives_per_step"] = {
        group: round(audited["collectives_per_step"].get(group, 0)
                     - plain["collectives_per_step"].get(group, 0), 2)
        for group in sorted(set(audited["collectives_per_step"])
                            | set(plain["collectives_per_step"]))}
    return result


def trip_run(script: Path, variant: str, layout: str, bad: int, folder: Path) -> tuple:
    """(whole-launch seconds, rank 0's localization seconds or None) of one variant."""
    report = folder / "report.json"
    script_args = [str(script), "--steps", str(bad + 1), "--layout", layout, "--bad", str(bad)]
    options = {"plain": None, "run": [], "rerun": ["--rerun"]}[variant]
    if options is None:
        return launch(script_args, RANKS), None
    wall = launch(["-m", "nanaudit", "run", "-q", *options, "--json", str(report),
                   *script_args], RANKS, expect=1)
    body = json.loads(report.read_text())
    finding, run = body["finding"], body["run"]
    assert (finding["step"], finding["cause"], finding["localized_by"]) == (
        bad, "sqrt-domain", "in-process" if variant == "run" else "re-run"), finding
    return wall, run["rerun" if variant == "rerun" else "replay"]["duration_s"]


def trips(script: Path, layout: str, rounds: int, bads: list[int], folder: Path) -> dict:
    """`--trip`: per bad step, each variant's median wall, run / plain, the localization."""
    result: dict = {}
    for bad in bads:
        runs: dict = {"plain": [], "run": [], "rerun": []}
        for _ in range(rounds):
            for variant in runs:
                runs[variant].append(trip_run(script, variant, layout, bad, folder))
        med = {v: round(statistics.median(w for w, _ in r), 2) for v, r in runs.items()}
        result[bad] = {"wall_s": med, "run_over_plain": round(med["run"] / med["plain"], 3),
                       "localization_s": {v: round(statistics.median(d for _, d in r), 3)
                                          for v, r in runs.items() if v != "plain"}}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layout", choices=["hsdp", "fsdp-tp", "both"], default="both")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--trip", type=int, nargs="+", metavar="N",
                        help="time a trip at step N to the report instead (see above)")
    args = parser.parse_args()
    rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
    layouts = ["hsdp", "fsdp-tp"] if args.layout == "both" else [args.layout]
    results: dict = {"ranks": RANKS, "rounds": rounds, "steps": steps}
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        script = folder / "train_mesh.py"
        script.write_text(textwrap.dedent(SCRIPT))
        for layout in layouts:
            results[layout] = (trips(script, layout, rounds, args.trip, folder) if args.trip
                               else bench(script, layout, rounds, steps, folder))
            print(layout, json.dumps(results[layout]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
