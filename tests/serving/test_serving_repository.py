"""Which files a remote load may read, and how a new version is built from one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import paraloom
from paraloom.models import MLP, LeNet
from paraloom.serving.errors import ForbiddenError, ProtocolError
from paraloom.serving.repository import ModelFiles


@pytest.fixture()
def layout(tmp_path: Path) -> dict[str, Path]:
    models = tmp_path / "models"
    models.mkdir()
    torch.manual_seed(0)
    paraloom.save(LeNet(image_size=8), models / "v1.safetensors")
    paraloom.save(LeNet(image_size=8), models / "v2.safetensors")
    paraloom.save(LeNet(image_size=28), models / "big.safetensors")
    paraloom.save(MLP(in_features=64), models / "mlp.safetensors")
    save_file({"w": torch.zeros(2)}, str(models / "plain.safetensors"))
    (models / "v2.pt").write_bytes(b"not a pickle we would ever read")
    outside = tmp_path / "outside.safetensors"
    paraloom.save(LeNet(image_size=8), outside)
    os.symlink(outside, models / "link.safetensors")
    return {"dir": models, "outside": outside}


def test_loading_is_off_unless_the_operator_allows_it() -> None:
    with pytest.raises(ForbiddenError, match="model loading is disabled"):
        ModelFiles().resolve({"path": "v2.safetensors"})


def test_no_path_reloads_the_served_file(layout: dict[str, Path]) -> None:
    files = ModelFiles(model_file=layout["dir"] / "v1.safetensors")
    assert files.resolve({}) == (layout["dir"] / "v1.safetensors").resolve()
    with pytest.raises(ForbiddenError, match="has no models directory"):
        files.resolve({"path": "v2.safetensors"})


@pytest.mark.parametrize(("params", "error", "message"), [
    ({"path": "../outside.safetensors"}, ForbiddenError, "outside the models directory"),
    ({"path": "link.safetensors"}, ForbiddenError, "outside the models directory"),
    ({"path": "/etc/passwd"}, ForbiddenError, "outside the models directory"),
    ({"path": "v2.pt"}, ForbiddenError, "is not a .safetensors file"),
    ({"path": "missing.safetensors"}, ProtocolError, "no file 'missing.safetensors'"),
    ({"path": 3}, ProtocolError, "must be a file name"),
    ({"file:model.safetensors": "QUJD"}, ForbiddenError, "never takes model files"),
    ({"config": "{}"}, ForbiddenError, "never takes model files or configs"),
    ({}, ProtocolError, "load needs parameters.path"),
])
def test_paths_outside_the_rule_are_refused(layout: dict[str, Path], params: dict,
                                            error: type[Exception], message: str) -> None:
    files = ModelFiles(model_dir=layout["dir"])
    with pytest.raises(error) as info:
        files.resolve(params)
    assert message in str(info.value)


def test_a_file_inside_the_directory_builds_a_copy_with_its_weights(layout: dict[str, Path]
                                                                    ) -> None:
    files = ModelFiles(model_dir=layout["dir"])
    served = paraloom.load(layout["dir"] / "v1.safetensors")
    new = files.build(files.resolve({"path": "v2.safetensors"}), served)
    expected = paraloom.load(layout["dir"] / "v2.safetensors")
    assert new is not served
    for (k, a), b in zip(new.state_dict().items(), expected.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert not torch.equal(served.state_dict()["classifier.3.bias"],
                           new.state_dict()["classifier.3.bias"])


@pytest.mark.parametrize(("name", "message"), [
    ("big.safetensors", "parameters differ in name or shape"),
    ("mlp.safetensors", "parameters differ in name or shape"),
    ("plain.safetensors", "no paraloom header"),
])
def test_files_that_do_not_fit_the_served_model_are_refused(layout: dict[str, Path], name: str,
                                                            message: str) -> None:
    files = ModelFiles(model_dir=layout["dir"])
    served = paraloom.load(layout["dir"] / "v1.safetensors")
    with pytest.raises(ProtocolError, match=message):
        files.build(files.resolve({"path": name}), served)


def test_a_different_architecture_header_is_refused_when_the_served_file_is_known(
        layout: dict[str, Path]) -> None:
    files = ModelFiles(model_file=layout["dir"] / "v1.safetensors", model_dir=layout["dir"])
    served = paraloom.load(layout["dir"] / "v1.safetensors")
    with pytest.raises(ProtocolError, match="different architecture"):
        files.build(files.resolve({"path": "big.safetensors"}), served)


def test_model_dir_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        ModelFiles(model_dir=tmp_path / "nope")


def test_configs_outside_the_directory_or_past_bounds_are_refused_not_read(tmp_path: Path) -> None:
    """A config.pbtxt symlinked from outside was parsed and its text (a password) sent to any
    client in the index's reason; a config.json nested 100,000 deep stopped the whole server
    with a RecursionError; a 200 MB config stalled the loop for 22 s."""
    from paraloom.serving.repository.config import CONFIG_MAX_BYTES
    from paraloom.serving.repository.directory import ModelsDir

    root = tmp_path / "models"
    secret = tmp_path / "secret.txt"
    secret.write_text("db password = SECRET-TOKEN-123\n")
    for name in ("linked", "nested", "huge", "fine"):
        (root / name).mkdir(parents=True)
        paraloom.save(MLP(in_features=4, hidden=[3], num_classes=2),
                      root / name / "model.safetensors")
    os.symlink(secret, root / "linked" / "config.pbtxt")
    (root / "nested" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "huge" / "config.json").write_text(" " * (CONFIG_MAX_BYTES + 1) + "{}")
    (root / "fine" / "config.json").write_text('{"workers": 1}')
    found = ModelsDir(root).scan()
    assert found["linked"].path is None
    assert "resolves outside the models directory" in (found["linked"].error or "")
    assert "SECRET" not in (found["linked"].error or "")
    assert found["nested"].path is None and "not readable JSON" in (found["nested"].error or "")
    assert found["huge"].path is None
    assert f"past the {CONFIG_MAX_BYTES:,}" in (found["huge"].error or "")
    assert found["fine"].path is not None  # the others are served


class _Versioned(torch.nn.Linear):
    """A model whose extra state (get_extra_state) says which release it is."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.release = "a"

    def get_extra_state(self) -> dict[str, str]:
        return {"release": self.release}

    def set_extra_state(self, state: dict[str, str]) -> None:
        self.release = state["release"]


def test_a_models_extra_state_comes_with_the_new_files_weights(tmp_path: Path) -> None:
    """read_tensors left the header's extra state out, and comparing shapes met a dict."""
    served, update = _Versioned(), _Versioned()
    update.release = "b"
    paraloom.save(update, tmp_path / "v2.safetensors", kwargs={})
    files = ModelFiles(model_dir=tmp_path)
    new = files.build(files.resolve({"path": "v2.safetensors"}), served)
    assert new.release == "b" and served.release == "a"
    assert torch.equal(new.weight, update.weight)
