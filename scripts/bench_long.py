"""Benchmark long runs: 100,000 tiny steps as plain python, under `nanaudit run`, under `scan`.

The step is as small as a step gets (a 4-8-1 MLP, batch 16, SGD, one thread), so what is
measured is nanaudit's fixed cost per step, not the model's. Three variants run the same
model on the same batch, each in its own process, interleaved round by round:

    plain   python tiny_script.py N
    run     python -m nanaudit run -q --json out.json tiny_script.py N
    scan    python -m nanaudit scan -q --json out.json tiny.yaml --steps N

Each variant is also run for a few steps, so that start-up (imports, building the model)
drops out: the per-step cost is (T(N) - T(few)) / (N - few), and the fixed cost is that
minus plain python's. Reported per variant: the median wall time of the N-step runs, the
per-step cost and fixed cost (from wall time, and from the process's CPU time, which a busy
machine disturbs less), the peak RSS of the few-step and of the N-step runs (`os.wait4`'s
rusage of that child: memory is flat when the two are equal) and the JSON report's size.

    python scripts/bench_long.py                    # 100,000 steps, 3 rounds
    python scripts/bench_long.py --steps 20000 --rounds 1
    python scripts/bench_long.py --variants plain,run,run-kg   # run with --keep-going too
    python scripts/bench_long.py --million          # also: one 1,000,000-step run of
                                                    # `run` and `scan` (bounded memory/report)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_inprocess import compile_package

ROOT = Path(__file__).resolve().parent.parent

MODEL = '''
import itertools

import torch
from torch import nn

torch.set_num_threads(1)


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def batches():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    return itertools.repeat((x, y))


def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
'''

SCRIPT = '''
import sys

import torch

from tiny_model import batches, build, loss

steps = int(sys.argv[1])
model = build()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batch = next(iter(batches()))
for step in range(steps):
    value = loss(model, batch)
    optimizer.zero_grad()
    value.backward()
    optimizer.step()
'''

CONFIG = '''
model: tiny_model.py:build
data: tiny_model.py:batches
loss: tiny_model.py:loss
optimizer: {class: torch.optim.SGD, lr: 0.01}
seed: 0
'''


def command(variant: str, folder: Path, steps: int) -> list[str]:
    report = str(folder / f"{variant}.json")
    if variant == "plain":
        return [sys.executable, str(folder / "tiny_script.py"), str(steps)]
    if variant in ("run", "run-kg"):     # run-kg: with --keep-going (clean steps: no cost)
        keep = ["--keep-going"] if variant == "run-kg" else []
        return [sys.executable, "-m", "nanaudit", "run", "-q", *keep, "--json", report,
                str(folder / "tiny_script.py"), str(steps)]
    return [sys.executable, "-m", "nanaudit", "scan", "-q", "--json", report,
            str(folder / "tiny.yaml"), "--steps", str(steps)]


def measure(variant: str, folder: Path, steps: int) -> dict:
    """One run in its own process: wall and CPU seconds, peak RSS (MB), report size (bytes)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    report = folder / f"{variant}.json"
    report.unlink(missing_ok=True)
    started = time.perf_counter()
    child = subprocess.Popen(command(variant, folder, steps), cwd=folder, env=env,
                             stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{variant} ({steps} steps) exited with {child.returncode}")
    result = {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
              "peak_rss_mb": usage.ru_maxrss / 1024}      # Linux: KiB
    if report.exists():
        result["report_bytes"] = report.stat().st_size
        body = json.loads(report.read_text())
        summary = body.get("timeline_summary") or {}
        result["kept"], result["summarized"] = len(body["timeline"]), summary.get("steps", 0)
        result["steps_run"] = body["steps_run"]
    return result


def bench(folder: Path, variants: list[str], steps: int, few: int, rounds: int) -> dict:
    runs: dict = {v: {"long": [], "few": []} for v in variants}
    for round_ in range(rounds):
        for variant in variants:
            runs[variant]["few"].append(measure(variant, folder, few))
            runs[variant]["long"].append(measure(variant, folder, steps))
            last = runs[variant]["long"][-1]
            print(f"  round {round_ + 1}: {variant:6s} {last['wall_s']:7.1f} s", flush=True)
    table = {}
    for variant in variants:
        long, short = runs[variant]["long"], runs[variant]["few"]
        row = {"wall_s": statistics.median(r["wall_s"] for r in long),
               "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in long),
               "peak_rss_few_mb": statistics.median(r["peak_rss_mb"] for r in short),
               "report_bytes": long[-1].get("report_bytes"), "kept": long[-1].get("kept"),
               "summarized": long[-1].get("summarized")}
        for clock in ("wall_s", "cpu_s"):
            per_step = (statistics.median(r[clock] for r in long)
                        - statistics.median(r[clock] for r in short)) / (steps - few)
            row[f"step_ms_{clock[:-2]}"] = per_step * 1e3
        table[variant] = row
    for variant in variants:
        for clock in ("wall", "cpu"):
            table[variant][f"fixed_ms_{clock}"] = (table[variant][f"step_ms_{clock}"]
                                                   - table["plain"][f"step_ms_{clock}"])
    return table


def show(table: dict, steps: int) -> None:
    print(f"\n{steps} steps | wall (median) | per step wall / cpu | fixed cost wall / cpu "
          f"| peak RSS (few steps -> {steps}: flat when equal) "
          f"| JSON report (entries kept + steps summarized)")
    for variant, row in table.items():
        report = (f"{row['report_bytes'] / 1024:.0f} KiB ({row['kept']} + {row['summarized']})"
                  if row.get("report_bytes") else "-")
        print(f"{variant:6s} | {row['wall_s']:.1f} s | {row['step_ms_wall']:.3f} / "
              f"{row['step_ms_cpu']:.3f} ms | {row['fixed_ms_wall']:.3f} / "
              f"{row['fixed_ms_cpu']:.3f} ms | {row['peak_rss_few_mb']:.0f} -> "
              f"{row['peak_rss_mb']:.0f} MB | {report}")
    if "run" in table and "scan" in table:
        run, scan = table["run"], table["scan"]
        ratios = [f"{run[f'fixed_ms_{c}'] / scan[f'fixed_ms_{c}']:.2f}x ({c})"
                  for c in ("wall", "cpu") if scan[f"fixed_ms_{c}"] > 0]
        print("run's fixed cost / scan's: " + ", ".join(ratios))


def million(folder: Path, steps: int) -> None:
    """One run of each nanaudit variant at `steps` steps: memory and report stay bounded."""
    print(f"\n{steps} steps, once each")
    for variant in ("run", "scan"):
        r = measure(variant, folder, steps)
        print(f"{variant:5s} | {r['wall_s']:.0f} s | peak RSS {r['peak_rss_mb']:.0f} MB | JSON "
              f"{r['report_bytes'] / 1024:.0f} KiB: {r['kept']} entries kept + "
              f"{r['summarized']} steps summarized = {r['steps_run']} steps run", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--few", type=int, default=100, help="the short run (start-up cost)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="plain,run,scan")
    parser.add_argument("--million", action="store_true",
                        help="also one 1,000,000-step run of `run` and `scan`")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "plain" not in variants:
        variants.insert(0, "plain")
    print(f"{platform.machine()} {platform.system()}, python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    compile_package()            # as installed: no variant compiles nanaudit from source
    with tempfile.TemporaryDirectory(prefix="nanaudit-bench-long-") as name:
        folder = Path(name)
        (folder / "tiny_model.py").write_text(MODEL)
        (folder / "tiny_script.py").write_text(SCRIPT)
        (folder / "tiny.yaml").write_text(CONFIG)
        show(bench(folder, variants, args.steps, args.few, args.rounds), args.steps)
        if args.million:
            million(folder, 1_000_000)


if __name__ == "__main__":
    main()
