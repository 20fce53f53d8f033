"""Data sets, the IDX reader, save/load, evaluation metrics, and the CLI."""

from __future__ import annotations

import gzip
import json
import struct
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import paraloom
from paraloom.cli import main
from paraloom.datasets import digits, mnist, read_idx
from paraloom.evaluation import Evaluation, evaluate
from paraloom.models import MLP, LeNet


def test_digits_split_is_fixed_and_disjoint():
    train, test, full = digits("train"), digits("test"), digits("all")
    assert len(train) == 1438 and len(test) == 359 and len(full) == 1797
    assert train.tensors[0].shape[1:] == (1, 8, 8) and train.tensors[0].dtype == torch.float32
    assert float(train.tensors[0].max()) == 1.0 and float(train.tensors[0].min()) == 0.0
    assert torch.equal(digits("test").tensors[0], test.tensors[0])
    rows = {tuple(r.flatten().tolist()) for r in test.tensors[0]}
    overlap = sum(tuple(r.flatten().tolist()) in rows for r in train.tensors[0])
    assert overlap < 5  # a handful of identical images exist in the source data, no more
    with pytest.raises(ValueError, match="'train', 'test' or 'all'"):
        digits("validation")


def _write_idx(path, array, compress):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                         *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("compress", [True, False])
def test_mnist_idx_reader(tmp_path, compress):
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    labels = np.arange(5)
    suffix = ".gz" if compress else ""
    _write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", images, compress)
    _write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", labels, compress)
    ds = mnist(tmp_path, "test")
    x, y = ds.tensors
    assert x.shape == (5, 1, 28, 28)
    assert torch.allclose(x[:, 0] * 255, torch.from_numpy(images).float())
    assert y.tolist() == [0, 1, 2, 3, 4]


def test_idx_reader_rejects_truncated_and_foreign_files(tmp_path):
    _write_idx(tmp_path / "a", np.zeros((4, 3)), False)
    (tmp_path / "b").write_bytes((tmp_path / "a").read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "b")
    (tmp_path / "c").write_bytes(b"PK\x03\x04 not idx")
    with pytest.raises(ValueError, match="two zero bytes"):
        read_idx(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="download MNIST"):
        mnist(tmp_path, "train")


@pytest.mark.parametrize("model", [LeNet(image_size=8), LeNet(), MLP(in_features=64, hidden=[7])])
def test_save_load_round_trip(tmp_path, model):
    path = tmp_path / "m.safetensors"
    paraloom.save(model, path)
    loaded = paraloom.load(path)
    assert type(loaded) is type(model)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k
    # The file is plain safetensors: no pickle anywhere.
    assert b"pickle" not in path.read_bytes()[:200] and path.read_bytes()[8:9] == b"{"


