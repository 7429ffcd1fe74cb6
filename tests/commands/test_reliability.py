"""Faults on purpose (issue 13): existing folders, unwritable outputs, a full disk, signals,
hostile and non-finite config values, internal errors. Each test failed on the code before it."""

import json
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET

import pytest
from helpers import LINEAR_CASE, ROOT, run_cli, scan, wait_for

EXAMPLES = ROOT / "configs" / "examples"


def _tree(folder):
    """Every file under folder with its bytes: what must survive a run byte for byte."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- never delete or overwrite what nanaudit did not create ---------------------------------

def test_repro_into_an_existing_user_folder_keeps_every_file(tmp_path):
    user = tmp_path / "results"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("my experiment notes\n")
    (user / "sub" / "model.pt").write_bytes(b"\x80weights")
    before = _tree(user)
    result = scan(EXAMPLES / "log_negative.yaml", "--repro", user, tmp_path=tmp_path)
    assert result.code == 1
    after = _tree(user)
    assert {k: after[k] for k in before} == before
    # The bundle went into a fresh subfolder and the report says where.
    assert result.report["repro"] == str(user / "repro-step3")
    assert (user / "repro-step3" / "repro.py").is_file()


def test_repro_dot_never_wipes_the_working_folder(tmp_path):
    (tmp_path / "train.py").write_text("print('mine')\n")
    before = _tree(tmp_path)
    result = run_cli("scan", EXAMPLES / "log_negative.yaml", "-q", "--repro", ".")
    assert result.code == 1
    after = _tree(tmp_path)
    assert {k: after[k] for k in before} == before
    assert (tmp_path / "repro-step3" / "nanaudit-bundle.json").is_file()


def test_a_second_run_replaces_its_own_bundle_but_not_one_a_user_added_to(tmp_path):
    target = tmp_path / "bundle"
    assert scan(EXAMPLES / "log_negative.yaml", "--repro", target, tmp_path=tmp_path).code == 1
    first = (target / "report.json").read_bytes()
    assert scan(EXAMPLES / "log_negative.yaml", "--repro", target, tmp_path=tmp_path).code == 1
    assert (target / "report.json").read_bytes() != first       # replaced: it was ours
    (target / "my_analysis.ipynb").write_text("{}")
    result = scan(EXAMPLES / "log_negative.yaml", "--repro", target, tmp_path=tmp_path)
    assert result.code == 1 and (target / "my_analysis.ipynb").read_text() == "{}"
    assert result.report["repro"] == str(target / "repro-step3")


def test_a_numbered_folder_when_the_step_folder_is_taken(tmp_path):
    user = tmp_path / "out"
    (user / "repro-step3").mkdir(parents=True)
    (user / "repro-step3" / "keep.txt").write_text("x")
    result = scan(EXAMPLES / "log_negative.yaml", "--repro", user, tmp_path=tmp_path)
    assert result.report["repro"] == str(user / "repro-step3-2")
    assert (user / "repro-step3" / "keep.txt").read_text() == "x"


# --- a requested output that cannot be written is exit 9 --------------------------------------

def test_json_path_that_is_a_folder_fails_before_any_step(tmp_path):
    (tmp_path / "report.json").mkdir()
    marker = tmp_path / "data-started"
    config = _case(tmp_path, marker=marker)
    result = run_cli("scan", config, "--json", tmp_path / "report.json")
    assert result.code == 9
    assert "report.json is a folder" in result.stderr
    assert not marker.exists(), "the scan ran before the output was checked"


@pytest.mark.parametrize("option", ["--junit-xml", "--markdown", "--json"])
def test_disk_full_is_exit_9_and_leaves_the_old_report_and_no_temp_file(tmp_path, monkeypatch,
                                                                       option):
    import errno

    import nanaudit.report.output
    out = tmp_path / "reports" / "out.txt"
    out.parent.mkdir()
    out.write_text("last run's report")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(nanaudit.report.output.os, "fsync", full)
    result = run_cli("scan", ROOT / "configs" / "clean.yaml", "-q", option, out)
    assert result.code == 9, "a clean scan must not pass when its report was not written"
    assert "No space left on device" in result.stderr
    assert out.read_text() == "last run's report"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out.txt"]


def test_unwritable_explicit_repro_is_exit_9_default_bundle_only_a_note(tmp_path, monkeypatch):
    import nanaudit.commands.bundle

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(nanaudit.commands.bundle.tempfile, "mkdtemp", refuse)
    explicit = scan(EXAMPLES / "log_negative.yaml", "--repro", tmp_path / "b", tmp_path=tmp_path)
    assert explicit.code == 9 and "Permission denied" in explicit.stderr
    assert explicit.report["finding"]["op"] == "aten.log.default"   # the report is still out
    default = scan(EXAMPLES / "log_negative.yaml", tmp_path=tmp_path)
    assert default.code == 1 and default.report["repro"] is None


def test_skip_list_that_cannot_be_written_is_exit_9(tmp_path):
    (tmp_path / "skip.json").mkdir()
    result = run_cli("bisect", ROOT / "configs" / "poisoned_data.yaml", "-q", "--skip-list",
                     tmp_path / "skip.json")
    assert result.code == 9


def test_plot_without_matplotlib_is_refused_before_the_scan(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    marker = tmp_path / "data-started"
    result = run_cli("scan", _case(tmp_path, marker=marker), "--plot", tmp_path / "p.png")
    assert result.code == 2 and "pip install 'nanaudit[plot]'" in result.stderr
    assert not marker.exists()


# --- files honour the umask -------------------------------------------------------------------

@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755),
                                                        (0o077, 0o600, 0o700)])
def test_reports_and_bundles_honour_the_umask(tmp_path, umask, file_mode, dir_mode):
    old = os.umask(umask)
    try:
        result = scan(EXAMPLES / "log_negative.yaml", "--repro", tmp_path / "bundle",
                      tmp_path=tmp_path)
    finally:
        os.umask(old)
    assert result.code == 1
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == file_mode
    assert (tmp_path / "bundle").stat().st_mode & 0o777 == dir_mode
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "bundle").iterdir()} == {file_mode}


# --- signals ----------------------------------------------------------------------------------

SLOW_CASE = textwrap.dedent("""
    import pathlib, time
    import torch
    from torch import nn

    MARK = pathlib.Path(__file__).with_name("marker")

    def build_model():
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def batches():
        g = torch.Generator().manual_seed(0)
        for step in range(1000):
            if step == 3:
                MARK.write_text("step 3")
            time.sleep(0.05)
            yield torch.randn(8, 4, generator=g)

    def loss(model, batch):
        return model(batch).square().mean()
