"""A ``config.pbtxt``'s tensors meet the TorchScript model's ``forward`` as Triton's PyTorch
backend binds them: by forward's argument names, by ``<name>__<index>``, as a dict, with
``reshape``, and with fewer outputs declared than returned; answered by tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from serving_helpers import Client, closing
from torch import nn
from tritonclient.utils import InferenceServerException

from paraloom.serving import ServerThread, create_repository_app
from paraloom.serving.classification import classes_asked
from paraloom.serving.errors import ProtocolError
from paraloom.serving.repository.binding import bind, named_indices
from paraloom.serving.repository.triton import read_pbtxt
from paraloom.serving.signature import TensorSpec

pytestmark = pytest.mark.timeout(120)


class Difference(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a - b


class TwoWays(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x - y, x + y


class Scaled(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 3


class RowSums(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=(1, 2))  # [B, 2, 2] in, [B] out


class Keyed(nn.Module):
    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["p"] * 10 + inputs["q"]


class Lengths(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, y]) * 2


class FirstRow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:1]


def _tensor(name: str, dims: str, extra: str = "") -> str:
    return f'{{ name: "{name}" data_type: TYPE_FP32 dims: [ {dims} ] {extra} }}'


def _config(inputs: list[str], outputs: list[str], batch: int = 8) -> str:
    return (f'platform: "pytorch_libtorch"\nmax_batch_size: {batch}\n'
            f"input [ {', '.join(inputs)} ]\noutput [ {', '.join(outputs)} ]\n")


MODELS: dict[str, tuple[nn.Module, str]] = {
    # config order b, a; forward(a, b): bound by name.
    "by_name": (Difference(), _config([_tensor("b", "2"), _tensor("a", "2")],
                                      [_tensor("diff", "2")])),
    "by_index": (TwoWays(), _config([_tensor("INPUT__1", "2"), _tensor("INPUT__0", "2")],
                                    [_tensor("OUTPUT__1", "2"), _tensor("OUTPUT__0", "2")])),
    "first_only": (Scaled(), _config([_tensor("x", "2")], [_tensor("doubled", "2")])),
    "second_only": (Scaled(), _config([_tensor("INPUT__0", "2")], [_tensor("OUTPUT__1", "2")])),
    "reshaped": (RowSums(), _config([_tensor("x", "4", "reshape: { shape: [ 2, 2 ] }")],
                                    [_tensor("s", "1", "reshape: { shape: [ ] }")])),
    "keyed": (Keyed(), _config([_tensor("p", "1"), _tensor("q", "1")], [_tensor("out", "1")])),
    "lengths": (Lengths(), _config([_tensor("x", "-1"), _tensor("y", "-1")],
                                   [_tensor("z", "-1")], batch=0)),
    "first_row": (FirstRow(), _config([_tensor("x", "2")], [_tensor("y", "2")])),
    "scores": (FirstRow(), _config([_tensor("x", "3")],
                                   [_tensor("y", "3", 'label_filename: "labels.txt"')])),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("bound") / "models"
    for name, (model, config) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        torch.jit.script(model).save(str(root / name / "1" / "model.pt"))
        (root / name / "config.pbtxt").write_text(config)
    (root / "scores" / "labels.txt").write_text("cat\ndog\n")  # no label for class 2
    app = create_repository_app(root, allow_torchscript=True, workers=1)
    with ServerThread(app, grpc_port=0) as s:
        yield s


def _infer(server: Any, model: str, inputs: dict[str, np.ndarray], grpc: bool = False
           ) -> dict[str, np.ndarray]:
    module: Any = tg if grpc else th
    url = (server.grpc_url.removeprefix("grpc://") if grpc
           else server.url.removeprefix("http://"))
    client = module.InferenceServerClient(url)
    sent = []
    for name, value in inputs.items():
        one = module.InferInput(name, list(value.shape), "FP32")
        one.set_data_from_numpy(value)
        sent.append(one)
    result = client.infer(model, sent)
    names = [o["name"] for o in (result.get_response(as_json=True)["outputs"] if grpc
                                 else result.get_response()["outputs"])]
    return {n: result.as_numpy(n) for n in names}


def _f32(rows: list[list[float]]) -> np.ndarray:
    return np.array(rows, dtype=np.float32)


@pytest.mark.parametrize("grpc", [False, True])
def test_inputs_named_after_forward_arguments_go_to_them(server: Any, grpc: bool) -> None:
    out = _infer(server, "by_name", {"b": _f32([[1, 2], [3, 4]]),
                                     "a": _f32([[10, 20], [30, 40]])}, grpc)
    np.testing.assert_array_equal(out["diff"], [[9, 18], [27, 36]])  # a - b, not b - a


def test_name_index_picks_the_argument_and_the_returned_element(server: Any) -> None:
    x, y = _f32([[10, 20]]), _f32([[1, 2]])
    out = _infer(server, "by_index", {"INPUT__0": x, "INPUT__1": y})
    np.testing.assert_array_equal(out["OUTPUT__0"], x - y)
    np.testing.assert_array_equal(out["OUTPUT__1"], x + y)


def test_fewer_outputs_declared_than_returned_serve_the_declared_ones(server: Any) -> None:
    x = _f32([[1, 2]])
    out = _infer(server, "first_only", {"x": x})
    assert list(out) == ["doubled"]
    np.testing.assert_array_equal(out["doubled"], x * 2)
    np.testing.assert_array_equal(_infer(server, "second_only", {"INPUT__0": x})["OUTPUT__1"],
                                  x * 3)


def test_reshape_gives_the_model_its_shape_and_the_client_the_declared_one(server: Any) -> None:
    out = _infer(server, "reshaped", {"x": _f32([[1, 2, 3, 4], [5, 6, 7, 8]])})
    assert out["s"].shape == (2, 1)
    np.testing.assert_array_equal(out["s"], [[10], [26]])


def test_the_config_gives_back_the_reshape_and_label_file_as_written(server: Any) -> None:
    """get_model_config left out a config.pbtxt's reshape and label_filename."""
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    grpc_config = tg.InferenceServerClient(server.grpc_url.removeprefix("grpc://"))
    reshaped = http.get_model_config("reshaped")
    assert reshaped["input"][0]["reshape"] == {"shape": [2, 2]}
    assert reshaped["output"][0]["reshape"] == {"shape": []}
    assert http.get_model_config("scores")["output"][0]["label_filename"] == "labels.txt"
    over_grpc = grpc_config.get_model_config("reshaped").config
    assert list(over_grpc.input[0].reshape.shape) == [2, 2]
    assert grpc_config.get_model_config("scores").config.output[0].label_filename == "labels.txt"
    assert "label_filename" not in http.get_model_config("first_row")["output"][0]