def test_load_refuses_files_that_are_not_paraloom_models(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not written by paraloom.save"):
        paraloom.load(tmp_path / "plain.safetensors")
    with pytest.raises(FileNotFoundError):
        paraloom.load(tmp_path / "missing.safetensors")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied, as a language model's head is

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def test_a_tied_models_plain_file_loads_with_one_name_per_shared_tensor(tmp_path):
    """safetensors.torch.save_model writes a tied tensor once ('emb.weight'); load with a
    factory refused it: 'missing ['head.weight']', an alias of a tensor the file has."""
    from safetensors.torch import save_model

    torch.manual_seed(3)
    model = _Tied()
    save_model(model, str(tmp_path / "tied.safetensors"))
    torch.manual_seed(4)
    loaded = paraloom.load(tmp_path / "tied.safetensors", factory=_Tied)
    assert loaded.head.weight is loaded.emb.weight
    assert torch.equal(loaded.emb.weight, model.emb.weight)
    untied = lambda: torch.nn.ModuleDict({"emb": torch.nn.Embedding(11, 4),  # noqa: E731
                                          "head": torch.nn.Linear(4, 11, bias=False)})
    with pytest.raises(ValueError, match=r"missing \['head.weight'\]"):
        paraloom.load(tmp_path / "tied.safetensors", factory=untied)  # no tie: it is missing


def test_load_with_a_factory_takes_plain_safetensors_weights(tmp_path):
    """As the command line's evaluate --factory does: a file of weights from
    safetensors.torch.save_file (a Hugging Face style model.safetensors) loads by name."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = MLP(in_features=4, hidden=(3,), num_classes=2).double()
    save_file(model.state_dict(), str(tmp_path / "plain.safetensors"))
    loaded = paraloom.load(tmp_path / "plain.safetensors",
                           factory=lambda: MLP(in_features=4, hidden=(3,), num_classes=2))
    assert {k: (v.dtype, v.tolist()) for k, v in loaded.state_dict().items()} == \
        {k: (torch.float32, v.float().tolist()) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="shapes"):
        paraloom.load(tmp_path / "plain.safetensors",
                      factory=lambda: MLP(in_features=5, hidden=(3,), num_classes=2))
    with pytest.raises(ValueError, match=r"missing \[.*unexpected \[.*"):
        paraloom.load(tmp_path / "plain.safetensors", factory=lambda: torch.nn.Linear(4, 2))
    # Plain weights say nothing of the dtype wanted: cast to the factory's, as
    # load_state_dict does (fp16 weights made an fp16 model that float32 inputs failed on).
    save_file(MLP(in_features=4, hidden=(3,), num_classes=2).half().state_dict(),
              str(tmp_path / "half.safetensors"))
    half = paraloom.load(tmp_path / "half.safetensors",
                         factory=lambda: MLP(in_features=4, hidden=(3,), num_classes=2))
    assert {t.dtype for t in half.state_dict().values()} == {torch.float32}
    assert half(torch.randn(2, 4)).shape == (2, 2)


def test_evaluation_metrics_and_merge():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 5.0]])
    targets = torch.tensor([0, 1, 1, 1])
    whole = Evaluation(2)
    whole.update(logits, targets)
    a, b = Evaluation(2), Evaluation(2)
    a.update(logits[:2], targets[:2])
    b.update(logits[2:], targets[2:])
    merged = a.merge(b)
    assert merged.confusion.tolist() == whole.confusion.tolist() == [[1, 0], [1, 2]]
    m = merged.metrics()
    assert m["accuracy"] == 0.75
    assert m["precision"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["recall"] == pytest.approx((1.0 + 2 / 3) / 2)


def test_cli_train_then_evaluate(tmp_path, capsys):
    out = tmp_path / "lenet.safetensors"
    assert main(["train", "--model", "lenet", "--dataset", "digits", "--workers", "2",
                 "--mode", "averaging", "--epochs", "5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    acc = float(printed.split("test accuracy ")[1].split()[0])
    assert acc >= 0.95 and "samples/s" in printed
    assert main(["evaluate", str(out), "--dataset", "digits", "--json"]) == 0
    printed = capsys.readouterr().out
    assert "confusion matrix" in printed
    metrics = json.loads(printed.strip().splitlines()[-1])
    assert metrics["accuracy"] == pytest.approx(acc, abs=5e-5)
    model = paraloom.load(out)
    assert evaluate(model, DataLoader(digits("test"), batch_size=100)).accuracy == \
        pytest.approx(acc, abs=5e-5)


def test_load_never_calls_what_a_crafted_header_names(tmp_path):
    import json as _json

    from safetensors.torch import save_file

    marker = tmp_path / "pwned"
    for spec in ({"class": "subprocess:run",
                  "kwargs": {"args": f"touch {marker}", "shell": True}},
                 {"class": "antigravity:fly", "kwargs": {}}):
        path = tmp_path / "evil.safetensors"
        save_file({"w": torch.zeros(1)}, str(path), metadata={"paraloom": _json.dumps(spec)})
        with pytest.raises(ValueError, match="not an nn.Module|has not imported"):
            paraloom.load(path)
    assert not marker.exists()
    # A class from an imported module still loads (the user's own model).
    model = torch.nn.Linear(3, 2)
    paraloom.save(model, tmp_path / "linear.safetensors", kwargs={"in_features": 3,
                                                                   "out_features": 2})
    assert torch.equal(paraloom.load(tmp_path / "linear.safetensors").weight, model.weight)


def test_idx_reader_rejects_a_truncated_header_and_swapped_files_and_reads_gzip_by_content(
        tmp_path):
    _write_idx(tmp_path / "a", np.zeros((4, 3)), False)
    (tmp_path / "h").write_bytes((tmp_path / "a").read_bytes()[:6])  # ends within the dims
    with pytest.raises(ValueError, match="ends within them"):
        read_idx(tmp_path / "h")
    _write_idx(tmp_path / "z", np.arange(6).reshape(2, 3), True)
    (tmp_path / "z").rename(tmp_path / "plain-name")  # gzip'd, named without .gz
    assert read_idx(tmp_path / "plain-name").tolist() == [[0, 1, 2], [3, 4, 5]]
    images, labels = np.zeros((5, 28, 28)), np.arange(5)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", labels, False)  # swapped
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", images, False)
    with pytest.raises(ValueError, match="swapped"):
        mnist(tmp_path, "test")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_load_keeps_the_saved_dtype_and_writes_readable_files(tmp_path, dtype):
    model = LeNet(image_size=8).to(dtype)
    path = tmp_path / "m.safetensors"
    paraloom.save(model, path)
    # As open() would create it (umask applied), not mkstemp's private 0600.
    assert path.stat().st_mode & 0o777 == 0o666 & ~paraloom.safetensors_files._UMASK
    loaded = paraloom.load(path)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert b.dtype == a.dtype and torch.equal(a, b), k


class _Cached(torch.nn.Module):
    """A Linear plus a table it does not save (a rotary table's kind: persistent=False)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.linspace(0, 1, 3), persistent=False)
        self.register_buffer("steps", torch.arange(3), persistent=False)

    def forward(self, x):
        return self.linear(x) + self.table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_buffer_the_file_does_not_hold_takes_the_models_saved_dtype(tmp_path, dtype):
    """It kept the rebuilt model's float32: a float16 model came back answering float32."""
    model = _Cached().to(dtype)
    paraloom.save(model, tmp_path / "m.safetensors")
    loaded = paraloom.load(tmp_path / "m.safetensors", factory=_Cached)
    assert loaded.table.dtype == dtype and loaded.steps.dtype == torch.int64
    x = torch.randn(2, 4).to(dtype)
    assert torch.equal(loaded(x), model(x))


def test_corrupt_files_and_other_shapes_are_clear_value_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    paraloom.save(LeNet(image_size=8), path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        paraloom.load(tmp_path / "cut.safetensors")
    with pytest.raises(ValueError, match=r"does not match the rebuilt model: shapes"):
        paraloom.load(path, factory=lambda **kwargs: LeNet(image_size=8, num_classes=3))


class _NeedsWidth(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, 1)


def test_saving_a_model_that_cannot_rebuild_itself_warns(tmp_path):
    with pytest.warns(UserWarning, match=r"needs \['width'\].*factory="):
        paraloom.save(_NeedsWidth(3), tmp_path / "m.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paraloom.save(_NeedsWidth(3), tmp_path / "m.safetensors", kwargs={"width": 3})
    assert paraloom.load(tmp_path / "m.safetensors").linear.in_features == 3
    with pytest.warns(UserWarning, match=r"plain Sequential is built from the layers.*factory="):
        paraloom.save(torch.nn.Sequential(torch.nn.Linear(2, 1)), tmp_path / "s.safetensors")
    model = paraloom.load(tmp_path / "s.safetensors",
                          factory=lambda: torch.nn.Sequential(torch.nn.Linear(2, 1)))
    assert model[0].in_features == 2


def test_cli_trains_with_diloco_and_refuses_another_modes_option(tmp_path, capsys):
    """--mode had no diloco (spark-train had it); --averaging-frequency with another mode was
    ignored without a word."""
    out = tmp_path / "lenet.safetensors"
    assert main(["train", "--mode", "diloco", "--sync-every", "10", "--workers", "2",
                 "--epochs", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "diloco" in printed and float(printed.split("test accuracy ")[1].split()[0]) >= 0.85
    for argv, message in ((["--mode", "allreduce", "--sync-every", "5"],
                           "--sync-every is an option of --mode diloco"),
                          (["--mode", "diloco", "--averaging-frequency", "5"],
                           "--averaging-frequency is an option of --mode averaging")):
        with pytest.raises(SystemExit) as exited:
            main(["train", "--epochs", "1", *argv])
        assert exited.value.code == 2 and message in capsys.readouterr().err


def test_cli_refuses_bad_hyperparameters_and_reports_a_mismatch_without_a_traceback(
        tmp_path, capsys):
    for flag, value in (("--lr", "nan"), ("--momentum", "2")):
        with pytest.raises(SystemExit) as exited:
            main(["train", "--dataset", "digits", "--epochs", "1", flag, value])
        assert exited.value.code == 2
        assert f"{flag} " in capsys.readouterr().err
    out = tmp_path / "mlp.safetensors"
    paraloom.save(MLP(in_features=10, hidden=[4]), out)  # not digits' 64 features
    with pytest.raises(SystemExit) as exited:
        main(["evaluate", str(out), "--dataset", "digits"])
    assert exited.value.code == 1
    assert "paraloom evaluate: error:" in capsys.readouterr().err


class _HubConfig:
    """A configuration object, as a Hugging Face model holds: no constructor keywords."""

    hidden = 4


class _HubStyle(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _HubConfig()
        self.layer = torch.nn.Linear(3, 4)


def test_a_factory_that_takes_no_arguments_rebuilds_a_saved_model(tmp_path):
    torch.manual_seed(0)
    model = LeNet(image_size=8)
    paraloom.save(model, tmp_path / "lenet.safetensors")
    loaded = paraloom.load(tmp_path / "lenet.safetensors", factory=lambda: LeNet(image_size=8))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    with pytest.raises(TypeError, match="takes neither the constructor arguments"):
        paraloom.load(tmp_path / "lenet.safetensors", factory=lambda depth: LeNet())


def test_a_config_object_is_not_taken_for_constructor_keywords(tmp_path):
    model = _HubStyle()
    paraloom.save(model, tmp_path / "hub.safetensors")
    loaded = paraloom.load(tmp_path / "hub.safetensors")
    assert torch.equal(loaded.layer.weight, model.layer.weight)


def test_load_names_a_missing_class_and_a_device_the_machine_lacks(tmp_path):
    model = _HubStyle()
    path = tmp_path / "hub.safetensors"
    paraloom.save(model, path)
    header = paraloom.safetensors_files.read_header(path)
    header["class"] = f"{__name__}:NoSuchNet"
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"paraloom": json.dumps(header)})
    with pytest.raises(ValueError, match="'NoSuchNet' is not in module"):
        paraloom.load(path)
    with pytest.raises(ValueError, match="map_location='nowhere' is not a device"):
        paraloom.load(path, map_location="nowhere")


def test_a_training_checkpoint_that_is_a_pickle_or_truncated_is_a_clear_error(tmp_path):
    from paraloom import TrainingCheckpoint

    pickled = tmp_path / "ckpt.pt"
    torch.save({"w": torch.zeros(2)}, pickled)
    with pytest.raises(ValueError, match="PyTorch pickle"):
        TrainingCheckpoint.load(pickled)
    good = tmp_path / "good.safetensors"
    paraloom.save(LeNet(image_size=8), good)
    truncated = tmp_path / "ckpt.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        TrainingCheckpoint.load(truncated)


@pytest.mark.parametrize(("header", "cause"), [
    ("{not json", "JSONDecodeError"), ("[1, 2]", "its header is a list"),
    ('{"format": 1}', "KeyError: 'fingerprint'"),
])
def test_a_checkpoint_with_a_corrupt_header_is_named_and_paraloom_load_points_to_resume(
        tmp_path, header, cause):
    from safetensors.torch import save_file

    from paraloom import TrainingCheckpoint

    path = tmp_path / "ckpt.safetensors"
    save_file({"t": torch.zeros(2)}, str(path), metadata={"paraloom_checkpoint": header})
    with pytest.raises(ValueError, match=f"corrupt checkpoint header .*{cause}"):
        TrainingCheckpoint.load(path)
    with pytest.raises(ValueError, match=r"training checkpoint, not a saved model: resume with "
                                         r"fit\(\.\.\., resume_from=path\)"):
        paraloom.load(path)


def test_save_and_load_expand_a_home_path_and_name_a_folder_given_for_a_file(tmp_path,
                                                                            monkeypatch):
    """'~/x' made a folder named '~' in the working folder; a folder gave a raw rename
    error naming a temporary file."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    paraloom.save(MLP(in_features=4, hidden=[3], num_classes=2), "~/m.safetensors")
    assert (tmp_path / "home" / "m.safetensors").is_file() and not (tmp_path / "~").exists()
    assert isinstance(paraloom.load("~/m.safetensors"), MLP)
    with pytest.raises(IsADirectoryError, match="is a folder; give a file name inside it"):
        paraloom.save(MLP(in_features=4, hidden=[3], num_classes=2), tmp_path)


def test_load_takes_indexed_cpu_and_meta_devices_and_refuses_a_factory_that_is_no_model(
        tmp_path):
    """'cpu:0' and 'meta' reported a good file as corrupt; a factory returning None failed with
    "'NoneType' object has no attribute 'state_dict'"."""
    path = tmp_path / "m.safetensors"
    model = MLP(in_features=4, hidden=[3], num_classes=2)
    paraloom.save(model, path)
    for device in ("cpu:0", torch.device("cpu", 0), "meta"):
        loaded = paraloom.load(path, map_location=device)
        assert next(loaded.parameters()).device.type == torch.device(device).type
    torch.testing.assert_close(paraloom.load(path, map_location="cpu:0").state_dict(),
                               model.state_dict())
    with pytest.raises(TypeError, match="factory='<lambda>' returned NoneType, not an nn.Module"):
        paraloom.load(path, factory=lambda: None)


def test_a_loss_calculator_given_a_string_says_it_is_not_callable():
    from paraloom.early_stopping import LossCalculator

    with pytest.raises(TypeError, match="loss_fn='cross_entropy' is not callable"):
        LossCalculator([], "cross_entropy")  # type: ignore[arg-type]


def test_digits_with_a_data_dir_is_refused_and_idx_paths_expand_home(tmp_path, monkeypatch):
    from paraloom.datasets import load_dataset, read_idx

    with pytest.raises(ValueError, match="--data-dir.*is for the mnist data set"):
        load_dataset("digits", "train", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.idx").write_bytes(bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 7, 8, 9]))
    assert np.array_equal(read_idx("~/x.idx"), np.array([7, 8, 9], dtype=np.uint8))
