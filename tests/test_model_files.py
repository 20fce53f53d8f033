"""A model file that is not safetensors (a torch.save pickle): an error saying how to convert."""

from __future__ import annotations

import pytest
import torch

import paraloom
from paraloom.cli import main
from paraloom.models import MLP


@pytest.mark.parametrize("zipfile", [True, False])
def test_a_torch_pickle_is_named_with_the_conversion(tmp_path, zipfile):
    path = tmp_path / "model.pt"
    torch.save(MLP().state_dict(), path, _use_new_zipfile_serialization=zipfile)
    with pytest.raises(ValueError) as info:
        paraloom.load(path)
    message = str(info.value)
    assert "is a PyTorch pickle" in message and "header too large" not in message
    assert "torch.load(" in message and "weights_only=True" in message
    assert "paraloom.save(model, 'model.safetensors')" in message


def test_other_files_are_not_safetensors(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="is not a safetensors file"):
        paraloom.load(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        paraloom.load(path)


def test_a_paraloom_file_still_loads_and_the_cli_reports_a_pickle(tmp_path, capsys):
    torch.manual_seed(0)
    model = MLP()
    paraloom.save(model, tmp_path / "ok.safetensors")
    loaded = paraloom.load(tmp_path / "ok.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 loaded.state_dict().values(), strict=True))
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with pytest.raises(SystemExit) as info:
        main(["evaluate", str(tmp_path / "model.pt")])
    assert info.value.code == 2
    assert "is a PyTorch pickle" in capsys.readouterr().err


def test_a_compiled_model_is_saved_as_the_model_it_compiles(tmp_path, recwarn):
    model = MLP(in_features=3, hidden=[4], num_classes=2)
    paraloom.save(torch.compile(model), tmp_path / "m.safetensors")  # compiles nothing yet
    assert not [w for w in recwarn if "factory=" in str(w.message)]
    back = paraloom.load(tmp_path / "m.safetensors")
    assert type(back) is MLP and all(torch.equal(a, b) for a, b in zip(
        back.state_dict().values(), model.state_dict().values(), strict=True))


class _Lazy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.ReLU(),
                                       torch.nn.Linear(3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_model_with_lazy_modules_loads_as_torch_loads_it(tmp_path):
    model = _Lazy()
    model(torch.ones(2, 5))  # materialized: LazyLinear(5 -> 3)
    paraloom.save(model, tmp_path / "lazy.safetensors")
    back = paraloom.load(tmp_path / "lazy.safetensors", factory=_Lazy)
    x = torch.randn(4, 5)
    assert torch.equal(back(x), model(x))


def test_a_file_replaced_between_its_header_and_its_tensors_is_read_again(
        tmp_path, monkeypatch) -> None:
    """A save renaming a new file over the one being loaded gave one version's header and the
    other's tensors ('does not match the rebuilt model: shapes ...')."""
    import paraloom
    from paraloom import safetensors_files
    from paraloom.models import MLP

    path = tmp_path / "m.safetensors"
    paraloom.save(MLP(in_features=4, hidden=8), path)
    new = MLP(in_features=4, hidden=(16, 16))
    real, calls = safetensors_files.read_tensors, []

    def replaced_once(p, device="cpu"):
        if not calls:
            paraloom.save(new, path)  # the other program's save lands now
        calls.append(p)
        return real(p, device)

    monkeypatch.setattr(safetensors_files, "read_tensors", replaced_once)
    loaded = paraloom.load(path)
    assert len(calls) == 2
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 new.state_dict().values(), strict=True))


class _Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.register_buffer("big", torch.zeros(2))  # real here; the file's is complex
        self.register_buffer("phase", torch.zeros(2))


def test_float64_values_and_complex_buffers_come_back_exactly(tmp_path) -> None:
    """They went through the rebuilt float32 model first: 0.1 came back 0.10000000149, 1e300
    as inf, and a complex buffer without its imaginary part."""
    import paraloom

    paraloom.register_model("test-wide", _Wide)
    model = _Wide().double()
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[0.1, 1.0 + 2**-40]], dtype=torch.float64))
        model.big.copy_(torch.tensor([1e300, 3.0], dtype=torch.float64))
    model.phase = torch.tensor([1 + 2j, 3 - 1j])
    paraloom.save(model, tmp_path / "w.safetensors")
    loaded = paraloom.load(tmp_path / "w.safetensors")
    for name, value in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == value.dtype and torch.equal(got, value), name


