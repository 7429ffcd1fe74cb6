"""Benchmark nanaudit on `torch.compile`d training: the per-step cost beside the eager figures.

A training script is written to a temporary folder (no downloads): a transformer encoder or a
tiny MLP, eager, `torch.compile(model)` or `model.compile()`, optionally checked each step by a
`Sentinel`. Each variant is run in this process as `nanaudit run` runs a script, with and
without nanaudit's hooks, interleaved round by round. The script times its own steps after the
warm-up (the compilation), so the table shows the median steady-state step time of each
variant (the process's CPU clock, one intra-op thread by default: a shared machine's load
neither preempts nor spins it), its ratio to the same model run plainly, and dynamo's counters
(frames compiled, graphs, graph breaks), which nanaudit must leave as the plain run has them.

    python scripts/bench_compiled.py                # 5 rounds x 30 steps after 3 warm-up steps
    python scripts/bench_compiled.py --quick        # a smoke run
    python scripts/bench_compiled.py --backend aot_eager --workloads mlp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plain_script import run_plain

from nanaudit.script.auditor import ScriptAuditor
from nanaudit.script.target import ScriptTarget, execute

SCRIPT = '''
import json, os, sys, time
import torch
from torch import nn

workload, how, backend, sentinel_on = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
warmup, steps = int(sys.argv[5]), int(sys.argv[6])
torch.manual_seed(0)
if workload == "transformer":
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 128)
            layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(128, 1000)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))
    model = Net()
    batch = torch.randint(0, 1000, (16, 32))
    target = torch.roll(batch, -1, 1).flatten()
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1), target)
else:
    class Net(nn.Module):         # a class of the user's: dynamo skips torch.nn's own code
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 1)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))
    model = Net()
    batch = torch.randn(16, 16)
    loss_fn = lambda m, b: m(b).pow(2).mean()
if how == "torch.compile":
    model = torch.compile(model, backend=backend)
elif how == "model.compile":
    model.compile(backend=backend)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
sentinel = None
if sentinel_on:
    from nanaudit import Sentinel
    sentinel = Sentinel(model, optimizer, loss_fn=loss_fn)
times = []
for step in range(warmup + steps):
    started = time.process_time()
    loss = loss_fn(model, batch)
    optimizer.zero_grad()
    loss.backward()
    if sentinel is not None:
        sentinel.check(step, batch, loss)
    optimizer.step()
    times.append(time.process_time() - started)
from torch._dynamo.utils import counters
steady = sorted(times[warmup:])
with open(os.environ["BENCH_OUT"], "w") as out:
    json.dump({"step_s": steady[len(steady) // 2], "frames": counters["frames"].get("total", 0),
               "graphs": counters["stats"].get("unique_graphs", 0),
               "graph_breaks": sum(counters["graph_break"].values())}, out)
'''


def run_once(path: Path, argv: list[str], hooked: bool, out: Path) -> dict:
    """One in-process run of the script (as `nanaudit run` runs it when `hooked`), from a
    fresh dynamo; its own steady-state median step time and dynamo's counters."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    os.environ["BENCH_OUT"] = str(out)
    if hooked:
        execute(ScriptTarget(path=str(path), args=tuple(argv)), ScriptAuditor(), 0)
    else:
        run_plain(path, argv)
    return json.loads(out.read_text())


MODES = {"plain": (False, False), "nanaudit run": (True, False), "Sentinel": (False, True)}


def variant(path: Path, folder: Path, workload: str, how: str, backend: str, rounds: int,
            warmup: int, steps: int) -> dict:
    """The plain run, `nanaudit run`'s hooks and a `Sentinel` on one model, interleaved round
    by round; medians over rounds, and each one's ratio to the plain run."""
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode, (hooked, sentinel) in MODES.items():
            argv = [workload, how, backend, "1" if sentinel else "0", str(warmup), str(steps)]
            runs[mode].append(run_once(path, argv, hooked, folder / "out.json"))
    row: dict = {"workload": workload, "model": how, "step_ms": {}, "ratio": {}, "counters": {}}
    for mode, results in runs.items():
        row["step_ms"][mode] = round(statistics.median(r["step_s"] for r in results) * 1e3, 3)
        row["counters"][mode] = {k: results[-1][k] for k in ("frames", "graphs", "graph_breaks")}
        row["ratio"][mode] = round(row["step_ms"][mode] / row["step_ms"]["plain"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--workloads", default="transformer,mlp")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rounds, steps = (1, 5) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(args.threads)
    results: dict = {"machine": f"{platform.machine()} {platform.system()}, "
                                f"{torch.get_num_threads()} threads, torch {torch.__version__}",
                     "backend": args.backend, "rounds": rounds, "steps": steps, "rows": []}
    print(results["machine"], f"backend {args.backend}, {rounds} rounds x {steps} steps")
    print(f"{'workload':<12} {'model':<14} {'plain ms':>9} {'nanaudit run':>13} "
          f"{'Sentinel':>13}  dynamo counters (the same in every mode, or each shown)")
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        path = folder / "train.py"
        path.write_text(textwrap.dedent(SCRIPT))
        for workload in args.workloads.split(","):
            for how in ("eager", "torch.compile", "model.compile"):
                started = time.perf_counter()
                row = variant(path, folder, workload, how, args.backend, rounds, args.warmup,
                              steps)
                results["rows"].append(row)
                ms, ratio, counters = row["step_ms"], row["ratio"], row["counters"]
                same = all(c == counters["plain"] for c in counters.values())
                print(f"{workload:<12} {how:<14} {ms['plain']:>9} "
                      + "".join(f" {ms[m]:>7} {ratio[m]:>5}x" for m in ("nanaudit run",
                                                                         "Sentinel"))
                      + f"  {counters['plain'] if same else counters}"
                      + f"  ({time.perf_counter() - started:.0f} s)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
