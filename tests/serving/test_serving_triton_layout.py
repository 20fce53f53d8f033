"""A Triton model repository of TorchScript models (``config.pbtxt``, ``N/model.pt``) served as
it is, with tritonclient, once the server allows TorchScript; pickles are never opened."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from torch import nn
from tritonclient.utils import InferenceServerException

from paraloom import ParallelInference
from paraloom.serving import ServerThread, create_repository_app
from paraloom.serving.repository.directory import ModelsDir

pytestmark = pytest.mark.timeout(120)

# What Triton's own examples write, fields paraloom has no use for included.
PBTXT = """
name: "digits"
platform: "pytorch_libtorch"
max_batch_size: 16
input [ { name: "INPUT__0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 1, 8, 8 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 500 preferred_batch_size: [ 4, 8 ] }
version_policy: { all { } }
optimization { execution_accelerators { cpu_execution_accelerator: [ { name: "x" } ] } }
parameters: { key: "INFERENCE_MODE" value: { string_value: "true" } }
"""


class Digits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def _digits(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Digits().eval()


def _write_torchscript(model: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.trace(model, torch.rand(1, 1, 8, 8)).save(str(path))


@pytest.fixture()
def repository(tmp_path: Path) -> Iterator[tuple[Path, dict[int, nn.Module]]]:
    root = tmp_path / "models"
    versions = {1: _digits(0), 2: _digits(1)}
    for version, model in versions.items():
        _write_torchscript(model, root / "digits" / str(version) / "model.pt")
    (root / "digits" / "config.pbtxt").write_text(PBTXT)
    (root / "digits" / "labels.txt").write_text("\n".join(map(str, range(10))))  # it names it
    yield root, versions


def _expected(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out: np.ndarray = model(torch.from_numpy(x)).numpy()
    return out


def test_a_triton_torchscript_repository_serves_unchanged(repository) -> None:
    root, versions = repository
    with ServerThread(create_repository_app(root, allow_torchscript=True), grpc_port=0) as s:
        http = th.InferenceServerClient(s.url.removeprefix("http://"))
        grpc = tg.InferenceServerClient(s.grpc_url.removeprefix("grpc://"))
        meta = http.get_model_metadata("digits")
        assert meta["versions"] == ["1", "2"]
        assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32",
                                   "shape": [-1, 1, 8, 8]}]  # the batch dimension added
        assert meta["outputs"] == [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [-1, 10]}]
        x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
        for version, model in versions.items():
            sent = th.InferInput("INPUT__0", list(x.shape), "FP32")
            sent.set_data_from_numpy(x)
            got = http.infer("digits", [sent], model_version=str(version))
            np.testing.assert_allclose(got.as_numpy("OUTPUT__0"), _expected(model, x),
                                       rtol=1e-5, atol=1e-6)
        sent_g = tg.InferInput("INPUT__0", list(x.shape), "FP32")
        sent_g.set_data_from_numpy(x)
        got_g = grpc.infer("digits", [sent_g])  # no version: the latest
        np.testing.assert_allclose(got_g.as_numpy("OUTPUT__0"), _expected(versions[2], x),
                                   rtol=1e-5, atol=1e-6)
        pool = s.app.state.repository.get("digits", None).pool
        assert pool.stats()["workers"] == 2  # instance_group's count
        config = http.get_model_config("digits")
        assert meta["platform"] == config["platform"] == "pytorch_libtorch"
        assert config["max_batch_size"] == 16
        assert config["input"] == [{"name": "INPUT__0", "data_type": "TYPE_FP32",
                                    "dims": [1, 8, 8]}]
        assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
        assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 500}
        config_g = grpc.get_model_config("digits", as_json=True)["config"]
        assert config_g["max_batch_size"] == 16 and config_g["output"][0]["dims"] == ["10"]
        assert config_g["output"][0]["data_type"] == "TYPE_FP32"
        many = np.zeros((17, 1, 8, 8), dtype=np.float32)  # max_batch_size is 16: refused
        for client, module in ((http, th), (grpc, tg)):
            sent_many = module.InferInput("INPUT__0", list(many.shape), "FP32")
            sent_many.set_data_from_numpy(many)
            with pytest.raises(InferenceServerException, match="17 rows, over the model's "
                               "max_batch_size 16"):
                client.infer("digits", [sent_many])


def test_config_pbtxt_sets_the_pool_and_the_signature(repository) -> None:
    root, _ = repository
    found = ModelsDir(root, allow_torchscript=True).scan()["digits"]
    assert found.path is not None and found.path.name == "model.pt"
    assert found.versions == [1, 2]
    config = found.config
    assert config is not None
    assert config.pool_options == {"batch_limit": 16, "workers": 2, "max_wait_ms": 0.5}
    assert config.max_batch_size == 16
    assert [s.shape for s in config.inputs or ()] == [(-1, 1, 8, 8)]


def test_without_a_batch_dimension_requests_run_alone_as_given(tmp_path: Path) -> None:
    root = tmp_path / "models"
    model = _digits(2)
    _write_torchscript(model, root / "single" / "1" / "model.pt")
    (root / "single" / "config.pbtxt").write_text(
        'platform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [1, 1, 8, 8] }]\n'
        'output [{ name: "y" data_type: TYPE_FP32 dims: [1, 10] }]\n')
    with ServerThread(create_repository_app(root, allow_torchscript=True)) as s:
        http = th.InferenceServerClient(s.url.removeprefix("http://"))
        assert http.get_model_metadata("single")["inputs"][0]["shape"] == [1, 1, 8, 8]
        x = np.random.default_rng(1).random((1, 1, 8, 8), dtype=np.float32)
        sent = th.InferInput("x", [1, 1, 8, 8], "FP32")
        sent.set_data_from_numpy(x)
        np.testing.assert_allclose(http.infer("single", [sent]).as_numpy("y"),
                                   _expected(model, x), rtol=1e-5, atol=1e-6)
        pool = s.app.state.repository.get("single", None).pool
        assert pool.inference_mode.value == "inplace"  # never merged with another request
        config = http.get_model_config("single")
        assert config["max_batch_size"] == 0 and config["input"][0]["dims"] == [1, 1, 8, 8]
        assert "dynamic_batching" not in config


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {os.environ['PARALOOM_EVIL_MARK']}",))


def _reasons(root: Path, **options: bool) -> dict[str, str]:
    app = create_repository_app(root, **options)
    try:
        return {row["name"]: row.get("reason", "") for row in
                app.state.repository.index() if row["state"] == "UNAVAILABLE"}
    finally:
        for served in app.state.repository.every():
            served.pool.close(drain=False)


def test_torchscript_only_when_allowed_and_pickles_never(repository, tmp_path: Path,
                                                         monkeypatch) -> None:
    root, _ = repository
    refused = _reasons(root)["digits"]
    assert "model.pt is TorchScript" in refused and "--allow-torchscript" in refused
    mark = tmp_path / "unpickled"
    monkeypatch.setenv("PARALOOM_EVIL_MARK", str(mark))
    (root / "pickled" / "1").mkdir(parents=True)
    torch.save({"weights": _Evil()}, root / "pickled" / "1" / "model.pt")
    (root / "pickled" / "config.pbtxt").write_text(PBTXT.replace('"digits"', '"pickled"'))
    (root / "pickled" / "labels.txt").write_text("0\n1\n")
    reasons = _reasons(root, allow_torchscript=True)
    assert "not TorchScript" in reasons["pickled"] and "never unpickles" in reasons["pickled"]
    assert not mark.exists()
    assert "digits" not in reasons


def test_configs_that_cannot_be_served_say_why(tmp_path: Path) -> None:
    root = tmp_path / "models"
    cases = {
        "onnx": 'platform: "onnxruntime_onnx"\nmax_batch_size: 4',
        "garbled": "input [ { name: ",
        "untyped": 'max_batch_size: 4\ninput [{ name: "x" dims: [3] }]',
        "escaping": 'default_model_filename: "../../elsewhere.pt"',
    }
    for name, text in cases.items():
        _write_torchscript(_digits(0), root / name / "1" / "model.pt")
        (root / name / "config.pbtxt").write_text(text)
    _write_torchscript(_digits(0), root / "noinputs" / "1" / "model.pt")
    (root / "noinputs" / "config.json").write_text(json.dumps({"workers": 1}))
    _write_torchscript(_digits(0), root / "both" / "1" / "model.pt")
    (root / "both" / "config.json").write_text("{}")
    (root / "both" / "config.pbtxt").write_text("max_batch_size: 4")
    reasons = _reasons(root, allow_torchscript=True)
    assert "'onnxruntime_onnx' is not served here" in reasons["onnx"]
    assert "not a readable Triton model config" in reasons["garbled"]
    assert "needs a name and a data_type" in reasons["untyped"]
    assert "must be a file name in the version folder" in reasons["escaping"]
    assert "inputs and outputs cannot be read" in reasons["noinputs"]
    assert "both config.json and config.pbtxt" in reasons["both"]


def test_parallel_inference_runs_a_torchscript_module() -> None:
    model = _digits(3)
    script = torch.jit.script(model)
    x = torch.rand(5, 1, 8, 8)
    with ParallelInference(script, workers=2) as pool:
        torch.testing.assert_close(pool.output(x), torch.from_numpy(_expected(model, x.numpy())),
                                   rtol=1e-5, atol=1e-6)


def test_a_version_without_a_usable_file_is_unavailable_alone(repository) -> None:
    """A version folder with its model.pt missing or pickled made the whole model UNAVAILABLE
    (and named model.safetensors); Triton serves the versions that load."""
    root, versions = repository
    _write_torchscript(_digits(2), root / "digits" / "3" / "model.pt")
    (root / "digits" / "2" / "model.pt").unlink()
    (root / "digits" / "4").mkdir()
    torch.save({"weights": torch.zeros(2)}, root / "digits" / "4" / "model.pt")  # a pickle
    app = create_repository_app(root, allow_torchscript=True)
    try:
        rows = {row["version"]: row for row in app.state.repository.index()}
        assert {v: r["state"] for v, r in rows.items()} == {
            "1": "READY", "2": "UNAVAILABLE", "3": "READY", "4": "UNAVAILABLE"}
        assert "no digits/2/model.safetensors or model.pt" in rows["2"]["reason"]
        assert "not TorchScript" in rows["4"]["reason"]
        with ServerThread(app) as s:
            http = th.InferenceServerClient(s.url.removeprefix("http://"))
            x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
            sent = th.InferInput("INPUT__0", [2, 1, 8, 8], "FP32")
            sent.set_data_from_numpy(x)
            got = http.infer("digits", [sent], model_version="1").as_numpy("OUTPUT__0")
            np.testing.assert_allclose(got, _expected(versions[1], x), rtol=1e-5, atol=1e-6)
            latest = http.infer("digits", [sent]).as_numpy("OUTPUT__0")  # the latest served
            np.testing.assert_allclose(latest, _expected(_digits(2), x), rtol=1e-5, atol=1e-6)
            with pytest.raises(InferenceServerException, match="4/model.pt in the model"):
                _load_with_path(s.url, "digits")  # the hint names the next version's file
    finally:
        for served in app.state.repository.every():
            served.pool.close(drain=False)


def _load_with_path(url: str, name: str) -> None:
    import urllib.error
    import urllib.request
    request = urllib.request.Request(f"{url}/v2/repository/models/{name}/load", method="POST",
                                     data=json.dumps({"parameters": {"path": "x.pt"}}).encode())
    try:
        urllib.request.urlopen(request, timeout=30)
    except urllib.error.HTTPError as e:
        raise InferenceServerException(json.loads(e.read())["error"]) from e


def test_every_version_unusable_gives_each_reason(repository) -> None:
    root, _ = repository
    for version in (1, 2):
        (root / "digits" / str(version) / "model.pt").unlink()
    (root / "digits" / "2" / "model.pt").write_bytes(b"not a zip")
    reason = _reasons(root, allow_torchscript=True)["digits"]
    assert "version 1: no digits/1/model.safetensors" in reason
    assert "version 2: digits/2/model.pt is not TorchScript" in reason


@pytest.mark.parametrize(("groups", "workers"), [
    ("[{ count: 1 kind: KIND_CPU }, { kind: KIND_CPU }]", 2),
    ("[{ kind: KIND_CPU }]", 1),
    ("[{ count: 2 }, { count: 3 }]", 5),
])
def test_an_instance_group_without_a_count_is_one_instance_as_in_triton(tmp_path: Path, groups,
                                                                        workers) -> None:
    from paraloom.serving.repository.triton import read_pbtxt

    path = tmp_path / "config.pbtxt"
    path.write_text(PBTXT.replace("instance_group [ { count: 2 kind: KIND_CPU } ]",
                                  f"instance_group {groups}"))
    assert read_pbtxt(path, "digits")["workers"] == workers
