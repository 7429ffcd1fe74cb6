"""Where `scan`'s clean step spends its host time: one of `bench.py`'s workloads run as a plain
loop and under nanaudit's step loop, each under `torch.profiler` for a few steps after a
warm-up, and the ops (and Python functions of nanaudit) whose host time grows the most per
step, with each variant's per-step wall time. On a launch-bound GPU step every op nanaudit
issues is host time the device waits for; this names them.

    python scripts/profile_scan_step.py --device cuda --workload "transformer (3M)"
    python scripts/profile_scan_step.py --steps 5              # CPU, a smoke run
"""

from __future__ import annotations

import argparse
import collections
import time

import bench
import torch
from torch.profiler import ProfilerActivity, profile


def _profiled(variant: str, model, opt, loss, batches, device) -> tuple[dict, float]:
    """{op or function: (host µs per step, calls per step)}, and the wall ms per step."""
    run = bench.VARIANTS[variant]
    run(model, opt, loss, batches[:2], device)             # warm-up
    bench._sync(device)
    started = time.perf_counter()
    run(model, opt, loss, batches, device)
    wall = (time.perf_counter() - started) / len(batches) * 1e3
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities, with_stack=False) as prof:
        run(model, opt, loss, batches, device)
    table: dict = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        table[event.key][0] += event.self_cpu_time_total / len(batches)
        table[event.key][1] += event.count / len(batches)
    return dict(table), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer (3M)", choices=list(bench.WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, make_batch, loss = bench.WORKLOADS[args.workload]()
    model.to(args.device)
    opt = bench.make_optimizer(model, "fused")
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(args.steps)]
    plain, plain_ms = _profiled("plain", model, opt, loss, batches, args.device)
    scan, scan_ms = _profiled("nanaudit", model, opt, loss, batches, args.device)
    print(f"{args.workload} on {args.device}: plain {plain_ms:.3f} ms a step, scan "
          f"{scan_ms:.3f} ms (+{scan_ms - plain_ms:.3f} ms)")
    added = {key: (us - plain.get(key, [0.0, 0])[0], calls - plain.get(key, [0.0, 0])[1])
             for key, (us, calls) in scan.items()}
    total = sum(us for us, _ in added.values())
    print(f"host time added per step by ops and profiled functions: {total / 1e3:.3f} ms")
    for key, (us, calls) in sorted(added.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {us:9.1f} us  {calls:7.1f} calls  {key}")


if __name__ == "__main__":
    main()