""")

SEARCH_CASE = textwrap.dedent("""
    import pathlib, time
    import torch
    from torch import nn

    MARK = pathlib.Path(__file__).with_name("marker")

    def build_model():
        model = nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias.fill_(0.1)
        return model

    def batches():
        x = torch.rand(64, 4)
        x[37] = -5.0
        yield x

    def loss(model, batch):
        if batch.shape[0] < 64:          # a replay of part of the batch: the sample search
            MARK.write_text("searching")
            time.sleep(0.2)
        return -torch.log(model(batch)).mean()
""")


def _spawn(tmp_path, code, *extra):
    (tmp_path / "case.py").write_text(code)
    (tmp_path / "config.yaml").write_text("model: case:build_model\ndata: case:batches\n"
                                          "loss: case:loss\noptimizer: {class: torch.optim.SGD, "
                                          "lr: 0.0}\n")
    args = [sys.executable, "-m", "nanaudit", "scan", str(tmp_path / "config.yaml"), "-q",
            "--json", str(tmp_path / "r.json"), "--junit-xml", str(tmp_path / "r.xml"),
            "--markdown", str(tmp_path / "r.md"), *extra]
    return subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)



def _partial_reports(tmp_path):
    report = json.loads((tmp_path / "r.json").read_text())
    ET.parse(tmp_path / "r.xml")                      # well-formed
    assert (tmp_path / "r.md").read_text().strip()
    return report


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_mid_scan_leaves_valid_partial_reports(tmp_path, sig, code):
    proc = _spawn(tmp_path, SLOW_CASE)
    wait_for(tmp_path / "marker", proc)
    time.sleep(random.uniform(0.0, 0.2))              # somewhere inside a step
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == code
    report = _partial_reports(tmp_path)
    assert report["status"] == "interrupted" and report["steps_run"] >= 3
    assert report["error"]["signal"] == sig.name and report["error"]["exit_code"] == code
    assert len(report["timeline"]) == report["steps_run"]


@pytest.mark.slow
def test_sigterm_during_the_sample_search_keeps_the_localized_op(tmp_path):
    proc = _spawn(tmp_path, SEARCH_CASE)
    wait_for(tmp_path / "marker", proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    report = _partial_reports(tmp_path)
    assert report["status"] == "interrupted"
    f = report["finding"]
    assert f["op"] == "aten.log.default" and f["cause"] == "log-domain"
    assert f["sample_search"]["note"].startswith("interrupted after")


@pytest.mark.slow
def test_a_second_signal_exits_at_once(tmp_path):
    stubborn = SLOW_CASE.replace("        time.sleep(0.05)\n", textwrap.indent(textwrap.dedent("""
        try:
            time.sleep(0.05 if step < 3 else 60)
        except KeyboardInterrupt:     # user code that swallows the first interrupt
            time.sleep(60)
    """), " " * 8))
    assert "swallows" in stubborn
    proc = _spawn(tmp_path, stubborn)
    wait_for(tmp_path / "marker", proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143 and time.monotonic() - started < 10


# --- config values and overrides --------------------------------------------------------------

def _case(tmp_path, marker=None, **config):
    code = LINEAR_CASE
    if marker is not None:
        code = code.replace("def batches():\n", f"def batches():\n    open({str(marker)!r}, 'w')"
                                                f".close()\n")
    (tmp_path / "case.py").write_text(code)
    lines = {"model": "case:build_model", "data": "case:batches", "loss": "case:loss",
             "optimizer": {"class": "torch.optim.SGD", "lr": 0.1}, **config}
    import yaml
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(lines, sort_keys=False))
    return tmp_path / "config.yaml"


@pytest.mark.parametrize("option, value, key", [("--device", "tpu", "--device (overrides `device`)"),
                                                ("--seed", str(2**70), "--seed (overrides `seed`)")])
def test_command_line_overrides_are_validated_like_their_keys(tmp_path, option, value, key):
    result = scan(_case(tmp_path), option, value, tmp_path=tmp_path)
    assert result.code == 3
    assert key in {p["key"] for p in result.report["error"]["problems"]}


@pytest.mark.parametrize("config, key", [
    ({"optimizer": {"class": "torch.optim.SGD", "lr": float("nan")}}, "optimizer.lr"),
    ({"grad_clip": float("nan")}, "grad_clip"),
    ({"amp": {"init_scale": float("inf")}, "precision": "fp16"}, "amp.init_scale"),
    ({"optimizer": {"class": "torch.optim.Adam", "lr": 0.1, "betas": [0.9, float("inf")]}},
     "optimizer.betas"),
    ({"watch": {"spike_window": 2**70}}, "watch.spike_window"),
])
def test_non_finite_and_huge_numbers_are_config_errors(tmp_path, config, key):
    path = _case(tmp_path, **config)
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 3, result.report["error"]
    assert key in {p["key"] for p in result.report["error"]["problems"]}
    assert run_cli("validate", path).code == 3


@pytest.mark.parametrize("kwargs", [{"lr": 0.1, "nesterov_typo": True}, {"lr": -1.0}])
def test_optimizer_kwargs_problem_is_exit_3_in_scan_and_validate(tmp_path, kwargs):
    path = _case(tmp_path, optimizer={"class": "torch.optim.SGD", **kwargs})
    scanned, validated = scan(path, tmp_path=tmp_path), run_cli("validate", path)
    assert (scanned.code, validated.code) == (3, 3)
    assert scanned.report["error"]["problems"][0]["key"] == "optimizer"


# "Billion laughs": nine levels of nine aliases, 9**9 values once expanded, inside an optimizer
# argument that every report copies out (the config summary) and the bundle's meta.json.
BOMB = ("model: case:build_model\ndata: case:batches\nloss: case:loss\n"
        "optimizer: {class: torch.optim.SGD, lr: 0.1, junk: [&a [x, x, x, x, x, x, x, x, x], "
        + ", ".join(f"&{chr(98 + i)} [" + ", ".join([f"*{chr(97 + i)}"] * 9) + "]"
                    for i in range(8)) + "]}\n")


@pytest.mark.parametrize("text, message", [
    (BOMB, "expands to more than"),
    ("model: &m [*m]\ndata: case:batches\nloss: case:loss\n", "refers to the node"),
    ("model: case:build_model\n" + "# padding\n" * 150_000, "bytes"),
], ids=["alias-bomb", "self-reference", "oversized"])    # (an id holding the 1.5 MB text
# went into PYTEST_CURRENT_TEST, over Linux's 128 KiB per variable, on some pytest versions:
# then no subprocess of the test could start)
def test_hostile_yaml_is_a_quick_config_error(tmp_path, text, message):
    (tmp_path / "case.py").write_text(LINEAR_CASE)
    (tmp_path / "config.yaml").write_text(text)
    for command in (["scan", "--json", "r.json"], ["validate"]):
        # A subprocess with a deadline: the failure this guards against is a hang (an expanded
        # bomb, a recursive walk), which is CPU spent in the child. "Quick" is judged on that
        # CPU time, not on the wall clock, which a loaded machine stretches many times over.
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-m", "nanaudit", command[0], "config.yaml",
                               *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert done.returncode == 3 and message in done.stderr, done.stderr[-500:]
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert cpu_s < 30, cpu_s


# --- internal errors --------------------------------------------------------------------------

def test_an_internal_error_says_it_is_our_bug_with_a_short_trace(tmp_path, monkeypatch):
    import nanaudit.localize.findings

    def broken(*args, **kwargs):
        raise RuntimeError("an invariant broke")
    monkeypatch.setattr(nanaudit.localize.findings, "localized_finding", broken)
    out = tmp_path / "r.json"
    result = run_cli("scan", EXAMPLES / "log_negative.yaml", "--json", out, "--no-repro")
    assert result.code == 6
    assert "this is a bug in nanaudit" in result.stderr and "an invariant broke" in result.stderr
    assert "Traceback (last frames" in result.stderr
    error = json.loads(out.read_text())["error"]
    assert error["type"] == "InternalError" and "this is a bug in nanaudit" in error["hint"]
    assert "localized_finding" not in result.stderr.split("Traceback")[0]
    assert error["traceback"].count('File "') > result.stderr.count('File "')


SPARSE_CASE = textwrap.dedent("""
    import torch
    from torch import nn

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8, sparse=True)
            self.head = nn.Linear(8, 1)
        def forward(self, ids):
            return self.head(self.emb(ids).mean(1))

    def build_model():
        torch.manual_seed(0)
        return Bag()

    def batches():
        g = torch.Generator().manual_seed(0)
        for _ in range(5):
            yield torch.randint(0, 50, (4, 6), generator=g), torch.randn(4, 1, generator=g)

    def loss(model, batch):
        ids, y = batch
        return ((model(ids) - y) ** 2).mean()

    def optimizers(model):
        return torch.optim.SGD(model.parameters(), lr=0.1)
