"""Bad input gets one clear message naming the problem and where it is, and a documented code."""

import sys

import pytest
import torch
from helpers import LINEAR_CASE, run_cli, scan


class Opaque:
    """A class a weights_only load must refuse to unpickle."""


def _error(result):
    assert result.report["status"] == "error"
    return result.report["error"]


def test_missing_config_file(tmp_path):
    result = scan(tmp_path / "nope.yaml", tmp_path=tmp_path)
    assert result.code == 3
    assert "config file not found" in _error(result)["message"]


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: a:b\ndata: [unclosed\nloss: c:d\n")
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 3
    message = _error(result)["message"]
    assert "YAML syntax error at line" in message and "column" in message


def test_unknown_key_suggests_the_right_one(case, tmp_path):
    path = case(LINEAR_CASE, stpes=3)
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 3
    problems = _error(result)["problems"]
    assert problems == [{"key": "stpes", "message": "unknown key; did you mean `steps`?"}]


def test_all_problems_reported_at_once_with_key_paths(case, tmp_path):
    path = case(LINEAR_CASE, steps="many", device="gpu", grad_clip=-1,
                optimizer={"class": "torch.optim.SGD", "lr": "fast"})
    result = scan(path, tmp_path=tmp_path)
    keys = {p["key"] for p in _error(result)["problems"]}
    assert keys == {"steps", "device", "grad_clip", "optimizer.lr"}
    assert "optimizer.lr: expected a number, got 'fast'" in _error(result)["message"]


def test_missing_required_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    keys = {p["key"] for p in _error(scan(path, tmp_path=tmp_path))["problems"]}
    assert keys == {"model", "data", "loss"}


def test_module_not_found(case, tmp_path):
    result = scan(case(LINEAR_CASE, model="nosuchpkg.models:build"), tmp_path=tmp_path)
    assert result.code == 3
    assert "module `nosuchpkg.models` not found" in _error(result)["message"]


def test_attribute_not_found_with_suggestion(case, tmp_path):
    result = scan(case(LINEAR_CASE, model="case:build_modle"), tmp_path=tmp_path)
    assert result.code == 3
    message = _error(result)["message"]
    assert "model: `case` has no attribute `build_modle`; did you mean `build_model`?" in message


def test_not_callable(case, tmp_path):
    result = scan(case(LINEAR_CASE + "\nVALUE = 3\n", model="case:VALUE"), tmp_path=tmp_path)
    assert result.code == 3
    assert "is an int, not a callable" in _error(result)["message"]


def test_model_factory_must_return_module(case, tmp_path):
    code = LINEAR_CASE + "\ndef not_a_model():\n    return 42\n"
    result = scan(case(code, model="case:not_a_model"), tmp_path=tmp_path)
    assert result.code == 3
    assert "returned an int, not a torch.nn.Module" in _error(result)["message"]


def test_data_not_iterable(case, tmp_path):
    code = LINEAR_CASE + "\ndef number():\n    return 7\n"
    result = scan(case(code, data="case:number"), tmp_path=tmp_path)
    assert result.code == 3
    assert "which is not iterable" in _error(result)["message"]


def test_data_yields_nothing(case, tmp_path):
    code = LINEAR_CASE + "\ndef empty():\n    return []\n"
    result = scan(case(code, data="case:empty"), tmp_path=tmp_path)
    assert result.code == 5
    assert "yielded no batches" in _error(result)["message"]


def test_loss_not_scalar(case, tmp_path):
    code = LINEAR_CASE + "\ndef vector_loss(model, batch):\n    return model(batch[0]) * 1.0\n"
    result = scan(case(code, loss="case:vector_loss"), tmp_path=tmp_path)
    assert result.code == 3
    assert "the loss must be a floating-point scalar tensor, got shape (4, 1)" in \
        _error(result)["message"]


def test_loss_mapping_with_loss_entry_is_accepted(case, tmp_path):
    code = LINEAR_CASE + ("\ndef dict_loss(model, batch):\n"
                          "    return {'loss': loss(model, batch), 'acc': 1.0}\n")
    assert scan(case(code, loss="case:dict_loss"), tmp_path=tmp_path).code == 0


def test_user_exception_reported_with_user_frames(case, tmp_path):
    code = LINEAR_CASE + ("\ndef broken_loss(model, batch):\n"
                          "    raise ValueError('shape mismatch in my loss')\n")
    result = scan(case(code, loss="case:broken_loss"), tmp_path=tmp_path)
    assert result.code == 4
    error = _error(result)
    assert error["exception"] == "ValueError"
    assert "shape mismatch in my loss" in error["message"]
    assert error["frames"] and error["frames"][-1]["file"].endswith("case.py")
    assert all("nanaudit" not in f["file"].split("/")[-2] for f in error["frames"])


def test_error_inside_user_import_is_user_code(case, tmp_path):
    code = "import not_installed_dependency_xyz\n" + LINEAR_CASE
    result = scan(case(code), tmp_path=tmp_path)
    assert result.code == 4
    assert "importing `case`" in _error(result)["message"]


def test_device_cuda_without_cuda(case, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = scan(case(LINEAR_CASE, device="cuda"), tmp_path=tmp_path)
    assert result.code == 3
    assert "`cuda` requested but CUDA is not available" in _error(result)["message"]


def test_checkpoint_missing(case, tmp_path):
    result = scan(case(LINEAR_CASE, checkpoint="nowhere.pt"), tmp_path=tmp_path)
    assert result.code == 3
    assert "checkpoint: file not found" in _error(result)["message"]


def test_checkpoint_needing_pickle_is_refused(case, tmp_path):
    torch.save({"model": {"weight": torch.zeros(1, 3)}, "extra": Opaque()}, tmp_path / "c.pt")
    result = scan(case(LINEAR_CASE, checkpoint="c.pt"), tmp_path=tmp_path)
    assert result.code == 3
    assert "cannot be loaded with weights_only=True" in _error(result)["message"]


def test_checkpoint_key_mismatch_lists_keys(case, tmp_path):
    torch.save({"weight": torch.zeros(1, 3), "scale": torch.ones(1)}, tmp_path / "c.pt")
    result = scan(case(LINEAR_CASE, checkpoint="c.pt"), tmp_path=tmp_path)
    assert result.code == 3
    message = _error(result)["message"]
    assert "missing keys: bias" in message and "unexpected keys: scale" in message


def test_checkpoint_under_model_key_is_loaded(case, tmp_path):
    state = {"weight": torch.full((1, 3), float("nan")), "bias": torch.zeros(1)}
    torch.save({"model": state, "step": 10}, tmp_path / "c.pt")
    result = scan(case(LINEAR_CASE, checkpoint="c.pt"), tmp_path=tmp_path)
    assert result.code == 1
    f = result.finding
    assert (f["where"], f["cause"], f["tensor"], f["step"]) == (
        "parameter", "nonfinite-parameter", "weight", 0)
    assert "c.pt" in f["explanation"]


def test_file_entrypoint_and_args(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "code.py").write_text(
        "import torch\n"
        "def build(width):\n    return torch.nn.Linear(width, 1)\n"
        "def data(n):\n    return [torch.ones(2, 3)] * n\n"
        "def loss(model, batch, scale):\n    return model(batch).sum() * scale\n")
    (tmp_path / "c.yaml").write_text(
        "model: {entrypoint: sub/code.py:build, args: {width: 3}}\n"
        "data: {entrypoint: sub/code.py:data, args: {n: 5}}\n"
        "loss: {entrypoint: sub/code.py:loss, args: {scale: 0.5}}\n")
    result = scan(tmp_path / "c.yaml", tmp_path=tmp_path)
    assert result.code == 0 and result.report["steps_run"] == 5


def test_config_folder_does_not_leak_into_sys_path(case, tmp_path):
    path = case(LINEAR_CASE)
    before = list(sys.path)
    assert scan(path, tmp_path=tmp_path).code == 0
    assert sys.path == before


def test_validate_lists_every_problem_without_running(case, tmp_path):
    code = LINEAR_CASE + "\ndef two_args(a, b):\n    return None\n"
    path = case(code, model="case:two_args", loss="case:nope",
                optimizer={"class": "torch.optim.SGD", "lr": 0.1, "momentun": 0.9})
    result = run_cli("validate", path)
    assert result.code == 3
    assert "model: cannot be called as the model factory" in result.stderr
    assert "loss: `case` has no attribute `nope`" in result.stderr
    assert "unexpected keyword argument 'momentun'" in result.stderr


def test_validate_accepts_a_good_config(case):
    result = run_cli("validate", case(LINEAR_CASE, optimizer={"class": "torch.optim.Adam"}))
    assert result.code == 0 and "valid" in result.stderr


def test_optimizer_factory_entrypoint(case, tmp_path):
    code = LINEAR_CASE + ("\ndef make_opt(model, lr):\n"
                          "    return torch.optim.SGD(model.parameters(), lr=lr)\n")
    path = case(code, optimizer={"entrypoint": "case:make_opt", "args": {"lr": 0.1}})
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 0
    assert result.report["timeline"][0]["lr"] == 0.1


# A model factory that leaves a mark, to prove `scan` checks the whole file before building.
MARKING_CASE = LINEAR_CASE + """

def marking_model():
    import pathlib
    pathlib.Path(__file__).with_name("model-built").touch()
    return build_model()
"""


def test_scan_reports_every_problem_of_the_file_before_building_the_model(case, tmp_path):
    """A typo in `data:` and an argument the optimizer class does not take: both reported,
    exit 3, and the model factory never called (the data typo used to show alone, after the
    model and the optimizer were built)."""
    path = case(MARKING_CASE, model="case:marking_model", data="case:batchez",
                optimizer={"class": "torch.optim.SGD", "lr": 0.1, "momentun": 0.9})
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 3
    problems = _error(result)["problems"]
    assert {p["key"] for p in problems} == {"data", "optimizer"}
    assert "did you mean `batches`?" in _error(result)["message"]
    assert "unexpected keyword argument 'momentun'" in _error(result)["message"]
    assert not (tmp_path / "model-built").exists()


def test_scan_reports_key_and_entrypoint_problems_together(case, tmp_path):
    """A file whose keys have problems still has its entrypoints resolved: one error."""
    path = case(MARKING_CASE, model="case:marking_model", data="case:batchez", steps="many")
    result = scan(path, tmp_path=tmp_path)
    assert result.code == 3
    assert {p["key"] for p in _error(result)["problems"]} == {"steps", "data"}
    assert not (tmp_path / "model-built").exists()
    checked = run_cli("validate", path)
    assert checked.code == 3
    assert "steps: expected an integer" in checked.stderr and "data: `case` has no " \
        "attribute `batchez`" in checked.stderr


def test_scan_checks_the_loss_signature_before_building(case, tmp_path):
    code = MARKING_CASE + "\ndef one_arg_loss(batch):\n    return batch[0].sum()\n"
    result = scan(case(code, model="case:marking_model", loss="case:one_arg_loss"),
                  tmp_path=tmp_path)
    assert result.code == 3
    assert "loss: cannot be called as the loss" in _error(result)["message"]
    assert not (tmp_path / "model-built").exists()
