"""Benchmark nanaudit's sentinels against a plain training loop and torch.autograd.detect_anomaly.

Workloads are built here (no downloads): a transformer encoder (~3M parameters, batch 16 x 64
tokens), a CNN on 32x32 images, an MLP and a tiny MLP whose step is mostly fixed cost; on CUDA
also an 8-layer d=768 transformer (batch 32 x 256, ~80 ms per step on an H100). `--sizes`
sweeps the transformer over ~1M, 10M and 50M parameters. Variants run the same steps on the
same batches with the same optimizer (fused SGD unless `--optimizer foreach|fused-adam`),
interleaved round by round in one process; the table shows each variant's median step time
over rounds as a ratio to the plain loop, and the fixed cost per step in ms. nanaudit runs in
its default read mode (deferred on CUDA with a fused optimizer, sync on the CPU) and in each
mode explicitly; the host syncs per step of each are counted (nanaudit's own count, and on
CUDA torch's sync debug mode). `--processes N` adds whole-process ratios: N interleaved fresh
processes per variant, timed from start to exit. Also reported: the replay (localization) time
of one bad step as a multiple of a plain step, the replays sample isolation used, and the
extra memory.

    python scripts/bench.py                 # the CPU workloads
    python scripts/bench.py --sizes         # overhead against model size
    python scripts/bench.py --quick         # a smoke run in well under a minute
    python scripts/bench.py --keep-going    # also scan --keep-going's loop on clean steps
    python scripts/bench.py --keep-going --optimizer fused-adam   # ... with a fused Adam
    python scripts/bench.py --device cuda --processes 4 --json bench-cuda.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nanaudit.config.schema import WatchOptions
from nanaudit.report.bad_steps import MAX_BAD_STEPS, BadStepLog
from nanaudit.report.model import jsonable
from nanaudit.run.loop import run_steps
from nanaudit.run.session import Session
from nanaudit.run.step import RngState, ScanOutcome, StepState, Trip

# --- workloads ------------------------------------------------------------------------------

class Encoder(nn.Module):
    def __init__(self, vocab=1000, d=256, layers=4, heads=4, ff=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def transformer(d=256, layers=4, ff=1024, batch=16, seq=64, vocab=1000):
    model = Encoder(vocab, d, layers, max(1, d // 64), ff)

    def make_batch(g):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)

    def loss(model, b):
        logits = model(b[0])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1))
    return model, make_batch, loss


def cnn(batch=32):
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 10))

    def make_batch(g):
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,),
                                                                         generator=g)

    def loss(model, b):
        return nn.functional.cross_entropy(model(b[0]), b[1])
    return model, make_batch, loss


def mlp(batch=64, width=512, features=256):
    model = nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, 10))

    def make_batch(g):
        return (torch.randn(batch, features, generator=g),
                torch.randint(0, 10, (batch,), generator=g))

    def loss(model, b):
        return nn.functional.cross_entropy(model(b[0]), b[1])
    return model, make_batch, loss


def tiny_mlp():
    """A step of a few hundred microseconds: what is left is nanaudit's fixed cost per step."""
    return mlp(batch=16, width=32, features=32)


SIZES = {"1M": dict(d=128, layers=4, ff=512), "10M": dict(d=384, layers=6, ff=1536),
         "50M": dict(d=768, layers=7, ff=3072)}
# The GPU target of issue 19: ~80 ms per step on one H100.
GPU_TARGET = dict(d=768, layers=8, ff=3072, batch=32, seq=256)
WORKLOADS = {"transformer (3M)": lambda: transformer(), "cnn 32x32": cnn, "mlp": mlp,
             "tiny mlp": tiny_mlp,
             "transformer 8x768": lambda: transformer(**GPU_TARGET)}
CPU_WORKLOADS = ("transformer (3M)", "cnn 32x32", "mlp", "tiny mlp")
CUDA_WORKLOADS = ("transformer 8x768", "transformer (3M)", "cnn 32x32", "tiny mlp")


# --- variants: one function per way of running `steps` training steps -----------------------

def _to(batch, device):
    return tuple(t.to(device) for t in batch)


def plain(model, opt, loss, batches, device, anomaly=False):
    context = torch.autograd.detect_anomaly() if anomaly else nullcontext()
    with context:
        for b in batches:
            b = _to(b, device)
            opt.zero_grad(set_to_none=True)
            loss(model, b).backward()
            opt.step()
    _sync(device)


