"""Benchmark `nanaudit run` on an FSDP2 script under torchrun: what the checks add to a step.

A training script is written to a temporary folder (no downloads): a small transformer encoder
(~1M parameters, batch 8 x 32 tokens per rank, AdamW) sharded with FSDP2 as torchtitan
shards it (`fully_shard` on each encoder layer, then the root), 2 ranks on gloo, CPU. It runs
as `python script.py` and as `python -m nanaudit run -q script.py`, each rank launched with
torchrun's environment variables, the two variants interleaved round by round. Reported: the
median over rounds of the whole process (launch to the last rank's exit) and of the median step
time (rank 0 times each step after two warm-up steps, the optimizer step and so nanaudit's
check, exchange included), each as a ratio to the plain script; the step's process CPU time
too, which a machine shared with other jobs disturbs less than its wall time.

    python scripts/bench_fsdp.py                 # 5 rounds x 20 steps
    python scripts/bench_fsdp.py --quick         # a smoke run
    python scripts/bench_fsdp.py --mp bf16       # MixedPrecisionPolicy(param_dtype=bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Encoder(nn.Module):
    def __init__(self, vocab=1000, d=128, layers=4, heads=4, ff=512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--mp", choices=["fp32", "bf16"], default="fp32")
parser.add_argument("--times")
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = Encoder()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if args.mp == "bf16" else None,
                              reduce_dtype=torch.float32 if args.mp == "bf16" else None)
for layer in model.encoder.layers:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(rank)
times, cpu = [], []
for step in range(args.steps):
    started, started_cpu = time.perf_counter(), time.process_time()
    tokens = torch.randint(0, 1000, (8, 32), generator=g)
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - started)
    cpu.append(time.process_time() - started_cpu)
if rank == 0 and args.times:
    with open(args.times, "w") as f:
        json.dump({"median_step_s": statistics.median(times[2:]),
                   "median_step_cpu_s": statistics.median(cpu[2:]), "steps": len(times)}, f)
dist.destroy_process_group()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list, nproc: int, timeout_s: float = 600, expect: int = 0) -> float:
    """Run `python ARGV` as `nproc` ranks (torchrun's environment); seconds to the last exit.
    A rank that exits other than `expect` is an error."""
    port = _free_port()
    started = time.perf_counter()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(nproc), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(nproc), "PYTHONPATH": str(ROOT)}
        procs.append(subprocess.Popen([sys.executable, *argv], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != expect:
            raise RuntimeError(f"a rank exited {proc.returncode}: {err.decode()[-2000:]}")
    return time.perf_counter() - started


def one_run(script: Path, audited: bool, steps: int, mp: str, nproc: int,
            folder: Path) -> tuple[float, float, float]:
    """(whole-process seconds, rank 0's median step seconds, wall and CPU) of one run."""
    times = folder / "times.json"
    script_args = [str(script), "--steps", str(steps), "--mp", mp, "--times", str(times)]
    argv = (["-m", "nanaudit", "run", "-q", "--json", str(folder / "report.json"),
             *script_args] if audited else script_args)
    wall = launch(argv, nproc)
    timed = json.loads(times.read_text())
    if audited:
        report = json.loads((folder / "report.json").read_text())
        assert report["status"] == "clean", report.get("error")
    return wall, timed["median_step_s"], timed["median_step_cpu_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mp", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rounds, steps = (2, 4) if args.quick else (args.rounds, args.steps)
    import torch
    results: dict = {"machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} "
                                f"cpus, torch {torch.__version__}",
                     "workload": f"FSDP2 encoder, {args.nproc} ranks (gloo, CPU), {steps} "
                                 f"steps, {args.mp}", "rounds": rounds}
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        script = folder / "train_fsdp.py"
        script.write_text(textwrap.dedent(SCRIPT))
        one_run(script, False, 3, args.mp, args.nproc, folder)       # warm-up: disk caches
        runs: dict = {"plain": [], "nanaudit": []}
        for _ in range(rounds):
            for variant in runs:
                runs[variant].append(one_run(script, variant == "nanaudit", steps, args.mp,
                                             args.nproc, folder))
    for variant, values in runs.items():
        results[variant] = {"process_s": round(statistics.median(v[0] for v in values), 3),
                            "step_ms": round(statistics.median(v[1] for v in values) * 1e3, 3),
                            "step_cpu_ms": round(statistics.median(v[2] for v in values) * 1e3,
                                                 3),
                            "all": values}
    plain, audited = results["plain"], results["nanaudit"]
    results["ratio"] = {key: round(audited[key] / plain[key], 3)
                        for key in ("process_s", "step_ms", "step_cpu_ms")}
    for key in ("workload", "plain", "nanaudit", "ratio"):
        shown = results[key]
        print(key, {k: v for k, v in shown.items() if k != "all"}
              if isinstance(shown, dict) else shown)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
