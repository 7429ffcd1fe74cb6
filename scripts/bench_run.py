"""Benchmark `nanaudit run`: the hooks' overhead on unmodified scripts, and the re-run's cost.

Two scripts are written to a temporary folder (no downloads): a plain loop training a
transformer encoder (~3.7M parameters, batch 16 x 64 tokens, AdamW) and a `transformers.Trainer`
run of a 4-layer BERT built from a config. Each is run in this process, as `nanaudit run` runs
it, with and without nanaudit's hooks, interleaved round by round; the table shows the median
run time over rounds and the ratio. Then `nanaudit run` is timed end to end on the plain loop
with a NaN planted at a late step: the first run, the re-run, and `python script.py` alone.

    python scripts/bench_run.py              # both workloads, 5 rounds x 10 steps
    python scripts/bench_run.py --quick      # a smoke run

Also measured: the hooks' fixed cost per step (best of 5 x 200 steps of a small MLP).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
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

PLAIN_LOOP = '''
import argparse
import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, vocab=1000, d=256, layers=4, heads=4, ff=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--poison-step", type=int, default=-1)
args = parser.parse_args()
torch.manual_seed(0)
model = Encoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
temperature = torch.ones(())
for step in range(args.steps):
    tokens = torch.randint(0, 1000, (16, 64))
    logits = model(tokens) / (temperature * (step != args.poison_step))
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''

TRAINER = '''
import sys
import tempfile
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1000, (size, 64), generator=g)
        self.labels = torch.randint(0, 2, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


config = BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                    intermediate_size=1024, max_position_embeddings=64)
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=16,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    Trainer(model=BertForSequenceClassification(config), args=args,
            train_dataset=Tokens(16 * steps)).train()
'''


def timed_run(path: Path, args: list, hooked: bool) -> tuple[float, int]:
    """One in-process run of the script; (seconds, host reads)."""
    started = time.perf_counter()
    if hooked:
        auditor = ScriptAuditor()
        execute(ScriptTarget(path=str(path), args=tuple(args)), auditor, 0)
        auditor.finish()
        return time.perf_counter() - started, auditor.host_reads
    run_plain(path, args)
    return time.perf_counter() - started, 0


def overhead(path: Path, args: list, rounds: int) -> dict:
    timed_run(path, args, False)                  # warm-up: imports, allocator, thread pool
    plain, hooked, reads = [], [], 0
    for _ in range(rounds):
        plain.append(timed_run(path, args, False)[0])
        seconds, reads = timed_run(path, args, True)
        hooked.append(seconds)
    p, h = statistics.median(plain), statistics.median(hooked)
    return {"plain_s": round(p, 3), "nanaudit_s": round(h, 3), "ratio": round(h / p, 3),
            "host_reads": reads, "plain_all": plain, "nanaudit_all": hooked}


def fixed_cost(steps: int = 200, repeats: int = 5) -> dict:
    """The hooks' fixed cost per optimizer step, on a step too small to hide it (a 2-layer MLP):
    the best of `repeats` timings of `steps` steps with and without the hooks, so that a loaded
    machine's pauses do not count."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 1))
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def loop():
        # Built under the hooks, as a script's optimizer is: one built before them would make
        # each backward a step of a script updating its weights by hand, checked twice.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        started = time.perf_counter()
        for _ in range(steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - started) / steps

    plain, hooked = [], []
    for _ in range(repeats):
        plain.append(loop())
        auditor = ScriptAuditor().install()
        try:
            hooked.append(loop())
        finally:
            auditor.remove()
    p, h = min(plain), min(hooked)
    return {"plain_step_ms": round(p * 1e3, 3), "nanaudit_step_ms": round(h * 1e3, 3),
            "added_ms_per_step": round((h - p) * 1e3, 3)}


def rerun_cost(path: Path, steps: int, poison: int) -> dict:
    """`nanaudit run` end to end on a NaN at `poison`, against `python script.py` alone."""
    with tempfile.TemporaryDirectory() as folder:
        report_path = Path(folder) / "report.json"
        started = time.perf_counter()
        subprocess.run([sys.executable, str(path), "--steps", str(poison)], check=True)
        python_s = time.perf_counter() - started
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "nanaudit", "run", "-q", "--json", str(report_path),
                        str(path), "--steps", str(steps), "--poison-step", str(poison)])
        total_s = time.perf_counter() - started
        report = json.loads(report_path.read_text())
    run = report["run"]
    return {"bad_step": poison, "python_script_to_that_step_s": round(python_s, 2),
            "nanaudit_run_total_s": round(total_s, 2),
            "first_run_s": run["first_run"]["duration_s"], "rerun_s": run["rerun"]["duration_s"],
            "rerun_status": run["rerun"]["status"], "op": report["finding"]["op"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    rounds, steps = (2, 3) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(torch.get_num_threads())
    results = {"machine": f"{platform.machine()} {platform.system()}, "
                          f"{torch.get_num_threads()} threads, torch {torch.__version__}"}
    results["fixed cost"] = fixed_cost()
    print("fixed cost", results["fixed cost"])
    with tempfile.TemporaryDirectory() as folder:
        loop = Path(folder) / "train_loop.py"
        loop.write_text(textwrap.dedent(PLAIN_LOOP))
        results["plain loop"] = overhead(loop, ["--steps", str(steps)], rounds)
        print("plain loop", {k: v for k, v in results["plain loop"].items() if "all" not in k})
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("transformers not installed: the Trainer workload is skipped")
        else:
            trainer = Path(folder) / "train_trainer.py"
            trainer.write_text(textwrap.dedent(TRAINER))
            results["hf trainer"] = overhead(trainer, [str(steps)], rounds)
            print("hf trainer", {k: v for k, v in results["hf trainer"].items() if "all" not in k})
        results["rerun"] = rerun_cost(loop, steps * 2, steps * 2 - 1)
        print("rerun", results["rerun"])
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