def test_a_file_naming_a_lazily_imported_submodule_imports_nothing(tmp_path) -> None:
    """getattr on torch imports what its __getattr__ is asked for (torch._dynamo, torch.onnx):
    a file's class name made load import it."""
    import json
    import subprocess
    import sys

    from safetensors.torch import save_file

    path = tmp_path / "crafted.safetensors"
    save_file({"w": torch.zeros(1)}, str(path),
              metadata={"paraloom": json.dumps({"class": "torch:onnx.X", "kwargs": {}})})
    code = ("import sys, paraloom\n"
            f"try: paraloom.load({str(path)!r})\n"
            "except ValueError as e: print('refused:', e)\n"
            "print('imported' if 'torch.onnx' in sys.modules else 'not imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert "refused:" in out and out.strip().endswith("not imported"), out


def test_a_header_nested_too_deep_is_a_corrupt_file_not_a_recursion_error(tmp_path) -> None:
    from safetensors.torch import save_file

    from paraloom import TrainingCheckpoint

    deep = "[" * 100_000 + "]" * 100_000
    for key, read in (("paraloom", paraloom.load),
                      ("paraloom_checkpoint", TrainingCheckpoint.load)):
        path = tmp_path / f"{key}.safetensors"
        save_file({"w": torch.zeros(1)}, str(path), metadata={key: deep})
        with pytest.raises(ValueError, match="corrupt"):
            read(path)


def test_a_files_constructor_arguments_are_checked_before_any_memory_is_given(tmp_path) -> None:
    """A 525 KB file whose header said num_classes=500000 built the model (1.2 GB) before the
    shapes were compared; num_classes=10**8 asked for 200 GB."""
    import json
    import resource

    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    paraloom.save(MLP(in_features=4, hidden=[8], num_classes=3), path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header, tensors = json.loads(f.metadata()["paraloom"]), {k: f.get_tensor(k)
                                                                   for k in f.keys()}  # noqa: SIM118
    header["kwargs"]["num_classes"] = 10**8
    save_file(tensors, str(path), metadata={"paraloom": json.dumps(header)})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="does not match the rebuilt model: shapes"):
        paraloom.load(path)
    # The huge layer's tensors left out of the file: missing keys, found on the meta device too.
    last = [k for k, v in tensors.items() if v.shape[0] == 3]
    save_file({k: v for k, v in tensors.items() if k not in last}, str(path),
              metadata={"paraloom": json.dumps(header)})
    with pytest.raises(ValueError, match="does not match the rebuilt model: missing"):
        paraloom.load(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_a_factory_is_called_once_even_for_a_file_with_constructor_arguments(tmp_path) -> None:
    """The meta-device probe called the factory too: one that builds once and hands the same
    model back then failed with "Cannot copy out of meta tensor"."""
    path = tmp_path / "model.safetensors"
    paraloom.save(MLP(in_features=4, hidden=[8], num_classes=3), path)
    calls = []

    def build(**kwargs):
        calls.append(kwargs)
        return MLP(**kwargs)

    assert isinstance(paraloom.load(path, factory=build), MLP)
    assert len(calls) == 1


def test_a_dtype_safetensors_cannot_store_is_refused_before_anything_is_lost(tmp_path):
    """complex128 raised a bare KeyError from safetensors, in a CheckpointListener at the first
    checkpoint: the fit's training was lost."""
    from torch import nn

    from paraloom import ParallelWrapper
    from paraloom.listeners import CheckpointListener

    model = nn.Linear(2, 2).to(torch.complex128)
    with pytest.raises(TypeError, match=r"'weight' is complex128, which safetensors cannot "
                                        r"store.*complex64"):
        paraloom.save(model, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()
    wrapper = ParallelWrapper(model, loss_fn=lambda out, y: out.abs().sum(), workers=1,
                              progress=False, listeners=[CheckpointListener(tmp_path / "ck")],
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    data = [(torch.randn(4, 2, dtype=torch.complex128), torch.zeros(4))]
    with wrapper, pytest.raises(TypeError, match="CheckpointListener: 'weight' is complex128"):
        wrapper.fit(data)
    paraloom.save(nn.Linear(2, 2).to(torch.complex64), tmp_path / "c64.safetensors")  # stored


def test_a_model_loads_on_the_meta_device_without_a_warning_per_tensor(tmp_path, recwarn):
    paraloom.save(MLP(in_features=64), tmp_path / "m.safetensors")
    model = paraloom.load(tmp_path / "m.safetensors", map_location="meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert [tuple(p.shape) for p in model.parameters()][0] == (128, 64)
    assert not [w for w in recwarn if "meta" in str(w.message)]  # one per tensor before


def test_crafted_headers_and_a_cut_header_are_value_errors_that_say_so(tmp_path) -> None:
    """A list as the model's name was a TypeError (unhashable), a negative size torch's bare
    RuntimeError, and a file cut inside its header "not a safetensors file"."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    paraloom.save(MLP(in_features=4, hidden=[8], num_classes=3), path)
    whole = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:100])
    with pytest.raises(ValueError, match=r"header says [\d,]+ bytes of JSON.*truncated or "
                                         "corrupt"):
        paraloom.load(tmp_path / "cut.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["paraloom"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for change, message in [({"name": ["mlp"]}, r"names the model \['mlp'\], not a string"),
                            ({"kwargs": {**header["kwargs"], "in_features": -4}},
                             r"rebuilding the model as .*\(RuntimeError: .*negative dimension")]:
        save_file(tensors, str(path), metadata={"paraloom": json.dumps({**header, **change})})
        with pytest.raises(ValueError, match=message):
            paraloom.load(path)
