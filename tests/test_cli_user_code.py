"""paraloom train / evaluate with the user's own model and data (--factory, --data)."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from paraloom.cli import main

USER_MODULE = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Blobs(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))

        def forward(self, x):
            return self.net(x)

    def model():
        return Blobs()

    class Wide(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, 2))

        def forward(self, x):
            return self.net(x)

    def wide():
        return Wide(8)

    def _blobs(n, seed):
        g = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 2, (n,), generator=g)
        x = torch.randn(n, 2, generator=g) * 0.5 + (y[:, None] * 2.0 - 1.0) * 1.5
        return TensorDataset(x, y)

    def train_set():
        return _blobs(512, 0)

    def test_loader():
        return DataLoader(_blobs(256, 1), batch_size=64)

    def not_data():
        return 42

    def bad_test():
        return DataLoader(TensorDataset(torch.randn(8, 3), torch.zeros(8).long()), batch_size=4)

    class Line(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = {"kind": "line"}  # a config its constructor does not take
            self.fit = nn.Linear(2, 1)

        def forward(self, x):
            return self.fit(x).squeeze(1)

    def line():
        return Line()

    def line_data(n=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 2, generator=g)
        return TensorDataset(x, 3 * x[:, 0] - 2 * x[:, 1] + 1e6)

    def line_test():
        return DataLoader(line_data(128, 1), batch_size=32)

    def needs_a_missing_module():
        import no_such_module_of_the_users  # noqa: F401

    def reads_a_missing_attribute():
        return None.weight
""")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_project.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_train_and_evaluate_the_users_model_and_data(user_module, capsys):
    out = user_module / "blobs.safetensors"
    assert main(["train", "--factory", "my_project:model", "--data", "my_project:train_set",
                 "--test-data", "my_project:test_loader", "--workers", "1", "--epochs", "3",
                 "--lr", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    accuracy = float(re.search(r"test accuracy ([\d.]+)", printed).group(1))
    assert accuracy > 0.95 and out.is_file()
    assert main(["evaluate", str(out), "--factory", "my_project:model",
                 "--data", "my_project:test_loader", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert round(metrics["accuracy"], 4) == accuracy  # the same weights, the same test set


def test_a_factory_model_with_constructor_arguments_is_saved_naming_its_factory(
        user_module, capsys):
    """train --factory warned that paraloom.load would need factory= (a Python keyword the
    command line does not have); evaluate without --factory then did not say which."""
    import warnings

    out = user_module / "wide.safetensors"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--factory", "my_project:wide", "--data", "my_project:train_set",
                     "--workers", "1", "--epochs", "1", "--out", str(out)]) == 0
    assert not [w for w in caught if "factory=" in str(w.message)]
    assert "saved" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["evaluate", str(out), "--data", "my_project:test_loader"])
    assert info.value.code == 2
    assert "built with --factory my_project:wide: pass --factory my_project:wide" in \
        capsys.readouterr().err
    assert main(["evaluate", str(out), "--factory", "my_project:wide",
                 "--data", "my_project:test_loader"]) == 0


def test_evaluate_a_regression_with_the_factory_that_trained_it(user_module, capsys):
    import torch

    import paraloom

    module = __import__("my_project")
    model = module.line()
    with torch.no_grad():  # the line the data follows, up to a small error
        model.fit.weight.copy_(torch.tensor([[3.0, -2.0]]))
        model.fit.bias.fill_(1e6 + 0.5)
    out = user_module / "line.safetensors"
    paraloom.save(model, out)
    # A factory that takes no arguments, though the file holds the model's config.
    assert main(["evaluate", str(out), "--factory", "my_project:line", "--data",
                 "my_project:line_test", "--loss", "mse", "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["count"] == 128 and metrics["mse"] == pytest.approx(0.25, rel=1e-3)
    assert metrics["loss"] == pytest.approx(metrics["mse"]) and metrics["r2"] > 0.98
    with pytest.raises(SystemExit) as info:
        main(["evaluate", str(out), "--batch-size", "0"])
    assert info.value.code == 2 and "0 is not an int >= 1" in capsys.readouterr().err


def test_evaluate_plain_safetensors_weights_with_the_factory(user_module, capsys):
    """Weights saved without paraloom (safetensors.torch.save_file) evaluate with --factory;
    weights of another model name the keys."""
    import torch
    from safetensors.torch import save_file

    module = __import__("my_project")
    model = module.line()
    with torch.no_grad():
        model.fit.weight.copy_(torch.tensor([[3.0, -2.0]]))
        model.fit.bias.fill_(1e6 + 0.5)
    save_file(model.state_dict(), str(user_module / "plain.safetensors"))
    assert main(["evaluate", str(user_module / "plain.safetensors"), "--factory",
                 "my_project:line", "--data", "my_project:line_test", "--loss", "mse",
                 "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["mse"] == pytest.approx(0.25, rel=1e-3)
    with pytest.raises(SystemExit) as info:
        main(["evaluate", str(user_module / "plain.safetensors"), "--factory",
              "my_project:model", "--data", "my_project:test_loader"])
    assert info.value.code == 2 and "missing ['net.0.weight'" in capsys.readouterr().err


def test_bad_user_code_gets_a_clear_error(user_module, capsys):
    for argv, message in [
        (["train", "--data", "my_project:train_set"], "--data needs --factory"),
        (["train", "--factory", "my_project", "--data", "my_project:train_set"],
         "must look like 'package.module:function'"),
        (["train", "--factory", "no_such_module:model", "--data", "my_project:train_set"],
         "cannot import 'no_such_module'"),
        (["train", "--factory", "my_project:model", "--data", "my_project:not_data"],
         "returned a int; expected a torch Dataset or DataLoader"),
        (["train", "--factory", "my_project:train_set", "--data", "my_project:train_set"],
         "returned a TensorDataset; expected a torch.nn.Module"),
        # The user's own code failing: a traceback before, now one line naming the option.
        (["train", "--factory", "my_project:needs_a_missing_module", "--data",
          "my_project:train_set"], "--factory 'my_project:needs_a_missing_module' raised "
                                   "ModuleNotFoundError: No module named"),
        (["train", "--factory", "my_project:model", "--data",
          "my_project:reads_a_missing_attribute"],
         "--data 'my_project:reads_a_missing_attribute' raised AttributeError"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_train_saves_before_evaluating_and_checks_out_before_training(user_module, capsys):
    out = user_module / "kept.safetensors"
    base = ["train", "--factory", "my_project:model", "--data", "my_project:train_set",
            "--workers", "1", "--epochs", "1"]
    with pytest.raises(SystemExit) as info:  # the test data does not fit the model
        main([*base, "--test-data", "my_project:bad_test", "--out", str(out)])
    assert info.value.code != 0 and out.is_file()  # what was trained is kept
    assert f"saved {out}" in capsys.readouterr().out
    for where, message in [(user_module, "is a directory"),
                           (user_module / "missing" / "m.safetensors", "does not exist")]:
        with pytest.raises(SystemExit) as info:
            main([*base, "--out", str(where)])
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_user_errors_end_in_one_line_naming_the_fix(tmp_path, capsys, monkeypatch):
    """Each of these ended in a traceback, or a message that did not name the fix."""
    import torch

    import paraloom
    from paraloom.models import LeNet

    monkeypatch.chdir(tmp_path)
    paraloom.save(LeNet(image_size=28), "m28.safetensors", metadata={"dataset": "mnist"})
    torch.save({"w": torch.zeros(1)}, "pickled.pt")
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "idx" / "train-images-idx3-ubyte").mkdir(parents=True)  # a folder, not a file
    for argv, message in [
        (["evaluate", "m28.safetensors"], "trained on --dataset mnist, and is evaluated on "
                                          "--dataset digits: pass --dataset mnist"),
        (["evaluate", "folder"], "folder is a folder; give the model's file"),
        (["evaluate", "x.csv"], "x.csv is not a safetensors file (nor a PyTorch checkpoint)"),
        (["evaluate", "pickled.pt"], "is a PyTorch pickle"),
        (["train", "--dataset", "mnist", "--data-dir", "idx"], "is a folder, not an IDX file"),
        (["train", "--test-data", "my_project:test_set"], "--test-data goes with --data"),
        (["serve", "m28.safetensors", "--weights", "m28.safetensors"],
         "--weights goes with --factory"),
        (["serve", "m28.safetensors", "--port", "70000"], "'70000' is not a port"),
    ]:
        try:
            code = main(argv)  # serve prints its own error line and returns the code
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code in (1, 2) and message in err, (argv, err)
        assert "Traceback" not in err, argv


def test_version_names_paraloom_and_torch(capsys):
    import torch

    import paraloom

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    expected = f"paraloom {paraloom.__version__} (torch {torch.__version__})"
    assert capsys.readouterr().out.strip() == expected


def test_a_model_trained_on_a_dataset_evaluated_on_other_data_names_the_dataset(
        user_module, capsys):
    """The hint compared like with like only: --data against a file trained on --dataset
    digits ended in conv2d's shape error alone."""
    import paraloom
    from paraloom.models import LeNet

    path = str(user_module / "lenet.safetensors")
    paraloom.save(LeNet(image_size=8), path, metadata={"dataset": "digits"})
    with pytest.raises(SystemExit) as info:
        main(["evaluate", path, "--data", "my_project:test_loader"])
    err = capsys.readouterr().err
    assert info.value.code != 0
    assert (f"{path} was trained on --dataset digits, and is evaluated on --data "
            "my_project:test_loader: pass --dataset digits (or a --data shaped as digits's)"
            ) in err


@pytest.mark.parametrize(("devices", "says"), [("0", "devices=0; expected a count >= 1"),
                                               ("cuda:7", "'cuda:7' asked for")])
def test_bad_devices_are_named_by_the_flag(devices, says, capsys):
    """The error named the Python keyword (devices=0) only."""
    with pytest.raises(SystemExit) as info:
        main(["train", "--devices", devices, "--epochs", "1"])
    err = capsys.readouterr().err
    assert info.value.code != 0 and f"error: --devices {devices}: " in err and says in err
