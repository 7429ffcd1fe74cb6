"""Reproduce a nanaudit finding with plain PyTorch (this file does not import nanaudit).

    python repro.py            # replay the failing step on its full batch
    python repro.py --rows     # ... on the offending rows alone (rows.pt)
    python repro.py --device cuda

It rebuilds the model with your own factory (from the config's folder, see meta.json), loads
the saved weights, RNG state and batch with torch.load(weights_only=True), runs the loss and
backward as nanaudit did, and prints every non-finite value it sees. Exit status: 1 when the
non-finite value reproduces, 0 when it does not.
"""
import argparse
import contextlib
import importlib
import importlib.util
import json
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "meta.json").read_text(encoding="utf-8"))


def load(name):
    return torch.load(HERE / name, map_location="cpu", weights_only=True)


def entrypoint(target):
    """`module.path:attr` or `file.py:attr`, resolved in the original config's folder."""
    module_part, attr = target.rsplit(":", 1)
    base = Path(META["base_dir"])
    sys.path.insert(0, str(base))
    if module_part.endswith(".py"):
        spec = importlib.util.spec_from_file_location(Path(module_part).stem, base / module_part)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_part)
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def to_device(tree, device):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


def nonfinite(name, tensor):
    t = tensor.detach()
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return (f"{name}: {int(torch.isnan(t).sum())} NaN, {int((t == float('inf')).sum())} +inf, "
            f"{int((t == float('-inf')).sum())} -inf of {t.numel()} {tuple(t.shape)} {t.dtype}")


def leaves(tree, path="batch"):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="use rows.pt (the offending rows)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"step {META['step']}: the {META['check']} check tripped "
          f"(saved with torch {META['torch']} on {META['device']})")

    model = entrypoint(META["model"])(**META["model_args"])
    state = load("state.pt")
    model.load_state_dict(state["model"])
    model.to(device).train()
    batch = to_device(load("rows.pt" if args.rows else "batch.pt"), device)
    rng = load("rng.pt")
    random.setstate(tuple(tuple(v) if isinstance(v, list) else v for v in rng["python"]))
    torch.set_rng_state(rng["torch_cpu"])

    found = [line for line in (nonfinite(p, t) for p, t in leaves(batch)) if line]
    found += [line for line in (nonfinite(f"parameter {n}", p)
                                for n, p in model.named_parameters()) if line]
    if not found:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(META["precision"])
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype
                    else contextlib.nullcontext())
        with autocast:
            out = entrypoint(META["loss"])(model, batch, **META["loss_args"])
        loss = out["loss"] if isinstance(out, dict) else out
        found += [line for line in [nonfinite("loss", loss)] if line]
        (loss * (META["scale"] or 1.0)).backward()
        found += [line for line in (nonfinite(f"gradient of {n}", p.grad)
                                    for n, p in model.named_parameters()
                                    if p.grad is not None) if line]
        print(f"loss = {float(loss.detach()):.6g}")
    for line in found:
        print("non-finite", line)
    print("reproduced" if found else "not reproduced: every value is finite")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
