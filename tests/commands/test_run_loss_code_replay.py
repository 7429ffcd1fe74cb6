"""The in-process replay of the script's loss code leaves the script's state as the trip left
it, and replays the loss shapes real scripts write: a metric updated in place between forward
and backward is not updated twice, a teacher's `no_grad` forward makes no gradients, and a
gradient penalty (`torch.autograd.grad(..., create_graph=True)`, WGAN-GP) is part of the loss,
replayed in-process, its critic's parameters named by the script's own variable, and a second
`backward` of the same loss code (an auxiliary loss after `retain_graph=True`) is replayed too."""

from __future__ import annotations

import textwrap

from helpers import line_of

from nanaudit.commands.common import exit_code
from nanaudit.commands.run import run_script
from nanaudit.script.target import ScriptOptions, ScriptTarget


def _run(tmp_path, code: str, **options):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(code))
    return path, run_script(ScriptTarget(path=str(path)), ScriptOptions(**options))


METRIC = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = torch.zeros(())           # a running metric, updated in place before backward
    expected = 0.0
    for step in range(6):
        x = torch.randn(32, 8)
        if step == 3:
            x[7] = 0.0
        out = model(x)
        seen += out.detach().sum()
        expected += float(out.detach().sum())
        loss = torch.sqrt((out * x[:, :1]) ** 2).mean()     # sqrt'(0) = inf at row 7
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert abs(float(seen) - expected) < 1e-3, f"metric {float(seen)} != {expected}"
"""


def test_a_metric_updated_in_place_is_not_updated_again_by_the_replay(tmp_path):
    path, report = _run(tmp_path, METRIC, keep_going=True)
    f = report.finding
    assert report.error is None                 # the script's own assertion held
    assert exit_code(report) == 1
    assert (f.step, f.where, f.cause, f.samples) == (3, "backward", "sqrt-domain", [7])
    assert f.source.line == line_of(path, "loss = torch.sqrt(")
    assert f.localized_by == "in-process"


TEACHER = """
    import torch
    from torch import nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    student = nn.Linear(8, 4)
    teacher = nn.Linear(8, 4)
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    for step in range(5):
        x = torch.randn(16, 8)
        logits = student(x)
        with torch.no_grad():
            target = F.softmax(teacher(x) / (0.0 if step == 2 else 1.0), dim=-1)  # T = 0
        loss = F.kl_div(F.log_softmax(logits, dim=-1), target, reduction="batchmean")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(p.grad is None for p in teacher.parameters()), "the teacher got gradients"
"""


def test_a_teachers_no_grad_forward_in_the_loss_code_makes_no_gradients(tmp_path):
    path, report = _run(tmp_path, TEACHER, keep_going=True)
    f = report.finding
    assert report.error is None
    assert f.step == 2 and f.where == "forward"
    assert f.source.line == line_of(path, "target = F.softmax(teacher(x)")
    assert f.localized_by == "in-process"


PENALTY = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.5, 0.9))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4, betas=(0.5, 0.9))


    def gradient_penalty(real, fake):
        alpha = torch.rand(real.size(0), 1)
        mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
        norm = torch.sqrt((grad ** 2).sum(dim=1))           # no eps: sqrt'(0) = inf
        return ((norm - 1) ** 2).mean()


    for step in range(6):
        if step == 4:
            with torch.no_grad():
                critic[2].weight.zero_()     # a critic whose input gradient is 0
        real = torch.randn(16, 8)
        fake = generator(torch.randn(16, 4)).detach()
        loss_c = critic(fake).mean() - critic(real).mean() + 10 * gradient_penalty(real, fake)
        opt_c.zero_grad()
        loss_c.backward()
        opt_c.step()
        loss_g = -critic(generator(torch.randn(16, 4))).mean()
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
"""


def test_a_gradient_penalty_is_replayed_in_process_and_the_critic_named(tmp_path):
    path, report = _run(tmp_path, PENALTY)
    f = report.finding
    assert exit_code(report) == 1
    # Two optimizers: the critic's step of loop step 4 is the run's step 8.
    assert (f.step, f.where, f.forward_op, f.cause) == (8, "backward", "aten.sqrt.default",
                                                      "sqrt-domain")
    assert f.source.line == line_of(path, "norm = torch.sqrt(")
    assert f.localized_by == "in-process" and report.run.rerun is None
    assert f.tensors[0] == "critic.0.weight"


