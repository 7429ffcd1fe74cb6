"""Batches in the shapes users' code yields them: Mappings such as `UserDict` (Hugging Face's
`BatchEncoding`), dataclasses, objects with their own `.to(device)`."""

import json
import textwrap

import torch

from helpers import scan

from nanaudit.run.batch import float_leaves, map_tensors, to_device, to_plain

CASE = textwrap.dedent("""
    import collections
    import dataclasses
    import torch
    from torch import nn

    class Features(collections.UserDict):        # the shape of transformers' BatchEncoding
        pass

    @dataclasses.dataclass
    class Images:
        pixels: torch.Tensor
        ids: list

    def build_model():
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def batches():
        g = torch.Generator().manual_seed(0)
        for step in range(4):
            weights = torch.rand(8, 4, generator=g)
            if step == 2:
                weights[5, 1] = float("nan")      # one sample's missing value
            yield Features(inputs=torch.rand(8, 4, generator=g),
                           extra=Images(pixels=weights, ids=[f"img{i}" for i in range(8)]))

    def loss(model, batch):
        return (model(batch["inputs"]) * model(batch["extra"].pixels)).mean()
""")


def test_a_nan_inside_a_userdict_and_a_dataclass_is_seen_and_named_like_the_code(case, tmp_path):
    result = scan(case(CASE), tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1
    assert (f["step"], f["where"], f["cause"], f["samples"]) == (2, "input", "nonfinite-input", [5])
    assert f["tensor"] == 'batch["extra"].pixels'
    # The bundle stores the batch as plain containers that weights_only loads.
    bundle = next((tmp_path / "repro-step2").parent.glob("repro-step2*"))
    batch = torch.load(bundle / "batch.pt", weights_only=True)
    assert torch.isnan(batch["extra"]["pixels"][5, 1])
    assert json.loads((bundle / "meta.json").read_text())["samples"] == [5]


def test_batch_encoding_keeps_its_type_when_moved_and_every_float_leaf_is_checked():
    transformers = __import__("pytest").importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long),
                                        "attention_mask": torch.ones(2, 3)})
    moved = to_device(batch, "cpu")
    assert isinstance(moved, transformers.BatchEncoding)
    assert [p for p, _ in float_leaves(moved)] == ['["attention_mask"]']
    halved = map_tensors(moved, lambda _, t: t / 2)
    assert isinstance(halved, transformers.BatchEncoding) and halved["attention_mask"][0, 0] == 0.5
    assert type(to_plain(moved)) is dict


def test_an_object_with_its_own_to_is_moved_by_it():
    class Packed:
        def __init__(self):
            self.moved_to = None

        def to(self, device):
            self.moved_to = str(device)
            return self
    batch = {"x": torch.zeros(2), "packed": Packed()}
    assert to_device(batch, "cpu")["packed"].moved_to == "cpu"