def test_a_dict_input_model_gets_the_inputs_by_name(server: Any) -> None:
    out = _infer(server, "keyed", {"p": _f32([[1], [2]]), "q": _f32([[3], [4]])})
    np.testing.assert_array_equal(out["out"], [[13], [24]])


def test_without_a_batch_dimension_inputs_may_differ_in_length(server: Any) -> None:
    x, y = np.array([1, 2, 3], np.float32), np.array([4, 5], np.float32)
    np.testing.assert_array_equal(_infer(server, "lengths", {"x": x, "y": y})["z"],
                                  [2, 4, 6, 8, 10])


def test_a_batched_model_answering_other_rows_fails_that_request(server: Any) -> None:
    with pytest.raises(InferenceServerException, match=r"returned \[1, 2\] for output 'y' on a "
                       r"request of 3 rows"):
        _infer(server, "first_row", {"x": np.ones((3, 2), np.float32)})
    np.testing.assert_array_equal(_infer(server, "by_name", {"a": _f32([[1, 1]]),
                                                             "b": _f32([[1, 0]])})["diff"],
                                  [[0, 1]])  # the server goes on


@pytest.mark.parametrize("grpc", [False, True])
def test_classification_answers_the_top_classes_as_triton_writes_them(server: Any,
                                                                      grpc: bool) -> None:
    module: Any = tg if grpc else th
    url = (server.grpc_url.removeprefix("grpc://") if grpc
           else server.url.removeprefix("http://"))
    client = module.InferenceServerClient(url)
    sent = module.InferInput("x", [1, 3], "FP32")
    sent.set_data_from_numpy(_f32([[0.25, 0.5, 2.0]]))
    for k, want in ((2, [b"2.000000:2", b"0.500000:1:dog"]), (9, [
            b"2.000000:2", b"0.500000:1:dog", b"0.250000:0:cat"])):
        asked = module.InferRequestedOutput("y", class_count=k)
        got = client.infer("scores", [sent], outputs=[asked]).as_numpy("y")
        assert got.shape == (1, len(want))
        assert [bytes(v) for v in got.reshape(-1)] == want
    for bad in (0, True, "2"):  # tritonclient sends no parameter for 0
        with pytest.raises(ProtocolError, match="expected the number of classes"):
            classes_asked(bad, "output 'y'")