TWO_BACKWARDS = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(6):
        x = torch.randn(32, 8)
        out = model(x)
        main = out[:, 0].pow(2).mean()
        gate = 0.0 if step == 3 else 1.0
        aux = torch.sqrt(out[:, 1] * out[:, 1] * gate).mean()      # sqrt'(0) = inf
        optimizer.zero_grad()
        main.backward(retain_graph=True)
        aux.backward()
        optimizer.step()
"""


def test_a_second_backward_of_the_loss_code_is_replayed_in_process(tmp_path):
    path, report = _run(tmp_path, TWO_BACKWARDS)
    f = report.finding
    assert (f.step, f.where, f.forward_op, f.cause) == (3, "backward", "aten.sqrt.default",
                                                      "sqrt-domain")
    assert f.source.line == line_of(path, "aux = torch.sqrt(")
    assert f.localized_by == "in-process" and report.run.rerun is None


GAN = """
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 64),
                      nn.BatchNorm1d(64, 0.8), nn.LeakyReLU(0.2), nn.Linear(64, 16), nn.Tanh())
    D = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=1e20)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e20)
    for step in range(4):
        imgs = torch.rand(16, 16) * 2 - 1
        z = torch.randn(16, 8)
        g_loss = F.binary_cross_entropy_with_logits(D(G(z)), torch.ones(16, 1))
        opt_g.zero_grad(); g_loss.backward(); opt_g.step()
        real = F.binary_cross_entropy_with_logits(D(imgs), torch.ones(16, 1))
        fake = F.binary_cross_entropy_with_logits(D(G(z).detach()), torch.zeros(16, 1))
        d_loss = (real + fake) / 2
        opt_d.zero_grad(); d_loss.backward(); opt_d.step()
"""


def test_a_generator_called_in_the_critics_loss_code_is_named_by_its_variable(tmp_path):
    """Lightning's domain_templates/generative_adversarial_net.py (manual optimization, two
    Adams) at `--lr 1e20`: the generator's update of step 0 makes the critic's step 1 overflow
    in the generator, called in the critic's loss code (`D(G(z).detach())`). The replay ran
    after the trip unwound the script's frames, so the modules they held were not named, and
    the ops the loss code replayed (no module call) named no module at all: `G.2` now."""
    path, report = _run(tmp_path, GAN)
    f = report.finding
    assert exit_code(report) == 1
    assert (f.step, f.where, f.op, f.module) == (1, "forward", "aten.addmm.default", "G.2")
    assert f.source.line == line_of(path, "fake = F.binary_cross_entropy_with_logits(")
    assert f.localized_by == "in-process"
    assert [link.module for link in f.chain[:2]] == ["G.2", "G.3"]


CRITIC_FORWARD = """
    import torch
    from torch import nn


    class LogFeatures(nn.Module):
        def __init__(self):
            super().__init__()
            self.eps = 1e-3

        def forward(self, x):
            return torch.log(torch.relu(x) + self.eps)      # log(0) once eps is 0


    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    critic = nn.Sequential(nn.Linear(8, 16), LogFeatures(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-4)
    for step in range(6):
        if step == 3:
            critic[1].eps = 0.0
        fake = generator(torch.randn(16, 4))        # the step's model
        loss_g = -critic(fake).mean()               # the critic runs in the loss code
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
"""


def test_an_op_of_a_second_model_in_the_loss_code_names_its_module(tmp_path):
    path, report = _run(tmp_path, CRITIC_FORWARD)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.module == "critic.1"
    assert f.source.line == line_of(path, "return torch.log(torch.relu(x)")
    assert f.localized_by == "in-process"


def test_the_rerun_names_the_second_models_module_as_the_in_process_replay_does(tmp_path):
    # --rerun: the re-run's tracer names the critic's modules by the script's own variable
    # (Ledger.tracer_names, learned at step N's first call), not by their class (`<LogFeatures>`).
    path, report = _run(tmp_path, CRITIC_FORWARD, force_rerun=True)
    f = report.finding
    assert (f.step, f.where, f.op, f.cause) == (3, "forward", "aten.log.default", "log-domain")
    assert f.localized_by == "re-run" and report.run.rerun.status == "reproduced"
    assert f.module == "critic.1"
    assert f.source.line == line_of(path, "return torch.log(torch.relu(x)")
