"""Reproduce a nanaudit finding with plain PyTorch (this file does not import nanaudit).

    python repro.py            # replay the failing step on its full batch
    python repro.py --rows     # ... on the offending rows alone (rows.pt)
    python repro.py --device cuda
    python repro.py --model mypkg.models:build_model   # when the bundle cannot build the model
    python repro.py --loss mypkg.train:compute_loss    # ... or the loss (fn(model, batch))

It builds the model as the run did: your factory named in the config (`nanaudit scan`), or what
a training run recorded (a Hugging Face model's config, a LightningModule's saved
hyperparameters); loads the saved weights, RNG state and batch with torch.load(weights_only=True);
rebuilds the batch's own types (BatchEncoding, your dataclasses) where they can be imported from
your code; runs the loss and backward as the step did, and prints every non-finite value it
sees. Exit status: 1 when the non-finite value reproduces, 0 when it does not, 2 when the bundle
cannot build the model or the loss by itself (the reason and the option to pass are printed).

`nanaudit replay` builds a bundle's model, loss and batch with this file's functions too.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

HERE = Path(__file__).resolve().parent

Meta = dict[str, Any]                               # meta.json
Resolve = Callable[[str], Any]                      # `module:attr` -> the object
LossFn = Callable[[torch.nn.Module, Any], Any]      # fn(model, batch) -> the loss


class Missing(Exception):
    """What the bundle cannot build by itself; the message says what to pass instead."""


def read_meta(folder: str | Path = HERE) -> Meta:
    return json.loads((Path(folder) / "meta.json").read_text(encoding="utf-8"))


def load(name: str, folder: str | Path = HERE) -> Any:
    return torch.load(Path(folder) / name, map_location="cpu", weights_only=True)


def import_roots(meta: Meta) -> list[str]:
    """The folders the run imported your code from: the config's folder for `scan`; for a
    training run, the working folder and the root of each module the bundle names."""
    roots = [meta["base_dir"]] if meta.get("base_dir") else []
    return roots + [r for r in meta.get("import_roots", []) if r not in roots]


class Importer:
    """Resolves `module.path:attr` and `file.py:attr` (relative to the first root)."""

    def __init__(self, roots: Sequence[str | Path]) -> None:
        self.roots = [Path(r) for r in roots]

    def __call__(self, target: str) -> Any:
        module_part, attr = target.rsplit(":", 1)
        if module_part.endswith(".py"):
            path = Path(module_part)
            if not path.is_absolute() and self.roots:
                path = self.roots[0] / path
            digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
            name = f"_repro_{path.stem}_{digest}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"cannot import {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module          # dataclasses look their module up here
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
        else:
            module = importlib.import_module(module_part)
        obj: Any = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj


# --- the model and the loss -----------------------------------------------------------------

def build_model(meta: Meta, resolve: Resolve, override: str | None = None) -> torch.nn.Module:
    """The model, before its weights are loaded: `override` (a factory), the config's factory,
    or the recipe the training run recorded."""
    if override:
        return _module(resolve(override)(), override)
    if meta.get("model"):
        return _module(resolve(meta["model"])(**meta.get("model_args", {})), meta["model"])
    recipe = meta.get("model_recipe") or {}
    what = recipe.get("name") or "the model"
    if recipe.get("kind") == "transformers":
        cls = _recipe_class(recipe, what, resolve)
        return cls(cls.config_class.from_dict(recipe["config"]))
    if recipe.get("kind") == "hparams":
        return _recipe_class(recipe, what, resolve)(**recipe["hparams"])
    raise Missing(f"it cannot build {what}: {recipe.get('why', 'nothing was recorded')}; "
                  f"pass --model module:factory (a callable returning the model; the bundle's "
                  f"weights are loaded into it)")


def _recipe_class(recipe: dict[str, Any], what: str, resolve: Resolve) -> Any:
    if not recipe.get("class"):
        raise Missing(f"it cannot build {what}: {recipe.get('why')}; pass --model "
                      f"module:factory (a callable returning the model)")
    try:
        return resolve(recipe["class"])
    except Exception as exc:
        raise Missing(f"it cannot build {what}: importing `{recipe['class']}` failed "
                      f"({type(exc).__name__}: {exc}); pass --model module:factory") from None


def _module(model: object, target: str) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        # repro.py imports no nanaudit (errors.a_kind_of): its own article for the type.
        name = type(model).__name__
        article = "an" if name[:1].lower() in "aeiou" else "a"
        raise TypeError(f"`{target}` returned {article} {name}, not a torch.nn.Module")
    return model


def build_loss(meta: Meta, resolve: Resolve, override: str | None = None) -> LossFn:
    """fn(model, batch) -> the loss (a tensor, or a dict with "loss") as the step computed it."""
    if override:
        fn = resolve(override)
        return lambda model, batch: fn(model, batch)
    if meta.get("loss"):
        fn, args = resolve(meta["loss"]), meta.get("loss_args", {})
        return lambda model, batch: fn(model, batch, **args)
    if meta.get("step_fn"):
        raise Missing(f"the run used its own step `{meta['step_fn']}` (forward, backward and "
                      f"optimizer steps in your function), which this plain-PyTorch script does "
                      f"not drive: run `nanaudit replay {HERE}`, which stops it where it tripped")
    recipe = meta.get("loss_recipe") or {}
    if recipe.get("kind") == "training_step":
        index = recipe.get("batch_idx", 0)
        # The model is a LightningModule, whose training_step computes the loss.
        return lambda model, batch: cast(Any, model).training_step(batch, index)
    if recipe.get("kind") == "hf-trainer":
        return _trainer_loss(recipe, resolve)
    raise Missing(f"it cannot compute the loss: {recipe.get('why', 'nothing was recorded')}; "
                  f"pass --loss module:fn (called as fn(model, batch), returning the loss)")


def _trainer_loss(recipe: dict[str, Any], resolve: Resolve) -> LossFn:
    """transformers.Trainer.compute_loss without a Trainer: the model's own loss, or your
    `compute_loss_func(outputs, labels, num_items_in_batch=...)`."""
    func = None
    if recipe.get("compute_loss_func"):
        try:
            func = resolve(recipe["compute_loss_func"])
        except Exception as exc:
            raise Missing(f"it cannot compute the loss: importing the Trainer's "
                          f"compute_loss_func `{recipe['compute_loss_func']}` failed "
                          f"({type(exc).__name__}: {exc}); pass --loss module:fn") from None
    count = recipe.get("num_items_in_batch")

    def loss(model: torch.nn.Module, batch: Any) -> Any:
        inputs = dict(batch)
        labels = inputs.pop("labels") if func is not None and "labels" in inputs else None
        if recipe.get("model_accepts_loss_kwargs") and count is not None:
            inputs["num_items_in_batch"] = count
        outputs = model(**inputs)
        if func is not None:
            return func(outputs, labels, num_items_in_batch=count)
        return outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    return loss


# --- the batch --------------------------------------------------------------------------------

def rebuild_batch(plain: Any, node: dict[str, Any] | None, resolve: Resolve,
                  roots: Sequence[str | Path] = ()) -> tuple[Any, list[str]]:
    """The batch with the user's container types back (BatchEncoding, dataclasses,
    namedtuples), from its plain form and the structure recorded in meta.json. A type that
    cannot be imported stays a plain container. Returns (batch, notes saying which)."""
    notes: list[str] = []
    return _rebuild(plain, node, resolve, [Path(r) for r in roots], notes), notes


def _rebuild(plain: Any, node: dict[str, Any] | None, resolve: Resolve, roots: list[Path],
             notes: list[str]) -> Any:
    if not node:
        return plain
    below = node.get("children")
    if below and isinstance(plain, dict):
        plain = {k: _rebuild(v, n, resolve, roots, notes)
                 for (k, v), n in zip(plain.items(), below)}
    elif below and isinstance(plain, (list, tuple)):
        plain = type(plain)(_rebuild(v, n, resolve, roots, notes) for v, n in zip(plain, below))
    if "name" not in node:
        return plain                  # a plain container holding rebuilt ones
    cls, why = _batch_class(node, resolve, roots)
    if cls is not None:
        try:
            return _construct(cls, node["kind"], plain)
        except Exception as exc:
            why = f"building it from the saved fields raised {type(exc).__name__}: {exc}"
    notes.append(f"`{node['name']}` was replayed as a plain {type(plain).__name__}: {why}")
    return plain


def _batch_class(node: dict[str, Any], resolve: Resolve, roots: list[Path]
                 ) -> tuple[Any, str | None]:
    if node.get("type") is None:
        return None, node.get("why", "it cannot be imported")
    try:
        cls = resolve(node["type"])
    except Exception as exc:
        failure = f"importing `{node['type']}` failed ({type(exc).__name__}: {exc})"
        source = node.get("file")
        # A module the run loaded from a file has a name only that process knew: load the
        # file again, when it is your code (under a folder the run imported from).
        if not source or not _inside(source, roots):
            return None, failure
        try:
            cls = resolve(f"{source}:{node['type'].rsplit(':', 1)[1]}")
        except Exception as again:
            return None, f"{failure}; loading {source} failed ({type(again).__name__}: {again})"
    return cls, None


def _inside(path: str | Path, roots: list[Path]) -> bool:
    path = Path(path).resolve()
    return any(root.resolve() in path.parents for root in roots)


def _construct(cls: Any, kind: str, plain: Any) -> Any:
    if kind == "mapping" and isinstance(cls, type) and issubclass(cls, Mapping):
        return cls(plain)  # type: ignore[call-arg]  # a Mapping subclass, built from a dict
    if kind == "dataclass" and isinstance(cls, type) and dataclasses.is_dataclass(cls):
        fields = dataclasses.fields(cls)
        obj = cls(**{f.name: plain[f.name] for f in fields if f.init and f.name in plain})
        for f in fields:
            if not f.init and f.name in plain:
                object.__setattr__(obj, f.name, plain[f.name])
        return obj
    if kind == "namedtuple" and isinstance(cls, type) and issubclass(cls, tuple):
        return cls(*plain)
    if kind in ("list", "tuple") and isinstance(cls, type) and issubclass(cls, (list, tuple)):
        return cls(plain)
    raise TypeError(f"it is not a {kind} type any more")


def to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


# --- RNG ----------------------------------------------------------------------------------------

def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    random.setstate(_tupled(rng["python"]))
    torch.set_rng_state(rng["torch_cpu"])
    if rng.get("cuda") is not None and device.type == "cuda":
        torch.cuda.set_rng_state_all(rng["cuda"])
    if rng.get("numpy") is not None:
        import numpy
        numpy.random.set_state(numpy_state(rng["numpy"]))


def numpy_state(saved: dict[str, Any]) -> tuple[Any, ...]:
    import numpy
    return (saved["name"], saved["keys"].numpy().astype(numpy.uint32), saved["pos"],
            saved["has_gauss"], saved["cached_gaussian"])


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


# --- the run ------------------------------------------------------------------------------------

def nonfinite(name: str, tensor: torch.Tensor) -> str | None:
    t = tensor.detach()
    if t.is_sparse:
        t = t.coalesce().values()
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return (f"{name}: {int(torch.isnan(t).sum())} NaN, {int((t == float('inf')).sum())} +inf, "
            f"{int((t == float('-inf')).sum())} -inf of {t.numel()} {tuple(t.shape)} {t.dtype}")


def leaves(tree: Any, path: str = "batch") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}[{k!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}[{i}]")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="use rows.pt (the offending rows)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="module:factory returning the model (when the bundle "
                                        "cannot build it)")
    parser.add_argument("--loss", help="module:fn, called as fn(model, batch), returning the loss")
    args = parser.parse_args(argv)
    meta = read_meta()
    device = torch.device(args.device)
    roots = import_roots(meta)
    if args.model or args.loss:
        sys.path.insert(0, os.getcwd())
    for root in reversed(roots):
        sys.path.insert(0, root)
    resolve = Importer(roots)
    print(f"step {meta['step']}: the {meta['check']} check tripped "
          f"(saved with torch {meta['torch']} on {meta.get('device', '?')})")
    try:
        model = build_model(meta, resolve, args.model)
        loss_fn = build_loss(meta, resolve, args.loss)
    except Missing as exc:
        print(f"cannot replay the bundle: {exc}", file=sys.stderr)
        return 2
    model.load_state_dict(load("state.pt")["model"])
    model.to(device).train()
    plain = to_device(load("rows.pt" if args.rows else "batch.pt"), device)
    batch, notes = rebuild_batch(plain, meta.get("batch_structure"), resolve, roots)
    for note in notes:
        print("note:", note)
    restore_rng(load("rng.pt"), device)

    found = [line for line in (nonfinite(p, t) for p, t in leaves(plain)) if line]
    found += [line for line in (nonfinite(f"parameter {n}", p)
                                for n, p in model.named_parameters()) if line]
    if not found:
        dtypes: dict[str | None, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
        dtype = dtypes.get(meta.get("precision"))
        autocast = (torch.autocast(device.type, dtype=dtype) if dtype
                    else contextlib.nullcontext())
        with autocast:
            out = loss_fn(model, batch)
        loss = out["loss"] if isinstance(out, dict) else out
        found += [line for line in [nonfinite("loss", loss)] if line]
        (loss * (meta.get("scale") or 1.0)).backward()
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
