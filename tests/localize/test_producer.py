"""Producer, not propagator, upstream of the model (issue 29): the walk from a bad batch leaf
through the data code's ops names the op that made it with the model's causes, or says the
value was already non-finite when it reached torch; a DataLoader worker's batch is made again
in this process only when that gives the very batch the worker handed out."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from nanaudit.localize.loader_tap import LoaderTap, remake
from nanaudit.localize.producer import DataCode, name_producer, origin_of
from nanaudit.localize.tracer import OpTracer
from nanaudit.report.model import Finding


def _input_finding() -> Finding:
    return Finding(step=3, where="input", value="nan", cause="nonfinite-input",
                   explanation="the batch of step 3 holds non-finite values", fix="clean it",
                   tensor="batch[0]", tensors=["batch[0]"], samples=[1])


def _log_counts():
    counts = torch.tensor([[3.0, 1.0], [0.0, 2.0]])
    return torch.log(counts)                                   # MADE


def _log1p_target():
    target = torch.tensor([0.5, -1.5, 2.0])
    return torch.log1p(target)                                 # MADE


def _sqrt_variance():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    var = (x * x).mean(0) - x.mean(0) ** 2 - 1.5               # a variance gone negative
    return torch.sqrt(var)                                     # MADE


def _standardize_constant_feature():
    x = torch.tensor([[1.0, 5.0], [2.0, 5.0], [4.0, 5.0]])
    return (x - x.mean(0)) / x.std(0)                          # MADE


def _masked_mean_of_an_empty_row():
    x, mask = torch.randn(2, 3), torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    return (x * mask).sum(1) / mask.sum(1)                     # MADE


def _inverse_lengths():
    lengths = torch.tensor([3, 0, 2])
    return 1 / lengths.float()                                 # MADE


def _exp_of_an_unnormalized_feature():
    price = torch.tensor([[12.0], [95.0]])
    return torch.exp(price)                                    # MADE


def _std_of_a_one_row_batch():
    x = torch.tensor([[1.0, 2.0]])
    return x - x.mean(0) / x.std(0)                            # MADE


DATA_CODE = {
    "log of a zero count": (_log_counts, "aten.log.default", "log-domain"),
    "log1p of a target below -1": (_log1p_target, "aten.log1p.default", "log-domain"),
    "sqrt of a variance below 0": (_sqrt_variance, "aten.sqrt.default", "sqrt-domain"),
    "standardize a constant feature": (_standardize_constant_feature, "aten.div.Tensor",
                                       "div-by-zero"),
    "masked mean of an empty row": (_masked_mean_of_an_empty_row, "aten.div.Tensor",
                                    "div-by-zero"),
    "1 / lengths with an empty sequence": (_inverse_lengths, "aten.reciprocal.default",
                                           "div-by-zero"),
    "exp of an unnormalized feature": (_exp_of_an_unnormalized_feature, "aten.exp.default",
                                       "exp-overflow"),
    "std of a one-row batch": (_std_of_a_one_row_batch, "aten.std.correction",
                               "degenerate-reduction"),
}


def _marked(fn, marker: str = "# MADE") -> int:
    """The line of `fn` that carries `marker`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if marker in line)


@pytest.mark.parametrize("name", sorted(DATA_CODE))
def test_the_data_code_op_is_named_with_the_models_cause_and_the_fix_names_its_line(name):
    make, op, cause = DATA_CODE[name]
    with OpTracer(nn.Module()) as tracer:
        leaf = make()
    finding = _input_finding()
    name_producer(finding, tracer, leaf, DataCode("the test's data code", [], OpTracer))
    line = _marked(make)
    assert (finding.op, finding.cause, finding.where) == (op, cause, "input")
    assert finding.source.line == line and finding.source.function == make.__name__
    assert finding.fix.startswith(f"at test_producer.py:{line}: ")
    assert finding.producer.made_by == "torch-op" and finding.reproduced is True
    assert finding.inputs and finding.samples == [1] and finding.tensors == ["batch[0]"]
    assert finding.explanation.startswith("the batch of step 3 holds non-finite values; it "
                                          "was made by the data code before the model")


def test_a_constant_feature_says_the_zero_came_from_std():
    with OpTracer(nn.Module()) as tracer:
        leaf = _standardize_constant_feature()
    assert "the value 0 came from std" in origin_of(tracer, leaf).made.diagnosis.explanation


def test_a_value_from_numpy_stays_an_input_and_says_where_it_entered_torch():
    table = np.array([[1.0, np.nan], [2.0, 3.0]])
    with OpTracer(nn.Module()) as tracer:
        features = torch.tensor(table, dtype=torch.float32)   # ENTERS
        leaf = features * 2.0
    finding = _input_finding()
    name_producer(finding, tracer, leaf, DataCode("the test's data code", [], OpTracer))
    line = _marked(test_a_value_from_numpy_stays_an_input_and_says_where_it_entered_torch,
                   "# ENTERS")
    assert finding.cause == "nonfinite-input" and finding.op is None and finding.fix == "clean it"
    assert finding.producer.made_by == "outside-torch"
    assert "already non-finite when it reached torch" in finding.explanation
    assert f"it entered torch at test_producer.py:{line}" in finding.explanation


def test_a_nan_in_the_data_set_names_its_data_set_index():
    x = torch.randn(16, 3)
    x[13, 2] = float("nan")                                    # in the data set already
    loader = DataLoader(TensorDataset(x), batch_size=4)
    with LoaderTap() as tap:
        iterator = iter(loader)
        next(iterator), next(iterator), next(iterator)
        tap.batches.clear()
        with OpTracer(nn.Module()) as tracer:
            (batch,) = next(iterator)
    finding = _input_finding()
    name_producer(finding, tracer, batch, DataCode("the loader", tap.batches, OpTracer))
    assert finding.cause == "nonfinite-input" and finding.producer.sample_indices == [13]
    assert "the data set's indices of those rows: [13]" in finding.explanation


class Augmented(Dataset):
    """Random augmentation from the worker's seeded torch RNG; optionally a value that only a
    worker process has (its pid), which the main process cannot make again."""

    def __init__(self, pid_dependent: bool = False):
        self.x = torch.ones(16, 3)
        self.x[9, 1] = 0.0
        self.pid_dependent = pid_dependent

    def __len__(self):
        return 16

    def __getitem__(self, i):
        noise = torch.rand(3) * 1e-3
        if self.pid_dependent:
            import os
            noise = noise + float(os.getpid())
        return torch.log(self.x[i]) + noise


@pytest.mark.distributed
def test_a_workers_batch_is_made_again_only_when_it_is_the_same_batch():
    torch.manual_seed(0)
    with LoaderTap() as tap:
        batches = list(DataLoader(Augmented(), batch_size=4, num_workers=2))
    record = tap.batches[2]                  # rows 8..11, worker 0's second task
    assert record.worker == 0 and record.index == [8, 9, 10, 11]
    with OpTracer(nn.Module()) as tracer:
        pass
    again, why = remake(record, tracer)
    assert why is None and torch.equal(again.nan_to_num(), batches[2].nan_to_num())
    finding = _input_finding()
    name_producer(finding, tracer, again, DataCode("the worker's code", [record], OpTracer))
    assert (finding.op, finding.cause) == ("aten.log.default", "log-domain")

    with LoaderTap() as tap:
        list(DataLoader(Augmented(pid_dependent=True), batch_size=4, num_workers=2))
    again, why = remake(tap.batches[2], OpTracer(nn.Module()))
    assert again is None and "differs from the one the worker handed out" in why