def test_a_config_with_lists_of_unread_fields_parses(tmp_path: Path) -> None:
    path = tmp_path / "config.pbtxt"
    path.write_text(_config([_tensor("x", "2")], [_tensor("y", "2")]) + '''
model_warmup [ { name: "w" batch_size: 1 inputs { key: "x" value: { dims: [ 2 ] } } } ]
parameters [ { key: "a" value: { string_value: "b [c]" } } ]  # a [ comment
sequence_batching { control_input [ { name: "START" } ] }
''')
    raw = read_pbtxt(path, "m")
    assert [s["name"] for s in raw["inputs"]] == ["x"] and raw["max_batch_size"] == 8


def test_bind_leaves_a_plainly_called_model_alone_and_refuses_unknown_reshapes() -> None:
    model = Difference()
    a, b, x, y, out = (TensorSpec(n, "FP32", (-1, 2)) for n in ("a", "b", "x", "y", "out"))
    assert bind(model, [a, b], [out]) is model
    assert bind(model, [x, y], [out]) is model  # other names: declared order
    assert named_indices(["A__1", "B__0"]) == [1, 0]
    assert named_indices(["A__1", "B__1"]) is None and named_indices(["A__0", "b"]) is None
    with pytest.raises(ValueError, match=r"reshape names \['z'\]"):
        bind(model, [a, b], [out], reshape={"z": (2,)})


class _KeywordOnly(nn.Module):
    def forward(self, x: torch.Tensor, *, mask: torch.Tensor) -> torch.Tensor:
        return x * mask