""")


def test_sparse_gradients_are_checked_not_a_crash(tmp_path):
    (tmp_path / "case.py").write_text(SPARSE_CASE)
    (tmp_path / "config.yaml").write_text("model: case:build_model\ndata: case:batches\n"
                                          "loss: case:loss\noptimizer: case:optimizers\n")
    result = scan(tmp_path / "config.yaml", tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 5
    assert all(e["grad_norm"] > 0 for e in result.report["timeline"])


# --- console in CI logs -----------------------------------------------------------------------

def test_console_is_not_wrapped_when_piped(tmp_path):
    deep = tmp_path / ("a_rather_long_folder_name_" * 4) / "experiments"
    deep.mkdir(parents=True)
    for name in ("log_negative.py", "log_negative.yaml"):
        (deep / name).write_text((EXAMPLES / name).read_text())
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run([sys.executable, "-m", "nanaudit", "scan", str(deep / "log_negative.yaml"),
                           "--no-repro"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1
    source = f"{deep / 'log_negative.py'}:27"
    assert any(source in line for line in done.stderr.splitlines()), done.stderr


def test_clean_hint_does_not_ask_for_more_steps_when_the_data_ran_out(tmp_path):
    result = run_cli("scan", _case(tmp_path, steps=50), "--no-repro")
    assert result.code == 0
    assert "raise `steps:`" not in result.stderr and "every batch the data yielded" in result.stderr
    limited = run_cli("scan", _case(tmp_path, steps=2), "--no-repro")
    assert "2-step limit was reached" in limited.stderr


# --- exit codes documented once ---------------------------------------------------------------

def test_exit_code_table_in_readme_and_help_come_from_the_enum():
    from nanaudit.exitcodes import EXIT_CODE_HELP, ExitCode
    readme = (ROOT / "README.md").read_text()
    for code in ExitCode:
        assert f"| {int(code)} | {code.doc} |" in readme, code
        assert f"  {int(code):<4} {code.doc}" in EXIT_CODE_HELP


def test_readme_ci_recipe_installs_from_the_repository_not_an_index():
    readme = (ROOT / "README.md").read_text()
    ci = readme[readme.index("## In CI"):readme.index("## Repro bundles")]
    assert "pip install nanaudit" not in ci
    assert "pip install ./tools/nanaudit" in ci


# --- warnings that do not cry wolf ------------------------------------------------------------

@pytest.mark.parametrize("noise", ["half-normal", "log-normal", "uniform", "signed"])
def test_a_long_clean_run_of_a_noisy_loss_near_zero_raises_no_spike(noise):
    import math

    from nanaudit.config.schema import WatchOptions
    from nanaudit.run.watch import GrowthWatch
    draw = {"half-normal": lambda r: abs(r.gauss(0, 1)) * 1e-4,
            "log-normal": lambda r: 1e-3 * math.exp(r.gauss(0, 0.5)),
            "uniform": lambda r: r.random() * 1e-3,
            "signed": lambda r: r.gauss(0, 1e-4)}[noise]
    rng, watch = random.Random(0), GrowthWatch(WatchOptions())
    warnings = [w for step in range(5000) for w in watch.observe(step, draw(rng), None)]
    assert warnings == []


def test_a_real_spike_is_still_caught_near_zero():
    from nanaudit.config.schema import WatchOptions
    from nanaudit.run.watch import GrowthWatch
    rng, watch = random.Random(0), GrowthWatch(WatchOptions())
    seen = [w.step for step in range(300) for w in watch.observe(
        step, 5e-2 if step == 200 else 1e-3 * (1 + 0.1 * rng.gauss(0, 1)), None)]
    assert seen == [200]


# --- the sample search does not give up early -------------------------------------------------

def test_three_bad_rows_in_a_batch_of_4096_are_all_found():
    from nanaudit.localize.samples import isolate_rows
    bad = {17, 2048, 4000}
    search = isolate_rows(lambda rows: bool(bad & set(rows)), 4096, max_replays=64)
    assert search.samples == sorted(bad) and search.note == ""
    assert 64 < search.replays < 120


TWO_KINDS = textwrap.dedent("""
    import torch
    from torch import nn

    def build_model():
        model = nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias.fill_(0.1)
        return model

    def batches():
        x = torch.rand(8, 3)
        x[2, 1] = float("nan")     # a missing value in row 2
        x[5] = -4.0                # a sensor fault in row 5: log of a negative rate
        yield {"x": x, "id": torch.arange(100, 108)}

    def loss(model, batch):
        return -torch.log(model(batch["x"])).mean()
