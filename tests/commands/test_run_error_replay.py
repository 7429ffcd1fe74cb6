"""`nanaudit run` localizes an error trip (the script raised with non-finite values in its
frames) in the process that raised: the window's model calls and loss code up to the raise,
replayed under the tracer and verified against the run (the same exception), no second run."""

from __future__ import annotations

import pytest
from helpers import ROOT
from test_run_inprocess import audit, in_process, line_of, write

from nanaudit.commands.common import exit_code

POLICY = ROOT / "tests" / "e2e" / "scripts" / "raising_policy.py"
DCGAN = ROOT / "tests" / "e2e" / "scripts" / "dcgan_loop.py"


@pytest.mark.parametrize(("mode", "error", "op", "cause", "line", "samples"), [
    # torch.multinomial refuses the NaN the loss code's division by the annealed 0 made.
    ("sample", "RuntimeError: probability tensor contains", "aten.div.Tensor", "div-by-zero",
     "torch.softmax(policy(obs) / temperature", None),
    # The script's own assert on the loss a zeroed row's log made -inf.
    ("assert", "AssertionError: loss diverged", "aten.log.default", "log-domain",
     "loss = -torch.log(probs[:, 0])", [2]),
    # Raised inside the model's forward (Categorical's argument check): the replay raises it
    # again, and the value in its frames is walked back.
    ("forward", "ValueError: Expected parameter logits", "aten.div.Tensor", "div-by-zero",
     "logits = self.net(obs) / self.temperature", None),
])
def test_an_error_trip_is_replayed_in_process(tmp_path, mode, error, op, cause, line, samples):
    log = tmp_path / "train_log.txt"
    report = audit(POLICY, mode, str(log))
    f = report.finding
    assert exit_code(report) == 1 and report.error.exception == error.split(":")[0]
    assert (f.step, f.where, f.op, f.cause, f.samples) == (3, "forward", op, cause, samples)
    assert f.source.file == str(POLICY) and f.source.line == line_of(POLICY, line)
    assert f"the script then raised {error}" in f.explanation
    assert f.tensor == f.tensors[0] and f.tensors      # what the script's frames held
    in_process(report)
    # The script's own log: its three good steps, written once (nothing ran it again).
    assert log.read_text().splitlines() == [
        line for line in log.read_text().splitlines() if line.startswith("step ")]
    assert [x.split()[1] for x in log.read_text().splitlines()] == ["0", "1", "2"]


def test_a_raise_in_a_forward_the_model_wraps_names_the_same_op_as_the_rerun():
    # pytorch/examples dcgan at lr 1e30: the discriminator's weights reach 1e30, its next
    # forward overflows, BCELoss raises on the NaN (the e2e test pins the re-run's finding).
    report = audit(DCGAN, "--lr=1e30")
    f = report.finding
    assert exit_code(report) == 1 and report.error.exception == "RuntimeError"
    assert (f.step, f.where, f.op, f.module, f.source.line) == (1, "forward",
                                                                "aten.addmm.default", "2", 45)
    assert any(s.name == "mat2" and s.max >= 1e29 for s in f.inputs)
    assert f.explanation.endswith("the script then raised RuntimeError: all elements of input "
                                  "should be between 0 and 1")
    in_process(report)


def test_an_error_the_replay_does_not_raise_again_is_not_believed(tmp_path):
    # The forward divides by a countdown of its own calls: the replay is its fifth call, not
    # the fourth that divided by 0, so it raises nothing; the re-run from the start names it.
    path = write(tmp_path, """
        import torch
        from torch import nn

        class Countdown(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 3)
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                logits = self.lin(x) / (4 - self.calls)
                return torch.distributions.Categorical(logits=logits, validate_args=True)

        torch.manual_seed(0)
        model = Countdown()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(6):
            dist = model(torch.randn(8, 4))
            loss = -dist.log_prob(dist.sample()).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """)
    report = audit(path)
    replay = report.run.replay
    assert replay.status == "not-reproduced"
    assert replay.note == "the in-process replay of the step did not raise the run's ValueError"
    assert report.run.rerun.status == "reproduced"
    f = report.finding
    assert (f.step, f.op, f.cause, f.localized_by) == (3, "aten.div.Tensor", "div-by-zero",
                                                       "re-run")
    assert f.source.line == line_of(path, "logits = self.lin(x) / (4 - self.calls)")