def detect_anomaly(model, opt, loss, batches, device):
    plain(model, opt, loss, batches, device, anomaly=True)


def hook_checker(model, opt, loss, batches, device):
    """The Hugging Face DebugUnderflowOverflow pattern: per-module hooks, .item() per tensor."""
    def check(module, inputs, output):
        for t in (output if isinstance(output, tuple) else (output,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.detach().abs().max().item()
                t.detach().abs().min().item()
                bool(torch.isnan(t).any().item())
                bool(torch.isinf(t).any().item())
    handles = [m.register_forward_hook(check) for m in model.modules()]
    try:
        plain(model, opt, loss, batches, device)
    finally:
        for h in handles:
            h.remove()


def nanaudit_scan(model, opt, loss, batches, device, watch=None, read="auto",
                  keep_going=False):
    """nanaudit's own step loop (runner.run_steps) with its default sentinels and warnings
    (loss spike and gradient growth on the host, the update ratio every 10 steps)."""
    session = _session(model, opt, loss, batches, device, watch, read)
    if keep_going:
        def on_skip(trip, state):
            raise AssertionError(f"the benchmark's steps are clean: {trip}")
        outcome = run_steps(session, outcome=ScanOutcome(bad_steps=BadStepLog(MAX_BAD_STEPS)),
                            on_skip=on_skip)
    else:
        outcome = run_steps(session)
    assert outcome.trip is None, outcome.trip
    _sync(device)
    return outcome


def nanaudit_keep_going(model, opt, loss, batches, device):
    """The default scan under --keep-going (a clean step's price; on CUDA with a fused
    optimizer it keeps the deferred read, as the default scan does)."""
    return nanaudit_scan(model, opt, loss, batches, device, keep_going=True)


def nanaudit_keep_going_deferred(model, opt, loss, batches, device):
    """scan --keep-going with each step read one step later (also on the CPU): against
    "nanaudit deferred", what keep-going adds to a clean step of the deferred read."""
    return nanaudit_scan(model, opt, loss, batches, device, read="deferred", keep_going=True)


def nanaudit_sync(model, opt, loss, batches, device):
    """The default scan with the sentinels read at each step (the host waits for the step)."""
    return nanaudit_scan(model, opt, loss, batches, device, read="sync")


def nanaudit_deferred(model, opt, loss, batches, device):
    """The default scan with each step read one step later (needs a fused optimizer)."""
    return nanaudit_scan(model, opt, loss, batches, device, read="deferred")


def nanaudit_activations(model, opt, loss, batches, device):
    """The optional near-overflow watch on every step (on by default only under fp16)."""
    return nanaudit_scan(model, opt, loss, batches, device, WatchOptions(activations=1))


def nanaudit_sentinels_only(model, opt, loss, batches, device):
    """The sentinels alone: every early warning off."""
    return nanaudit_scan(model, opt, loss, batches, device,
                         WatchOptions(activations=0, loss_spike=False, grad_growth=False,
                                      update_ratio=False, update_every=0))


def _session(model, opt, loss, batches, device, watch=None, read="auto") -> Session:
    return Session.for_loop(model, opt, lambda m, b: loss(m, b), device, batches,
                            label="bench", watch=watch or WatchOptions(), sentinel_read=read)


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


VARIANTS = {"plain": plain, "nanaudit": nanaudit_scan, "nanaudit sync": nanaudit_sync,
            "nanaudit deferred": nanaudit_deferred, "keep-going": nanaudit_keep_going,
            "keep-going deferred": nanaudit_keep_going_deferred,
            "sentinels only": nanaudit_sentinels_only, "+activation watch": nanaudit_activations,
            "detect_anomaly": detect_anomaly, "hook .item() (HF)": hook_checker}
NANAUDIT_VARIANTS = ("nanaudit", "nanaudit sync", "nanaudit deferred", "keep-going",
                     "keep-going deferred",
                     "sentinels only", "+activation watch")


OPTIMIZERS = {"fused": "fused SGD", "foreach": "foreach SGD", "fused-adam": "fused Adam"}


def make_optimizer(model, kind: str):
    """The same optimizer for every variant: fused SGD (it can skip an update on the device,
    which the deferred read needs), the default foreach SGD (the sync read only) or a fused
    Adam (moments and a step count the device skip must leave alone)."""
    if kind == "fused-adam":
        return torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    return torch.optim.SGD(model.parameters(), lr=1e-4, fused=(kind == "fused"))


# --- measurement -----------------------------------------------------------------------------

CLOCK = time.perf_counter     # --clock cpu: time.process_time (this process's CPU time)


def measure(name, factory, device, rounds, steps, variants, optimizer="fused"):
    torch.manual_seed(0)
    model, make_batch, loss = factory()
    model.to(device)
    opt = make_optimizer(model, optimizer)
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(steps)]
    params = sum(p.numel() for p in model.parameters())
    for fn in variants.values():          # warm-up: allocator, kernels, autograd caches
        fn(model, opt, loss, batches[:1], device)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        for v, fn in variants.items():
            start = CLOCK()
            fn(model, opt, loss, batches, device)
            times[v].append((CLOCK() - start) / steps)
    medians = {v: statistics.median(t) for v, t in times.items()}
    base = medians["plain"]
    syncs, modes = {}, {}
    for v, fn in variants.items():        # counted outside the timed rounds
        syncs[v], outcome = count_syncs(fn, model, opt, loss, batches, device)
        if outcome is not None and outcome.read_mode is not None:
            modes[v] = jsonable(outcome.read_mode.section())
    return {"workload": name, "params": params, "device": str(device), "rounds": rounds,
            "steps_per_round": steps, "optimizer": optimizer, "median_step_s": medians,
            "ratio": {v: m / base for v, m in medians.items()},
            "overhead_ms_per_step": {v: (m - base) * 1e3 for v, m in medians.items()},
            "syncs_per_step": syncs, "read_mode": modes, "raw_step_s": times}


def count_syncs(fn, model, opt, loss, batches, device):
    """Host syncs per step of one run: nanaudit's own count of its blocking reads (the final
    check included) and, on CUDA, the synchronizations torch's sync debug mode reports."""
    counts, outcome = {}, None
    cuda = str(device).startswith("cuda")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        try:
            outcome = fn(model, opt, loss, batches, device)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if outcome is not None:
        counts["nanaudit_reads"] = outcome.host_syncs / len(batches)
    if cuda:
        found = [w for w in seen if "called a synchronizing" in str(w.message)]
        counts["cuda_sync_debug"] = len(found) / len(batches)
    return counts, outcome


PROCESS_VARIANTS = ("plain", "nanaudit", "nanaudit sync", "nanaudit deferred", "detect_anomaly")


def whole_process(workload, device, optimizer, steps, processes):
    """Whole-process ratios: `processes` fresh interpreters per variant, interleaved, each
    importing torch, building the workload and running `steps` steps, timed start to exit."""
    walls = {v: [] for v in PROCESS_VARIANTS}
    for _ in range(processes):
        for v in PROCESS_VARIANTS:
            command = [sys.executable, __file__, "--child", v, "--workload", workload,
                       "--device", str(device), "--optimizer", optimizer, "--steps", str(steps)]
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            walls[v].append(time.perf_counter() - start)
    medians = {v: statistics.median(w) for v, w in walls.items()}
    return {"workload": workload, "processes": processes, "steps": steps,
            "median_process_s": medians,
            "ratio": {v: m / medians["plain"] for v, m in medians.items()}, "raw_s": walls}


def child(args) -> int:
    """One process of `whole_process`: build, run one variant, exit."""
    torch.manual_seed(0)
    model, make_batch, loss = WORKLOADS[args.workload]()
    model.to(args.device)
    opt = make_optimizer(model, args.optimizer)
    g = torch.Generator().manual_seed(0)
    VARIANTS[args.child](model, opt, loss, [make_batch(g) for _ in range(args.steps)],
                         torch.device(args.device))
    return 0


def replay_cost(factory, device, repeats=3):
    """Time to localize one bad step (traced replay + diagnosis + sample isolation)."""
    from nanaudit.localize.findings import localized_finding
    torch.manual_seed(0)
    model, make_batch, loss = factory()
    model.to(device)
    g = torch.Generator().manual_seed(0)
    batch = _to(make_batch(g), device)

    def bad_loss(model, b):
        # One sample's hand-written log-probability goes to log(0): a forward finding.
        logits = model(b[0])
        p = torch.softmax(logits[:, -1] * 1e4, dim=-1)
        return loss(model, b) - torch.log(p[:, 0]).mean()
    opt = make_optimizer(model, "fused")
    session = _session(model, opt, bad_loss, [batch], device)
    state = StepState(0, batch, RngState.capture())
    plain_times, replay_times, replays = [], [], None
    for _ in range(repeats):
        start = time.perf_counter()
        state.rng.restore()
        model.zero_grad(set_to_none=True)
        bad_loss(model, batch).backward()
        _sync(device)
        plain_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        finding = localized_finding(session, state, Trip(0, "loss"), [], isolate_samples=False)
        _sync(device)
        replay_times.append(time.perf_counter() - start)
    start = time.perf_counter()
    finding = localized_finding(session, state, Trip(0, "loss"), [], isolate_samples=True)
    isolation_s = time.perf_counter() - start
    replays = finding.sample_search.replays if finding.sample_search else None
    base = statistics.median(plain_times)
    return {"plain_step_s": base, "replay_s": statistics.median(replay_times),
            "replay_ratio": statistics.median(replay_times) / base, "op": finding.op,
            "samples": finding.samples, "isolation_replays": replays,
            "isolation_s": isolation_s}


def memory_note(device, factory):
    """Extra memory of the sentinels: measured on CUDA, accounted for on the CPU."""
    torch.manual_seed(0)
    model, make_batch, loss = factory()
    model.to(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    note = {"weights_bytes": weights,
            "update_ratio_snapshot_bytes": weights,
            "note": "the sentinels keep no per-parameter copies: per step they hold the RNG "
                    "state (a few KB), the batch reference and a few 0-dim tensors; the "
                    "update-ratio watch copies the weights for the length of one optimizer "
                    "step every `update_every` (10) steps, then frees the copy; the deferred "
                    "read also keeps two copies of the buffers and one more step's batch"}
    if str(device).startswith("cuda"):
        opt = make_optimizer(model, "fused")
        batches = [make_batch(torch.Generator().manual_seed(0)) for _ in range(2)]
        peaks = {}
        for v in ("plain", "sentinels only", "nanaudit", "nanaudit deferred"):
            torch.cuda.reset_peak_memory_stats()
            VARIANTS[v](model, opt, loss, batches, device)
            peaks[v] = torch.cuda.max_memory_allocated()
        note["max_memory_allocated"] = peaks
    else:
        note["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return note


def table(results) -> str:
    names = list(results[0]["ratio"])
    head = (f"{'workload':<22}{'params':>10}{'plain ms':>10}"
            + "".join(f"{n:>20}" for n in names[1:]))
    lines = [head, "-" * len(head)]
    for r in results:
        plain_ms = r["median_step_s"]["plain"] * 1e3
        row = f"{r['workload']:<22}{r['params'] / 1e6:>9.2f}M{plain_ms:>10.2f}"
        row += "".join(f"{r['ratio'][n]:>19.3f}x" for n in names[1:])
        lines.append(row)
    return "\n".join(lines)


def cost_table(results) -> str:
    """nanaudit's fixed cost per step (ms over the plain loop), its host syncs per step and the
    read mode the default scan chose."""
    names = [n for n in NANAUDIT_VARIANTS if n in results[0]["ratio"]]
    head = f"{'workload':<22}" + "".join(f"{n + ' ms':>22}" for n in names) + \
        f"{'syncs/step (nanaudit)':>24}{'default read':>14}"
    lines = [head, "-" * len(head)]
    for r in results:
        row = f"{r['workload']:<22}" + "".join(
            f"{r['overhead_ms_per_step'][n]:>22.3f}" for n in names)
        syncs = r["syncs_per_step"].get("nanaudit", {})
        text = f"{syncs.get('nanaudit_reads', float('nan')):.2f}"
        if "cuda_sync_debug" in syncs:
            text += f" (cuda {syncs['cuda_sync_debug']:.2f})"
        row += f"{text:>24}{r['read_mode'].get('nanaudit', {}).get('mode', '?'):>14}"
        lines.append(row)
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant per round "
                        "(10: the update-ratio watch samples once per round, as in a run)")
    parser.add_argument("--workloads", help="comma-separated names (default: per device): "
                        + ", ".join(WORKLOADS))
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="fused")
    parser.add_argument("--processes", type=int, default=0, help="whole-process ratios: this "
                        "many fresh processes per variant for the first workload")
    parser.add_argument("--sizes", action="store_true", help="sweep transformer sizes")
    parser.add_argument("--sizes-only", action="store_true", help="only the size sweep")
    parser.add_argument("--quick", action="store_true", help="a smoke run in under a minute")
    parser.add_argument("--keep-going", action="store_true", help="add the keep-going variants "
                        "(scan --keep-going's loop, default and deferred read: a clean step's "
                        "price)")
    parser.add_argument("--json", dest="json_path", help="write the raw numbers here")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: time "
                        "this process's CPU time (a shared CPU machine; never for CUDA)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    device = torch.device(args.device)
    global CLOCK
    if args.clock == "cpu":
        if device.type == "cuda":
            parser.error("--clock cpu does not see GPU time: use the wall clock on CUDA")
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, steps = (3, 1) if args.quick else (args.rounds, args.steps)
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    names = CUDA_WORKLOADS if device.type == "cuda" else CPU_WORKLOADS
    if args.workloads:
        names = tuple(n.strip() for n in args.workloads.split(","))
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        sys.exit(f"bench.py: unknown workload(s) {unknown}; choose from {sorted(WORKLOADS)}")
    workloads = {n: WORKLOADS[n] for n in names}
    if args.sizes_only:
        workloads = {}
    variants = {k: v for k, v in VARIANTS.items()
                if not k.startswith("keep-going") or args.keep_going}
    if device.type == "cuda" and args.optimizer != "foreach":
        variants.pop("keep-going deferred", None)     # "keep-going" defers there already
    if args.quick:
        workloads = {"transformer (small)": lambda: transformer(d=64, layers=1, ff=128, seq=16),
                     "tiny mlp": tiny_mlp}
    results = [measure(n, f, device, rounds, steps, variants, args.optimizer)
               for n, f in workloads.items()]
    sweep = []
    if args.sizes or args.sizes_only:
        sweep_variants = {k: VARIANTS[k] for k in ("plain", "nanaudit", "sentinels only")}
        for label, kw in SIZES.items():
            sweep.append(measure(f"transformer {label}", lambda kw=kw: transformer(**kw), device,
                                 max(3, rounds // 2), steps, sweep_variants, args.optimizer))
    processes = None
    if args.processes and workloads:
        first = next(n for n in names if n in WORKLOADS) if not args.quick else "tiny mlp"
        processes = whole_process(first, device, args.optimizer, rounds * steps,
                                  args.processes)
    replay_factory = (lambda: transformer(d=64, layers=1, ff=128, seq=16)) if args.quick \
        else (lambda: transformer())
    replay = replay_cost(replay_factory, device)
    memory = memory_note(device, replay_factory)
    machine = {"python": platform.python_version(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "platform": platform.platform(),
               "processor": platform.processor(), "threads": torch.get_num_threads(),
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    print(f"machine: {machine}")
    print(f"median step time ratio to the plain loop ({rounds} interleaved rounds x {steps} "
          f"step(s), {OPTIMIZERS[args.optimizer]}, {args.clock} clock):")
    if results:
        print(table(results))
        print("\nfixed cost per step over the plain loop (ms), host syncs per step:")
        print(cost_table(results))
    if sweep:
        print("\nsize sweep (plain vs nanaudit):")
        print(table(sweep))
    if processes:
        print(f"\nwhole process ({processes['processes']} interleaved processes per variant, "
              f"{processes['steps']} steps of {processes['workload']}): " + ", ".join(
                  f"{v} {r:.3f}x" for v, r in processes["ratio"].items()))
    print(f"\nreplay of one bad step: {replay['replay_ratio']:.1f}x a plain step "
          f"({replay['replay_s'] * 1e3:.0f} ms vs {replay['plain_step_s'] * 1e3:.0f} ms); found "
          f"{replay['op']}; sample isolation used {replay['isolation_replays']} replays "
          f"-> samples {replay['samples']}")
    print(f"memory: {memory}")
    if args.json_path:
        body = {"machine": machine, "clock": args.clock, "results": results, "sweep": sweep,
                "replay": replay, "whole_process": processes, "memory": memory, "quick": args.quick}
        Path(args.json_path).write_text(json.dumps(body, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
