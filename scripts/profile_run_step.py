"""Where a clean step's time goes under `nanaudit run`: the loop of `bench_inprocess.py` (no bad
step), its per-step time measured inside the script (steps after a warm-up, the device synced
at both ends), plain and under `nanaudit run`, and under `run` the time spent inside each of
nanaudit's hooks per step; on a GPU the wait for the device at the step's one host read is
given apart (the read's sync: the device still running the step's backward).

    python scripts/profile_run_step.py                   # CPU, width 256, 3,000 steps
    python scripts/profile_run_step.py --device cuda --steps 5000

Each variant runs in its own process, interleaved round by round; medians are given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inprocess import LOOP

ROOT = Path(__file__).resolve().parent.parent
WARM = 200

# The bench loop with no bad step, timing its own steps after the warm-up.
TIMED_LOOP = LOOP.replace("if step == bad:", "if step == -1:").replace(
    "for step in range(bad + 1):\n",
    "import json, os, time\n"
    "def sync():\n"
    "    if device.startswith('cuda'):\n"
    "        torch.cuda.synchronize()\n"
    f"for step in range(bad + 1):\n"
    f"    if step == {WARM}:\n"
    "        sync(); started = time.perf_counter()\n") + (
    "sync()\n"
    f"per_step = (time.perf_counter() - started) / (bad + 1 - {WARM})\n"
    "with open(os.environ['NANAUDIT_PROFILE_OUT'], 'w') as f:\n"
    "    json.dump({'per_step_s': per_step}, f)\n")
assert TIMED_LOOP.count("started") == 2

# `nanaudit run` with each hook's time summed (its own process: `-c` of this).
DRIVER = r'''
import collections, functools, json, os, sys, time
import torch
from nanaudit.script import hooks, step_checks, step_tap
spent, calls = collections.Counter(), collections.Counter()
cuda = sys.argv[-1].startswith("cuda")

def timed(owner, name, label):
    original = getattr(owner, name)
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - started
            calls[label] += 1
    setattr(owner, name, wrapper)

for owner, name in [(hooks.ScriptHooks, "_first_call"), (hooks.ScriptHooks, "_pre_step"),
                    (hooks.ScriptHooks, "_post_step"), (hooks.ScriptHooks, "_loss"),
                    (hooks.ScriptHooks, "_backward_ended"), (step_tap.StepTap, "_returned")]:
    timed(owner, name, name.strip("_"))
original_read = step_checks.read_step

def read_step(*args, **kwargs):
    if cuda:                     # the wait for the device, apart from the read's own work
        started = time.perf_counter()
        torch.cuda.synchronize()
        spent["device wait at the read"] += time.perf_counter() - started
        calls["device wait at the read"] += 1
    started = time.perf_counter()
    try:
        return original_read(*args, **kwargs)
    finally:
        spent["read_step (after the wait)"] += time.perf_counter() - started
        calls["read_step (after the wait)"] += 1
step_checks.read_step = read_step
from nanaudit.__main__ import main
sys.argv = ["nanaudit", "run", "-q", "--json", os.devnull, *sys.argv[1:]]
try:
    main()
finally:
    with open(os.environ["NANAUDIT_PROFILE_OUT"] + ".hooks", "w") as f:
        json.dump({k: [spent[k], calls[k]] for k in spent}, f)
'''


def measure(variant: str, folder: Path, steps: int, width: int, device: str) -> dict:
    out = folder / f"{variant}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               NANAUDIT_PROFILE_OUT=str(out))
    script = [str(folder / "loop.py"), str(steps), str(width), device]
    command = [sys.executable, *script] if variant == "plain" else \
        [sys.executable, "-c", DRIVER, *script]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"{variant} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    hooks = Path(str(out) + ".hooks")
    if hooks.exists():
        result["hooks"] = {k: v[0] / v[1] for k, v in json.loads(hooks.read_text()).items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "run": []}
    with tempfile.TemporaryDirectory(prefix="nanaudit-profile-run-") as name:
        folder = Path(name)
        (folder / "loop.py").write_text(TIMED_LOOP)
        for _ in range(args.rounds):
            for variant in runs:
                runs[variant].append(measure(variant, folder, args.steps, args.width,
                                             args.device))
    plain = statistics.median(r["per_step_s"] for r in runs["plain"]) * 1000
    run = statistics.median(r["per_step_s"] for r in runs["run"]) * 1000
    print(f"{args.device}, width {args.width}, steps {WARM}..{args.steps}: plain {plain:.3f} ms "
          f"a step, run {run:.3f} ms ({run / plain:.3f}x, +{run - plain:.3f} ms)")
    labels = runs["run"][0]["hooks"].keys()
    for label in sorted(labels, key=lambda k: -runs["run"][0]["hooks"][k]):
        median = statistics.median(r["hooks"].get(label, 0.0) for r in runs["run"]) * 1000
        print(f"  {label:28} {median:.4f} ms a call")


if __name__ == "__main__":
    main()