def test_an_error_trip_names_the_element_of_a_sharded_op_output_as_the_rerun_does(tmp_path):
    # A column-wise layer (tensor parallel on a one-rank mesh) whose addmm overflows on row 1
    # of step 3's batch; the softmax of its output is NaN and torch.multinomial refuses it. The
    # creating op's output is a sharded DTensor: the finding names its bad element, read off
    # this rank's shard (a reduction on the DTensor itself has no sharding strategy).
    path = write(tmp_path, """
        import tempfile

        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        def train():
            torch.manual_seed(0)
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
            model = nn.Sequential(nn.Linear(4, 8))
            with torch.no_grad():
                model[0].weight.fill_(1.0)
            parallelize_module(model, mesh, {"0": ColwiseParallel()})
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
            for step in range(5):
                x = torch.rand(3, 4)
                if step == 3:
                    x[1] = 3e38
                probs = torch.softmax(model(x), dim=-1)
                loss = probs.gather(1, torch.multinomial(probs, 1)).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        with tempfile.NamedTemporaryFile() as store:
            dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0,
                                    world_size=1)
            try:
                train()
            finally:
                dist.destroy_process_group()
    """)
    report = audit(path)
    f = report.finding
    assert exit_code(report) == 1 and report.error.exception == "RuntimeError"
    assert (f.step, f.where, f.op, f.module, f.cause, f.samples) == (
        3, "forward", "aten.addmm.default", "0", "dtype-overflow", [1])
    assert f.source.line == line_of(path, "probs = torch.softmax(model(x)")
    assert (f.element.tensor, f.element.local_index, f.element.global_index) == (
        "aten.addmm.default output", [1, 0], [1, 0])
    in_process(report)
    rerun = audit(path, force_rerun=True).finding
    assert rerun.localized_by == "re-run"
    assert (rerun.op, rerun.samples, rerun.element) == (f.op, f.samples, f.element)


# A character model in the shape of minGPT's chargpt and makemore: trained a step at a time, and
# sampled from between steps under `no_grad` (`generate`: softmax of the last position's logits,
# then `torch.multinomial`). The script's own log gets a line per step.
SAMPLER = """
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    class CharModel(nn.Module):
        def __init__(self, vocab=12, dim=16):
            super().__init__()
            self.emb = nn.Embedding(vocab, dim)
            self.ln = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, idx):
            return self.head(self.ln(self.emb(idx)))

    @torch.no_grad()
    def generate(model, idx, steps, temperature):
        for _ in range(steps):
            logits = model(idx)[:, -1, :]
            probs = F.softmax(logits / temperature, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, num_samples=1)], dim=1)
        return idx

    torch.manual_seed(0)
    model = CharModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    blow_up, cold = int(sys.argv[2]), int(sys.argv[3])
    with open(sys.argv[1], "a") as log:
        for step in range(30):
            x, y = torch.randint(0, 12, (4, 8)), torch.randint(0, 12, (4, 8))
            loss = F.cross_entropy(model(x).view(-1, 12), y.view(-1))
            optimizer.zero_grad()
            loss.backward()
            # a learning rate that blows the weights up (finite) at one update
            optimizer.param_groups[0]["lr"] = 1e33 if step == blow_up else 0.1
            optimizer.step()
            log.write(f"step {step} {loss.item():.4f}\\n")
            model.eval()
            generate(model, torch.zeros(1, 1, dtype=torch.long), 4,
                     0.0 if step == cold else 0.8)
            model.train()
"""


@pytest.mark.parametrize(("blow_up", "cold", "op", "module", "cause", "line"), [
    # The update left the embedding near 1e31: the sampling forward's layer norm overflows.
    (20, -1, "aten.native_layer_norm.default", "ln", "divergence",
     "return self.head(self.ln(self.emb(idx)))"),
    # A temperature of 0: the sampling code's own division, after a finite forward.
    (-1, 12, "aten.div.Tensor", None, "div-by-zero", "probs = F.softmax(logits / temperature"),
])
def test_a_raise_while_sampling_between_steps_is_replayed_from_the_models_evaluation(
        tmp_path, blow_up, cold, op, module, cause, line):
    # Before: "the script raised before any model call of step N", a re-run from the start,
    # which traced nothing either (no model call between the update and the raise): no op.
    log = tmp_path / "train_log.txt"
    path = write(tmp_path, SAMPLER)
    report = audit(path, str(log), str(blow_up), str(cold))
    f = report.finding
    bad = max(blow_up, cold)
    assert exit_code(report) == 1 and report.error.exception == "RuntimeError"
    assert (f.step, f.where, f.op, f.module, f.cause) == (bad + 1, "forward", op, module, cause)
    assert f.source.file == str(path) and f.source.line == line_of(path, line)
    assert "the script then raised RuntimeError: probability tensor contains" in f.explanation
    in_process(report)
    # The script's own log: one line per step it took, written once.
    assert [x.split()[1] for x in log.read_text().splitlines()] == [
        str(i) for i in range(bad + 1)]


def test_a_sampling_raise_the_evaluations_replay_does_not_make_again_names_nothing(tmp_path):
    # The sampling forward divides by a countdown of its own calls: the replay is one call
    # later and finite, so nothing is named in-process (never a guess) and the re-run is
    # used; it arms its tracer at a training call, so it names nothing either, and says so.
    path = write(tmp_path, """
        import torch
        from torch import nn

        class Countdown(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 3)
                self.evaluations = 0

            def forward(self, x):
                if not torch.is_grad_enabled():
                    self.evaluations += 1
                    return self.lin(x) / (3 - self.evaluations)
                return self.lin(x)

        torch.manual_seed(0)
        model = Countdown()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for step in range(6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                probs = torch.softmax(model(torch.randn(1, 4)), dim=-1)
            torch.multinomial(probs, 1)
    """)
    report = audit(path)
    replay = report.run.replay
    assert replay.status == "not-reproduced" and "made finite" in replay.note
    f = report.finding
    assert (f.step, f.op, f.cause, f.localized_by) == (3, None, "unknown", None)
    assert report.run.rerun.status == "not-traced"
    assert "no module was called with autograd between step 2's update" in f.explanation