class _PositionalOnly(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
        return x - y


def test_keyword_only_and_positional_only_parameters_are_passed_as_they_must_be() -> None:
    x, m = torch.tensor([[2.0, 3.0]]), torch.tensor([[1.0, 0.0]])
    specs = {n: TensorSpec(n, "FP32", (-1, 2)) for n in ("x", "y", "mask", "out")}
    keyword = bind(_KeywordOnly(), [specs["x"], specs["mask"]], [specs["out"]])
    assert torch.equal(keyword(x, m), x * m)
    positional = bind(_PositionalOnly(), [specs["y"], specs["x"]], [specs["out"]])
    assert torch.equal(positional(m, x), x - m)  # declared y, x: passed as forward(x, y)


class _Scores(nn.Module):
    """Queries against keys: a row per query, whatever the number of keys."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.T


_Q = {"name": "q", "shape": [2, 4], "datatype": "FP32", "data": [1.0] * 8}
_K = {"name": "k", "shape": [3, 4], "datatype": "FP32", "data": [1.0] * 12}


def _scores_answers(tmp_path: Path, mode: str, requests: list[list[dict[str, Any]]]
                    ) -> list[Any]:
    """``_Scores`` served in ``mode`` (inputs q then k, rows of 4), answering each request."""
    import json

    from paraloom import save

    folder = tmp_path / "scores"
    folder.mkdir()
    save(_Scores(), folder / "model.safetensors")
    spec = {"datatype": "FP32", "shape": [-1, 4]}
    (folder / "config.json").write_text(json.dumps({
        "mode": mode, "max_batch_size": 8, "workers": 1,
        "inputs": [{"name": "q", **spec}, {"name": "k", **spec}],
        "outputs": [{"name": "out", "datatype": "FP32", "shape": [-1, -1]}]}))
    app = create_repository_app(tmp_path, workers=1)
    client = Client(app)
    try:
        return [client.post("/v2/models/scores/infer", json={"inputs": inputs})
                for inputs in requests]
    finally:
        client.close()
        closing(app)


def test_the_rows_are_the_first_declared_inputs_whatever_order_a_request_lists(
        tmp_path: Path) -> None:
    for answer in _scores_answers(tmp_path, "sequential", [[_Q, _K], [_K, _Q]]):
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["shape"] == [2, 3]


def test_merged_requests_with_inputs_of_different_rows_name_each_input(tmp_path: Path) -> None:
    [answer] = _scores_answers(tmp_path, "batched", [[_K, _Q]])
    assert answer.status_code == 400
    assert "('q': 2, 'k': 3)" in answer.json()["error"]


def test_a_string_input_or_a_name_given_twice_makes_that_model_unavailable_not_the_server(
        tmp_path: Path) -> None:
    """A fixed-size TYPE_STRING input ended the server at startup (KeyError 'BYTES'), and a
    run-time load of it answered a plain-text 500; two inputs of one name were READY, and
    every request then failed with a 500."""
    root = tmp_path / "models"
    configs = {"strings": _config(['{ name: "x" data_type: TYPE_STRING dims: [ 1 ] }'],
                                  [_tensor("y", "1")]),
               "twice": _config([_tensor("x", "2"), _tensor("x", "2")], [_tensor("y", "2")]),
               "good": _config([_tensor("x", "2")], [_tensor("doubled", "2"),
                                                     _tensor("tripled", "2")])}
    for name, config in configs.items():
        (root / name / "1").mkdir(parents=True)
        torch.jit.script(Scaled()).save(str(root / name / "1" / "model.pt"))
        (root / name / "config.pbtxt").write_text(config)
    app = create_repository_app(root, allow_torchscript=True, workers=1)
    with ServerThread(app, grpc_port=0) as server:
        http = th.InferenceServerClient(server.url.removeprefix("http://"))
        index = {r["name"]: r for r in http.get_model_repository_index()}
        assert index["good"]["state"] == "READY"
        assert index["strings"]["state"] == "UNAVAILABLE"
        assert "inputs ['x'] are TYPE_STRING (BYTES), but a model takes tensors of numbers" in \
            index["strings"]["reason"]
        assert index["twice"]["state"] == "UNAVAILABLE"
        assert "inputs name ['x'] more than once" in index["twice"]["reason"]
        for client in (http, tg.InferenceServerClient(server.grpc_url)):
            with pytest.raises(InferenceServerException, match="TYPE_STRING") as refused:
                client.load_model("strings")  # answered in the protocol's form, not a crash
            assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
        np.testing.assert_allclose(_infer(server, "good", {"x": _f32([[1, 2]])})["doubled"],
                                   [[2, 4]])


def test_an_unknown_output_is_refused_before_the_model_runs(server: Any) -> None:
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    before = http.get_inference_statistics("first_only")["model_stats"][0]
    x = th.InferInput("x", [1, 2], "FP32")
    x.set_data_from_numpy(_f32([[1, 2]]))
    for asked in (["nope"], ["doubled", "doubled"]):
        with pytest.raises(InferenceServerException, match="request asks for outputs"):
            http.infer("first_only", [x], outputs=[th.InferRequestedOutput(n) for n in asked])
    after = http.get_inference_statistics("first_only")["model_stats"][0]
    assert after["inference_count"] == before["inference_count"]  # no pass was spent
    assert after["inference_stats"]["fail"]["count"] == \
        before["inference_stats"]["fail"]["count"] + 2
