"""The activation watch measures every module output of a sampled step once, whatever the heap
holds: an output that nothing keeps is freed within the forward, and the next module's output
may be given its address (its `id`)."""

import textwrap

import torch
from torch import nn

from nanaudit.config.entrypoints import user_import_path
from nanaudit.config.parse import load_config
from nanaudit.run.loop import run_steps
from nanaudit.run.session import build_session
from nanaudit.run.watch import ActivationWatch

# Each link adds one: `x + k` saves nothing for backward, so a link's output is freed as soon as
# the next link has read it (nn.Sequential drops it), and the link after may reuse its id.
CHAIN = """
    import torch
    from torch import nn

    class Add(nn.Module):
        def forward(self, x):
            return x + 1.0

    def build_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), *[Add() for _ in range(20)], nn.Linear(3, 1))

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            yield torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)

    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).mean()
"""


class _Add(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1.0


def test_every_module_output_is_measured_though_freed_ones_lend_their_id():
    model = nn.Sequential(*[_Add() for _ in range(30)])
    watch = ActivationWatch(model, every=1, fraction=0.9)
    watch.begin(0)
    with torch.no_grad():
        out = model(torch.zeros(4))
    watch.close()
    # 30 links; the Sequential returns the last link's tensor, measured once.
    assert len(watch.maxima) == 30
    assert [name for name, _ in watch.labels] == [str(i) for i in range(30)]
    assert float(torch.stack(watch.maxima).max()) == float(out.max()) == 30.0


def test_a_scans_largest_activation_is_the_largest_module_output(case):
    path = case(CHAIN, optimizer={"class": "torch.optim.SGD", "lr": 0.01}, seed=0,
                watch={"activations": 1})
    config = load_config(path)
    with user_import_path(config.base_dir):
        outcome = run_steps(build_session(config), None)
    assert outcome.trip is None and outcome.steps_run == 3
    # Step 0's module outputs, kept alive here so that none lends its id: the same model as
    # built (seeded) and the same first batch.
    code: dict = {}
    exec(textwrap.dedent(CHAIN), code)
    model, (x, _) = code["build_model"](), next(code["batches"]())
    outputs: list[torch.Tensor] = []
    for module in model:
        module.register_forward_hook(lambda m, a, out: outputs.append(out.detach()))
    model(x)
    assert len(outputs) == 22
    assert outcome.timeline[0].act_max == max(float(o.abs().max()) for o in outputs)
