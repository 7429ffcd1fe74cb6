"""Benchmark `nanaudit run`'s localization at the trip: the time to the report does not grow
with the bad step's number.

A model-dominated loop (an MLP; at the default `--width 256` its plain step takes about 0.8 ms
of CPU on one thread, under the issue's "a plain step of a few ms": `--width 512`, about 2.9 ms,
is that size; both are reported, the small step being where the per-step check shows most)
makes a NaN at step N (a backward-only `sqrt` of an all-zero row: the gradient check trips).
Each variant runs in its own process, interleaved round by round:

    plain    python loop.py N              (the script alone, up to and including step N)
    run      python -m nanaudit run -q --json out.json loop.py N
    rerun    the same with --rerun (the re-run from the start, as before in-process replay)

Reported per N: the median wall time of each, run / plain, the seconds `run` spends past the
plain script (the trip to the report, plus the checks' cost on the way), and the in-process
replay's own duration from the JSON report.

    python scripts/bench_inprocess.py                       # N = 1,000 10,000 100,000
    python scripts/bench_inprocess.py --steps 1000 10000 --rounds 1 --no-rerun-variant
    python scripts/bench_inprocess.py --width 512            # a plain step of a few ms
    python scripts/bench_inprocess.py --device cuda          # the same loop on the GPU
    python scripts/bench_inprocess.py --fsdp --steps 100000 --rounds 1 --no-rerun-variant \
        --no-plain                                           # `run` alone: the localization

`--producer`: a data-code producer instead: the loop's own standardization of each batch
`(raw - raw.mean(0)) / raw.std(0)` divides 0 by 0 at step N (a constant feature), so the batch is
non-finite before the model sees it and only a re-run of the script's data code names the op.
Its variants: `plain`; `run` (the re-run stands in for the model before step N); `full` (the
same with the model computed, ScriptOptions(skip_model=False), as before). CPU seconds are
given next to the wall time: on a loaded machine they are the steadier figure.

`--ddp`: the same loop under DDP on two gloo ranks, every variant launched by torchrun
(`--standalone --nproc-per-node 2`); the zero row is in rank 1's batch alone, so the value is
rank 1's own (its gradients before the all-reduce), and `run` replays rank 1's step on its
local module while rank 0 waits for the finding.

`--fsdp`: the same under FSDP2 (`fully_shard` on each Linear and the root, over a 1-D gloo mesh
of two ranks); the value is rank 1's own gradients before the reduce-scatter, and `run` has
every rank replay the step together (its all-gathers and reduce-scatters need both).

`--zero 1|2|3`: the same under DeepSpeed ZeRO at that stage (`deepspeed.initialize` with the
loop's SGD, `engine.backward`, `engine.step`; needs deepspeed): the value is rank 1's own
gradients before DeepSpeed reduces them; plain DeepSpeed skips step N on its overflow, and `run`
has rank 1 replay its step on the engine's module (ZeRO-1/2; ZeRO-3 is re-run).

`--error` (with `--ddp`): an error trip instead: the loop takes the log of each row's squared
length, rank 1's zero row makes it -inf at step N, and the script's own `assert
torch.isfinite(loss)` raises there while rank 0 waits in DDP's all-reduce; `run` has rank 1
replay its window alone and hand the finding to rank 0 (script/error_ranks.py). `plain` is
the same loop without the zero row, run to the end of step N (a raising plain script's time is
mostly torchrun stopping the rank blocked in the all-reduce); no --rerun variant (the ranks
cannot re-run together while one is blocked in a collective).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
bad, width, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-8)
x = torch.randn(64, 64, device=device)
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

# The data-code producer: the same model, a fresh batch from the loop's own generator each step,
# standardized by the loop; at step N a constant feature makes its std 0.
PRODUCER_LOOP = LOOP.split("x = torch.randn(64, 64")[0] + '''g = torch.Generator().manual_seed(0)
for step in range(bad + 1):
    raw = torch.randn(64, 64, generator=g).to(device)
    if step == bad:
        raw[:, 7] = 3.0
    batch = (raw - raw.mean(0)) / raw.std(0)
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''

# `full`: `nanaudit run` with the producer's re-run computing the model (no CLI flag for it).
FULL = ("import sys; from pathlib import Path; from nanaudit.commands.run import run_script; "
        "from nanaudit.report.json import JsonRenderer; "
        "from nanaudit.script.target import ScriptOptions, ScriptTarget; "
        "r = run_script(ScriptTarget(path=sys.argv[2], args=tuple(sys.argv[3:])), "
        "ScriptOptions(skip_model=False)); Path(sys.argv[1]).write_text(JsonRenderer().render(r))")

# The loop's loss is linear in the output, so its weights drift until the forward overflows, after
# about 1/lr steps (near step 99,000 at lr 1e-6): 1e-8 keeps 100,000 steps finite but the bad one.

# The DDP loop: the same model, step and batch on each rank, rank 1's row 5 zero at step N.
DDP_LOOP = LOOP.replace("torch.manual_seed(0)\n", """torch.manual_seed(0)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
rank = dist.get_rank()
""").replace("optimizer = torch.optim.SGD(model.parameters()",
             "model = DistributedDataParallel(model)\n"
             "optimizer = torch.optim.SGD(model.parameters()").replace(
    "if step == bad:", "if step == bad and rank == 1:") + (
    # left to the interpreter's exit, gloo's teardown aborted a rank now and then (SIGABRT)
    "dist.destroy_process_group()\n")

# The error-trip loop: the DDP loop whose loss code takes a log that rank 1's zero row makes
# -inf at step N, and asserts its loss is finite.
ERROR_LOOP = DDP_LOOP.replace(
    "    length = torch.sqrt((batch * batch).sum(1, keepdim=True) + 0 * out)\n"
    "    loss = (out * length).mean()\n",
    "    length = torch.log((batch * batch).sum(1, keepdim=True) + 0 * out)\n"
    "    loss = (out * length).mean()\n"
    "    assert torch.isfinite(loss), 'loss diverged'\n")
assert ERROR_LOOP != DDP_LOOP

# The FSDP2 loop: the DDP loop with each Linear and the root sharded instead of DDP's wrapper.
FSDP_LOOP = DDP_LOOP.replace(
    "from torch.nn.parallel import DistributedDataParallel\n",
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.fsdp import fully_shard\n").replace(
    "model = DistributedDataParallel(model)\n",
    "mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))\n"
    "for layer in model:\n"
    "    if isinstance(layer, nn.Linear):\n"
    "        fully_shard(layer, mesh=mesh)\n"
    "fully_shard(model, mesh=mesh)\n")


# The DeepSpeed loop: the DDP loop with DeepSpeed's engine instead of DDP's wrapper (ZeRO stage
# ZERO_STAGE, the script's own SGD), `engine.backward` and `engine.step`; rank 1's zero row makes
# DeepSpeed skip step N on an overflow in plain, and makes `run` trip there.
DEEPSPEED_LOOP = DDP_LOOP.replace(
    "from torch.nn.parallel import DistributedDataParallel\n"
    "dist.init_process_group(\"gloo\")\n",
    "import deepspeed\n"
    "deepspeed.init_distributed(dist_backend=\"gloo\")\n").replace(
    "model = DistributedDataParallel(model)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=1e-8)\n",
    "optimizer = torch.optim.SGD(model.parameters(), lr=1e-8)\n"
    "model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={\n"
    "    'train_micro_batch_size_per_gpu': 64, 'zero_allow_untested_optimizer': True,\n"
    "    'zero_optimization': {'stage': ZERO_STAGE}})\n").replace(
    "    optimizer.zero_grad()\n    loss.backward()\n    optimizer.step()\n",
    "    model.backward(loss)\n    model.step()\n")
assert DEEPSPEED_LOOP.count("deepspeed.") == 2 and "model.step()" in DEEPSPEED_LOOP


def command(variant: str, folder: Path, bad: int, width: int, ddp: bool,
            device: str = "cpu") -> list[str]:
    loop = "plain.py" if variant == "plain" and (folder / "plain.py").exists() else "loop.py"
    script = [str(folder / loop), str(bad), str(width), device]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2"] if ddp else [sys.executable])
    if variant == "plain":
        return [*launch, *script]
    if variant == "full":
        return [sys.executable, "-c", FULL, str(folder / "full.json"), *script]
    flags = ["--rerun"] if variant == "rerun" else []
    return [*launch, "-m", "nanaudit", "run", "-q", *flags, "--json",
            str(folder / f"{variant}.json"), *script]


def measure(variant: str, folder: Path, bad: int, width: int, ddp: bool,
            device: str = "cpu", producer: bool = False, error: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    started, cpu = time.perf_counter(), _children_cpu()
    code = subprocess.run(command(variant, folder, bad, width, ddp, device), cwd=folder, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          check=False).returncode
    result: dict = {"wall_s": time.perf_counter() - started, "cpu_s": _children_cpu() - cpu}
    expected = 1 if variant in ("run", "rerun") else 0
    if code != expected:
        raise SystemExit(f"{variant} (bad step {bad}) exited with {code}, not {expected}")
    if variant != "plain":
        report = json.loads((folder / f"{variant}.json").read_text())
        finding, run = report["finding"], report["run"]
        if producer:
            assert (finding["step"], finding["where"], finding["op"]) == (
                bad, "input", "aten.div.Tensor"), finding
            rerun = run["rerun"]
            assert variant != "run" or rerun.get("model_skipped") is True, rerun
            result["stood_in"] = rerun.get("stood_in")
        elif error:
            assert (finding["step"], finding["op"]) == (bad, "aten.log.default"), finding
        else:
            assert finding["step"] == bad and finding["forward_op"] == "aten.sqrt.default", \
                finding
        assert not ddp or finding["rank"] == 1, finding
        result["localized_by"] = finding.get("localized_by")
        result["replay_s"] = (run.get("replay") or {}).get("duration_s")
        result["rerun_s"] = (run.get("rerun") or {}).get("duration_s")
        result["first_run_s"] = (run.get("first_run") or {}).get("duration_s")  # a peer: none
        if error:       # the raising rank's report: its time from the raise to its report
            own = json.loads((folder / f"{variant}.rank1.json").read_text())
            result["after_trip_s"] = own["duration_s"] - own["run"]["first_run"]["duration_s"]
    return result


def compile_package() -> None:
    """nanaudit's modules byte-compiled before any variant runs, as a pip install leaves them: a
    checkout run with PYTHONDONTWRITEBYTECODE=1 (or never run before) would compile its ~240
    modules from source in every `run` process, about 0.15 s of CPU that no installed copy pays
    and that the plain script, whose torch is installed compiled, does not pay either."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "nanaudit")],
                   stdout=subprocess.DEVNULL, check=True)


