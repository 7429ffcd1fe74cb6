"""Benchmark the framework integrations: Trainer / Lightning steps with and without nanaudit.

Workloads are built from config objects (no downloads): a GPT-2 causal LM trained by the
Hugging Face Trainer (with gradient accumulation), and the same model in a Lightning module.
Variants run the same steps on the same batches from the same initial weights, interleaved
round by round in one process; the table shows each variant's median optimizer-step time over
all rounds (warm-up steps dropped) as a ratio to the run without any callback.

    python scripts/bench_trainer.py                  # Trainer and Lightning, on the CPU
    python scripts/bench_trainer.py --quick          # a smoke run in well under a minute
    python scripts/bench_trainer.py --json bench_trainer.json

Also printed: the time spent inside the Sentinel's methods per optimizer step (nanaudit's own
cost, steadier than the difference of two step times on a noisy machine).

Trainer variants: `plain`, `nanaudit` (NanauditCallback), and `debug=underflow_overflow`
(transformers' DebugUnderflowOverflow, what HF users turn on today). Lightning variants:
`plain`, `nanaudit`.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def gpt2(n_embd, n_layer, seq):
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=1000, n_positions=seq, n_embd=n_embd,
                                     n_layer=n_layer, n_head=max(1, n_embd // 64))
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_steps(variant, shape, steps, accumulation, batch, folder):
    """Train `steps` optimizer steps; returns each step's wall time (on_step_begin..end)."""
    import transformers

    from nanaudit.integrations.transformers import NanauditCallback

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.times, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    timer = StepTimer()
    callbacks = [timer]
    if variant == "nanaudit":
        callbacks.append(NanauditCallback(echo=False))
    args = transformers.TrainingArguments(
        output_dir=folder, per_device_train_batch_size=batch, max_steps=steps,
        gradient_accumulation_steps=accumulation, report_to=[], use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
        train_sampling_strategy="sequential", max_grad_norm=1.0,
        debug="underflow_overflow" if variant == "debug=underflow_overflow" else "")
    model = gpt2(*shape)
    data = Tokens(steps * accumulation * batch, shape[2])
    transformers.Trainer(model=model, args=args, train_dataset=data,
                         callbacks=callbacks).train()
    return timer.times


def lightning_steps(variant, shape, steps, accumulation, batch, folder):
    import lightning

    from nanaudit.integrations.lightning import NanauditCallback

    class LM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = gpt2(*shape)

        def training_step(self, b, batch_idx):
            return self.model(**b).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class StepTimer(lightning.Callback):
        def __init__(self):
            self.times, self._last = [], None

        def on_train_batch_end(self, trainer, module, outputs, b, batch_idx):
            if (batch_idx + 1) % accumulation == 0:
                now = time.perf_counter()
                if self._last is not None:
                    self.times.append(now - self._last)
                self._last = now

    timer = StepTimer()
    callbacks = [timer] + ([NanauditCallback(echo=False)] if variant == "nanaudit" else [])
    loader = torch.utils.data.DataLoader(Tokens((steps + 1) * accumulation * batch, shape[2]),
                                         batch_size=batch)
    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accumulate_grad_batches=accumulation,
                                gradient_clip_val=1.0, callbacks=callbacks,
                                default_root_dir=folder)
    trainer.fit(LM(), loader)
    return timer.times


WORKLOADS = {
    "Trainer": (trainer_steps, ["plain", "nanaudit", "debug=underflow_overflow"]),
    "Lightning": (lightning_steps, ["plain", "nanaudit"]),
}


class OwnTime:
    """The time spent inside the Sentinel's per-step methods: nanaudit's own cost, which on a
    shared machine is steadier than a difference of two noisy step times."""

    METHODS = ("capture_rng", "micro_batch", "check_update")

    def __init__(self):
        from nanaudit.integrations.sentinel import Sentinel
        self.total, self.checks = 0.0, 0
        self.originals = {name: getattr(Sentinel, name) for name in self.METHODS}
        for name, original in self.originals.items():

            def timed(*args, _original=original, _name=name, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.total += time.perf_counter() - started
                    self.checks += _name == "check_update"
            setattr(Sentinel, name, timed)

    def close(self) -> None:
        from nanaudit.integrations.sentinel import Sentinel
        for name, original in self.originals.items():
            setattr(Sentinel, name, original)

    def per_step(self) -> float:
        return self.total / max(self.checks, 1)


def measure(name, shape, rounds, steps, accumulation, batch, warmup=2):
    run, variants = WORKLOADS[name]
    raw = {v: [] for v in variants}
    own = OwnTime()
    try:
        with tempfile.TemporaryDirectory() as folder:
            for _ in range(rounds):
                for variant in variants:
                    raw[variant].extend(run(variant, shape, steps + warmup, accumulation, batch,
                                            folder)[warmup:])
    finally:
        own.close()
    median = {v: statistics.median(t) for v, t in raw.items()}
    params = sum(p.numel() for p in gpt2(*shape).parameters())
    return {"workload": name, "params": params, "shape": {"n_embd": shape[0],
            "n_layer": shape[1], "seq": shape[2]}, "batch": batch,
            "accumulation": accumulation, "rounds": rounds, "steps": steps,
            "median_step_s": median,
            "ratio": {v: round(median[v] / median["plain"], 3) for v in variants},
            "own_s_per_step": own.per_step(),
            "own_ratio": round(1 + own.per_step() / median["plain"], 4),
            "raw_step_s": raw}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--shape", help="GPT-2 n_embd,n_layer,seq (default 256,4,128)")
    parser.add_argument("--batch", type=int)
    options = parser.parse_args(argv)
    quiet = logging.root.manager.disable
    logging.disable(logging.WARNING)           # the frameworks' banners and tips
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(options)
    finally:
        logging.disable(quiet)


def run(options):
    if options.quick:
        # a smoke run of the output's shape: the smallest GPT-2 that trains (half the CPU time)
        shape, rounds, steps, accumulation, batch = (32, 1, 16), 1, 3, 2, 2
    else:
        shape, rounds, steps, accumulation, batch = (256, 4, 128), 5, 8, 2, 8
    rounds, steps = options.rounds or rounds, options.steps or steps
    shape = tuple(int(v) for v in options.shape.split(",")) if options.shape else shape
    batch = options.batch or batch
    names = [options.only] if options.only else list(WORKLOADS)
    results = [measure(n, shape, rounds, steps, accumulation, batch) for n in names]
    print(f"median optimizer-step time ratio to no callback ({rounds} interleaved rounds x "
          f"{steps} steps, gradient accumulation {accumulation}, batch {batch}; "
          f"{platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)")
    for r in results:
        ratios = "  ".join(f"{v} {x:.3f}x" for v, x in r["ratio"].items())
        print(f"{r['workload']:<10} GPT-2 {r['params'] / 1e6:.2f}M params, plain step "
              f"{r['median_step_s']['plain'] * 1000:.1f} ms: {ratios}")
        print(f"{'':<10} nanaudit's own time {r['own_s_per_step'] * 1000:.2f} ms per optimizer "
              f"step = {r['own_ratio']:.4f}x the plain step")
    if options.json:
        options.json.write_text(json.dumps({"results": results}, indent=2))


if __name__ == "__main__":
    main()
