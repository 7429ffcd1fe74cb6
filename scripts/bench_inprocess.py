"""Benchmark `nanaudit run`'s localization at the trip: the time to the report does not grow
with the bad step's number.

A model-dominated loop (an MLP whose plain step takes a few ms on one thread) makes a NaN at
step N (a backward-only `sqrt` of an all-zero row: the gradient check trips). Each variant runs
in its own process, interleaved round by round:

    plain    python loop.py N              (the script alone, up to and including step N)
    run      python -m nanaudit run -q --json out.json loop.py N
    rerun    the same with --rerun (the re-run from the start, as before in-process replay)

Reported per N: the median wall time of each, run / plain, the seconds `run` spends past the
plain script (the trip to the report, plus the checks' cost on the way), and the in-process
replay's own duration from the JSON report.

    python scripts/bench_inprocess.py                       # N = 1,000 10,000 100,000
    python scripts/bench_inprocess.py --steps 1000 10000 --rounds 1 --no-rerun-variant
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LOOP = '''
import sys

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)
bad, width = int(sys.argv[1]), int(sys.argv[2])
model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
x = torch.randn(64, 64)
for step in range(bad + 1):
    batch = x.clone()
    if step == bad:
        batch[5] = 0.0
    out = model(batch)
    length = torch.sqrt((batch * batch).sum(1, keepdim=True) + 0 * out)
    loss = (out * length).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''


def command(variant: str, folder: Path, bad: int, width: int) -> list[str]:
    script = [str(folder / "loop.py"), str(bad), str(width)]
    if variant == "plain":
        return [sys.executable, *script]
    flags = ["--rerun"] if variant == "rerun" else []
    return [sys.executable, "-m", "nanaudit", "run", "-q", *flags, "--json",
            str(folder / f"{variant}.json"), *script]


def measure(variant: str, folder: Path, bad: int, width: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.perf_counter()
    code = subprocess.run(command(variant, folder, bad, width), cwd=folder, env=env,
                          stdout=subprocess.DEVNULL, check=False).returncode
    result: dict = {"wall_s": time.perf_counter() - started}
    expected = 0 if variant == "plain" else 1
    if code != expected:
        raise SystemExit(f"{variant} (bad step {bad}) exited with {code}, not {expected}")
    if variant != "plain":
        report = json.loads((folder / f"{variant}.json").read_text())
        finding, run = report["finding"], report["run"]
        assert finding["step"] == bad and finding["forward_op"] == "aten.sqrt.default", finding
        result["localized_by"] = finding.get("localized_by")
        result["replay_s"] = (run.get("replay") or {}).get("duration_s")
        result["rerun_s"] = (run.get("rerun") or {}).get("duration_s")
        result["first_run_s"] = run["first_run"]["duration_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=256, help="the MLP's hidden width")
    parser.add_argument("--no-rerun-variant", action="store_true",
                        help="leave out the --rerun variant (it runs the script twice)")
    args = parser.parse_args()
    variants = ["plain", "run"] + ([] if args.no_rerun_variant else ["rerun"])
    with tempfile.TemporaryDirectory(prefix="nanaudit-bench-inprocess-") as name:
        folder = Path(name)
        (folder / "loop.py").write_text(LOOP)
        for bad in args.steps:
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for variant in variants:
                    runs[variant].append(measure(variant, folder, bad, args.width))
            plain = statistics.median(r["wall_s"] for r in runs["plain"])
            print(f"bad step {bad:,}: plain {plain:.2f} s ({plain / (bad + 1) * 1000:.2f} ms a "
                  f"step, with start-up)")
            for variant in variants[1:]:
                wall = statistics.median(r["wall_s"] for r in runs[variant])
                last = runs[variant][-1]
                took = last["replay_s"] if variant == "run" else last["rerun_s"]
                print(f"  {variant:6} {wall:.2f} s = {wall / plain:.2f}x plain, "
                      f"+{wall - plain:.2f} s; named by {last['localized_by']} "
                      f"(its localization {took} s; first run {last['first_run_s']} s)")


if __name__ == "__main__":
    main()