def _plain_figures(runs: dict[str, list[dict]], bad: int) -> tuple[float, float]:
    """The plain variant's median wall and CPU seconds, printed (0, 0 when it was left out)."""
    if "plain" not in runs:
        print(f"bad step {bad:,}: no plain variant (--no-plain)")
        return 0.0, 0.0
    plain = statistics.median(r["wall_s"] for r in runs["plain"])
    plain_cpu = statistics.median(r["cpu_s"] for r in runs["plain"])
    print(f"bad step {bad:,}: plain {plain:.2f} s, {plain_cpu:.2f} s CPU "
          f"({plain / (bad + 1) * 1000:.2f} ms a step, with start-up)")
    return plain, plain_cpu


def _children_cpu() -> float:
    """The CPU seconds (user and system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=256,
                        help="the MLP's hidden width (256: a 0.8 ms CPU step; 512: a few ms, "
                        "the issue's model-dominated loop)")
    parser.add_argument("--no-rerun-variant", action="store_true",
                        help="leave out the --rerun variant (it runs the script twice)")
    parser.add_argument("--ddp", action="store_true",
                        help="the loop under DDP on two gloo ranks, launched by torchrun")
    parser.add_argument("--fsdp", action="store_true",
                        help="the loop under FSDP2 on two gloo ranks, launched by torchrun")
    parser.add_argument("--device", default="cpu", help="where the loop runs (cuda: the GPU; "
                        "the plain script then syncs only at its end, `run` once a step)")
    parser.add_argument("--producer", action="store_true",
                        help="a data-code producer (the loop's standardization) instead")
    parser.add_argument("--no-plain", action="store_true",
                        help="leave out the plain variant: the localization at the trip alone "
                             "(100,000 steps of FSDP2 on gloo take hours on a CPU per variant)")
    parser.add_argument("--zero", type=int, choices=[1, 2, 3],
                        help="the loop under DeepSpeed ZeRO at this stage on two gloo ranks "
                             "(needs deepspeed; ZeRO-3 is localized by the re-run)")
    parser.add_argument("--error", action="store_true",
                        help="with --ddp: rank 1's script asserts on its -inf loss (an error "
                             "trip)")
    args = parser.parse_args()
    if args.error and not args.ddp:
        parser.error("--error goes with --ddp")
    ranks = args.ddp or args.fsdp or args.zero is not None
    other = "full" if args.producer else "rerun"
    variants = ([] if args.no_plain else ["plain"]) + ["run"] + (
        [] if args.no_rerun_variant or args.error else [other])
    loop = (PRODUCER_LOOP if args.producer else FSDP_LOOP if args.fsdp else
            DEEPSPEED_LOOP.replace("ZERO_STAGE", str(args.zero)) if args.zero else
            ERROR_LOOP if args.error else DDP_LOOP if args.ddp else LOOP)
    compile_package()
    with tempfile.TemporaryDirectory(prefix="nanaudit-bench-inprocess-") as name:
        folder = Path(name)
        (folder / "loop.py").write_text(loop)
        if args.error:      # the plain run: the same steps, no zero row, nothing raised
            (folder / "plain.py").write_text(loop.replace("batch[5] = 0.0", "pass"))
        for bad in args.steps:
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for variant in variants:
                    runs[variant].append(measure(variant, folder, bad, args.width, ranks,
                                                 args.device, args.producer, args.error))
            plain, plain_cpu = _plain_figures(runs, bad)
            for variant in variants[0 if args.no_plain else 1:]:
                wall = statistics.median(r["wall_s"] for r in runs[variant])
                cpu = statistics.median(r["cpu_s"] for r in runs[variant])
                last = runs[variant][-1]
                took = last["rerun_s"] if args.producer or variant == "rerun" else \
                    last["replay_s"]
                stood = (f", {last['stood_in']} model calls stood in for"
                         if last.get("stood_in") else "")
                against = (f" = {wall / plain:.2f}x plain, +{wall - plain:.2f} s; CPU "
                           f"{cpu:.2f} s = {cpu / plain_cpu:.2f}x plain" if plain else
                           f"; CPU {cpu:.2f} s")
                print(f"  {variant:6} {wall:.2f} s{against}; named by {last['localized_by']} "
                      f"(its localization {took} s{stood}; first run {last['first_run_s']} s)")
                if "after_trip_s" in last:
                    print(f"         rank 1 from its raise to its report: "
                          f"{statistics.median(r['after_trip_s'] for r in runs[variant]):.3f} s")


if __name__ == "__main__":
    main()
