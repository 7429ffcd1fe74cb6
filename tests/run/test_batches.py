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
    # The rows' ids come with them: the dataclass's `ids: list` is per-sample.
    assert f["sample_rows"][0]["values"] == [['batch["extra"].ids', "img5"]]
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


def test_per_sample_lists_of_non_tensors_are_sliced_with_the_rows():
    import collections

    from nanaudit.run.batch import infer_layout, row_values, select_rows
    Pair = collections.namedtuple("Pair", "a b")
    batch = {"x": torch.arange(8.0).reshape(4, 2), "ids": ["a.wav", "b.wav", "c.wav", "d.wav"],
             "lengths": (3, 1, 2, 4), "pair": Pair("kept", "whole"),       # a record, not rows
             "tokens": [["a"], ["b", "c"], [], ["d"]], "config": ["one", "two"],
             "mixed": [torch.zeros(4)] * 4}                                 # holds tensors
    layout = infer_layout(batch)
    assert layout.size == 4
    assert layout.per_sample == {'["ids"]', '["lengths"]', '["tokens"]'}
    picked = select_rows(batch, layout, [3, 1])
    assert picked["ids"] == ["d.wav", "b.wav"] and picked["lengths"] == (4, 1)
    assert picked["tokens"] == [["d"], ["b", "c"]] and picked["x"].tolist() == [[6, 7], [2, 3]]
    assert picked["pair"] == Pair("kept", "whole") and picked["config"] == ["one", "two"]
    assert len(picked["mixed"]) == 4
    assert row_values(batch, layout, 2) == [('["ids"]', "c.wav"), ('["lengths"]', 2),
                                            ('["tokens"]', [])]


def test_a_dataclass_with_names_is_sliced_as_the_dataclass():
    import dataclasses

    from nanaudit.run.batch import infer_layout, select_rows

    @dataclasses.dataclass
    class Clips:
        audio: torch.Tensor
        names: list
    clips = Clips(torch.zeros(3, 5), ["x.wav", "y.wav", "z.wav"])
    picked = select_rows(clips, infer_layout(clips), [2])
    assert isinstance(picked, Clips) and picked.names == ["z.wav"]
    assert picked.audio.shape == (1, 5)


def test_batch_structure_round_trips_through_the_plain_form():
    import collections
    import dataclasses

    from nanaudit.commands.bundle_script import Importer, rebuild_batch
    from nanaudit.run.batch import batch_structure

    # Types importable by module path: collections' own, and this test module's.
    batch = {"enc": collections.OrderedDict(a=torch.ones(1)), "pair": _Pair(torch.zeros(1), 2),
             "rec": _Record(torch.ones(2), ["n"]), "plain": [torch.ones(1)]}
    node = batch_structure(batch)
    assert node["children"][3] is None and "type" not in node
    assert node["children"][0]["type"] == "collections:OrderedDict"
    back, notes = rebuild_batch(to_plain(batch), node, Importer([]))
    assert notes == []
    assert type(back["enc"]) is collections.OrderedDict
    assert isinstance(back["pair"], _Pair) and back["pair"].b == 2
    assert isinstance(back["rec"], _Record) and back["rec"].names == ["n"]
    assert back["rec"].total == 2.0                   # a field the constructor does not take
    assert batch_structure({"x": torch.ones(1), "ids": ["a"]}) is None

    @dataclasses.dataclass
    class Local:
        x: torch.Tensor
    node = batch_structure(Local(torch.ones(1)))
    assert node["type"] is None and "inside a function" in node["why"]
    back, notes = rebuild_batch(to_plain(Local(torch.ones(1))), node, Importer([]))
    assert type(back) is dict and "was replayed as a plain dict" in notes[0]


class _Pair(__import__("collections").namedtuple("_Pair", "a b")):
    pass


@__import__("dataclasses").dataclass
class _Record:
    values: torch.Tensor
    names: list
    total: float = __import__("dataclasses").field(init=False, default=0.0)

    def __post_init__(self):
        self.total = float(self.values.sum())