""")


def test_two_bad_rows_of_different_kinds_both_reach_the_skip_list(tmp_path):
    (tmp_path / "case.py").write_text(TWO_KINDS)
    (tmp_path / "config.yaml").write_text("model: case:build_model\ndata: case:batches\n"
                                          "loss: case:loss\n")
    result = run_cli("bisect", tmp_path / "config.yaml", "-q", "--skip-list", tmp_path / "s.json")
    assert result.code == 1
    skip = json.loads((tmp_path / "s.json").read_text())["skip"]
    assert [(s["rows"], s["sample_ids"], s["cause"]) for s in skip] == [
        ([2], [102], "nonfinite-input"), ([5], [105], "log-domain")]


def test_a_batch_of_thousands_of_bad_leaves_gives_a_bounded_report(tmp_path):
    (tmp_path / "case.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build_model():
            return nn.Linear(2, 1)

        def batches():
            yield [torch.full((4, 2), float("nan")) for _ in range(3000)]

        def loss(model, batch):
            return sum(model(x).mean() for x in batch[:2])
    """))
    (tmp_path / "config.yaml").write_text("model: case:build_model\ndata: case:batches\n"
                                          "loss: case:loss\n")
    result = scan(tmp_path / "config.yaml", "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1 and f["cause"] == "nonfinite-input"
    assert len(f["inputs"]) == 16 and "and 2984 more leaves" in f["explanation"]
    assert (tmp_path / "report.json").stat().st_size < 400_000


def test_a_nan_behind_a_sparse_embedding_is_replayed_and_localized(tmp_path):
    code = SPARSE_CASE.replace(
        "return self.head(self.emb(ids).mean(1))",
        "h = self.emb(ids).mean(1)\n        return self.head(torch.log(h.abs() * (ids[:, :1] != 7)))"
    ).replace("yield torch.randint(0, 50, (4, 6), generator=g), torch.randn(4, 1, generator=g)",
              "ids = torch.randint(8, 50, (4, 6), generator=g)\n"
              "        if _ == 2:\n            ids[1, 0] = 7       # a padding id: an all-zero row\n"
              "        yield ids, torch.randn(4, 1, generator=g)")
    (tmp_path / "case.py").write_text(code)
    (tmp_path / "config.yaml").write_text("model: case:build_model\ndata: case:batches\n"
                                          "loss: case:loss\noptimizer: case:optimizers\n")
    result = scan(tmp_path / "config.yaml", "--no-repro", tmp_path=tmp_path)
    f = result.finding
    assert result.code == 1, result.report["error"]
    assert (f["step"], f["where"], f["op"], f["cause"], f["samples"]) == (
        2, "forward", "aten.log.default", "log-domain", [1])


def test_an_edited_or_linked_bundle_is_the_users_and_is_never_replaced(tmp_path):
    target = tmp_path / "bundle"
    assert scan(EXAMPLES / "log_negative.yaml", "--repro", target, tmp_path=tmp_path).code == 1
    (target / "repro.py").write_text("# my own debugging notes\n")       # edited in place
    result = scan(EXAMPLES / "log_negative.yaml", "--repro", target, tmp_path=tmp_path)
    assert (target / "repro.py").read_text() == "# my own debugging notes\n"
    assert result.report["repro"] == str(target / "repro-step3")
    elsewhere = tmp_path / "elsewhere"
    assert scan(EXAMPLES / "log_negative.yaml", "--repro", elsewhere, tmp_path=tmp_path).code == 1
    link = tmp_path / "link"
    link.symlink_to(elsewhere, target_is_directory=True)
    before = _tree(elsewhere)
    result = scan(EXAMPLES / "log_negative.yaml", "--repro", link, tmp_path=tmp_path)
    assert result.report["repro"] == str(link / "repro-step3")
    assert {k: v for k, v in _tree(elsewhere).items() if not k.startswith("repro-step3")} == before


def test_a_callbacks_bundle_never_deletes_a_users_folder(tmp_path):
    # The integrations write their bundles under the same rules as `scan`.
    from types import SimpleNamespace

    import torch

    from nanaudit.integrations._output import write_step_bundle
    taken = tmp_path / "out" / "repro-step3"
    taken.mkdir(parents=True)
    (taken / "mine.txt").write_text("notes")
    model = torch.nn.Linear(2, 1)
    rng = SimpleNamespace(torch_cpu=torch.get_rng_state(), cuda=None, python=(3, (1, 2), None))
    state = SimpleNamespace(step=3, rng=rng, batch=torch.zeros(4, 2), scale=None)
    written = write_step_bundle(taken, model, None, SimpleNamespace(check="loss"), state, None,
                                "{}", {})
    assert (taken / "mine.txt").read_text() == "notes"
    assert written == taken / "repro-step3" and (written / "nanaudit-bundle.json").is_file()


def test_deeply_nested_yaml_is_a_config_error_not_our_bug(tmp_path):
    (tmp_path / "case.py").write_text(LINEAR_CASE)
    (tmp_path / "config.yaml").write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
    for command in ("scan", "validate"):
        result = run_cli(command, tmp_path / "config.yaml")
        assert result.code == 3 and "nests too deeply" in result.stderr


def test_deeply_nested_yaml_is_refused_whatever_recursion_limit_the_process_set(
        tmp_path):
    # A library raised the limit (in CI a test before this one in the same worker did, and the
    # 5,000 levels parsed): the parse's own bound refuses it alike.
    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(200_000)
    try:
        (tmp_path / "config.yaml").write_text("model: " + "[" * 5000 + "]" * 5000 + "\n")
        result = run_cli("validate", tmp_path / "config.yaml")
        assert sys.getrecursionlimit() == 200_000            # put back as it was
    finally:
        sys.setrecursionlimit(old)
    assert result.code == 3 and "nests too deeply" in result.stderr


def test_a_symlinked_report_path_is_written_through_not_replaced(tmp_path):
    real = tmp_path / "artifacts" / "real.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "report.json"
    link.symlink_to(real)
    result = run_cli("scan", ROOT / "configs" / "clean.yaml", "-q", "--json", link)
    assert result.code == 0 and link.is_symlink()
    assert json.loads(real.read_text())["status"] == "clean"


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_while_torch_is_still_importing_leaves_a_report(tmp_path, sig, code):
    # Before the run has a report of its own (imports take a second or more).
    proc = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, nanaudit.cli as cli\n"
        "import builtins\n"
        "real = builtins.__import__\n"
        "def slow(name, *a, **k):\n"
        "    if name == 'torch':\n"
        "        open('importing', 'w').close(); time.sleep(30)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = slow\n"
        "cli.main(['scan', sys.argv[1], '-q', '--json', 'r.json'])\n"),
        str(ROOT / "configs" / "demo.yaml")], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "importing", proc)
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == code
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "interrupted" and report["error"]["signal"] == sig.name
