"""Handlers: strings in and out around a model, over HTTP JSON, the binary extension and gRPC
with tritonclient; opt-in only; a handler's failure answers its request and nothing else."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from serving_helpers import WAIT_S, Client, closing
from tritonclient.utils import InferenceServerException

from paraloom import save
from paraloom.models import MLP
from paraloom.serving import ServerThread, create_repository_app
from paraloom.serving.handlers import Handler, HandlerFailedError
from paraloom.serving.signature import ModelSignature, TensorSpec

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serving" / "sentiment"
_SENTIMENT = (_EXAMPLE / "handler.py").read_text()  # the README's example, as shipped

_BROKEN = '''
INPUTS = [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}]
OUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]


def postprocess(logits):
    return [logits]
'''


_FP32_IN = "INPUTS = [{'name': 'input', 'datatype': 'FP32', 'shape': [-1, 16]}]\n"


def _model(folder: Path, handler: str | None, seed: int = 0) -> torch.nn.Module:
    folder.mkdir(parents=True)
    torch.manual_seed(seed)
    model = MLP(in_features=16, hidden=[8], num_classes=2).eval()
    save(model, folder / "model.safetensors")
    if handler is not None:
        (folder / "handler.py").write_text(textwrap.dedent(handler))
    return model


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    _model(tmp_path / "sentiment", _SENTIMENT)
    _model(tmp_path / "broken", _BROKEN)
    _model(tmp_path / "noinputs", "def preprocess(inputs):\n    return inputs\n")
    _model(tmp_path / "crashes", "raise ImportError('no tokenizer here')\n")
    _model(tmp_path / "mistyped", 'INPUTS = [{"name": "input", "datatype": "BYTES", '
           '"shape": [-1]}]\nOUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]\n'
           'def postprocess(out):\n    return {"y": out.numpy()}\n')
    _model(tmp_path / "plain", None)
    _model(tmp_path / "misfit", 'import torch\nINPUTS = [{"name": "text", "datatype": "BYTES", '
           '"shape": [-1]}]\nOUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]\n'
           'def preprocess(inputs):\n'
           '    return torch.zeros(len(inputs["text"]), 16, dtype=torch.float64)\n'
           'def postprocess(out):\n    return {"y": out.numpy()}\n')
    _model(tmp_path / "capped", _SENTIMENT)
    (tmp_path / "capped" / "config.json").write_text('{"max_batch_size": 2}')
    _model(tmp_path / "exits", _FP32_IN + "OUTPUTS = [{'name': 'y', 'datatype': 'FP32', "
           "'shape': [-1, 2]}]\nimport torch\ndef preprocess(inputs):\n"
           "    if inputs['input'].sum() > 0:\n        raise SystemExit(3)\n"
           "    return torch.from_numpy(inputs['input'])\n"
           "def postprocess(out):\n    raise KeyboardInterrupt\n")
    _model(tmp_path / "slow", _FP32_IN + "OUTPUTS = [{'name': 'output', 'datatype': 'FP32', "
           "'shape': [-1, 2]}]\nimport time, torch\ndef preprocess(inputs):\n"
           "    time.sleep(0.6)\n    return torch.from_numpy(inputs['input'])\n")
    return tmp_path


def _expected(models: Path, texts: list[bytes]) -> tuple[list[bytes], np.ndarray]:
    from paraloom.checkpoint import load

    model = load(models / "sentiment" / "model.safetensors").eval()
    scope: dict[str, object] = {}
    exec(_SENTIMENT, scope)  # the shipped example's text, run here to know what to expect
    with torch.no_grad():
        logits = model(scope["preprocess"]({"text": np.array(texts, dtype=object)}))  # type: ignore[operator]
    out = scope["postprocess"](logits)  # type: ignore[operator]
    return [s.encode() for s in out["label"]], out["score"]


def test_handlers_run_only_when_allowed(models: Path) -> None:
    app = create_repository_app(models, workers=1)
    client = Client(app)
    try:
        index = {row["name"]: row for row in client.post("/v2/repository/index").json()}
        assert index["sentiment"]["state"] == "UNAVAILABLE"
        assert "--allow-handlers" in index["sentiment"]["reason"]
        assert index["plain"]["state"] == "READY"
        # The reason, not a load that would fail the same way.
        refused = client.post("/v2/models/sentiment/infer", json={"inputs": [
            {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["fine"]}]})
        assert refused.status_code == 404
        assert "--allow-handlers" in refused.json()["error"]
        assert "/load" not in refused.json()["error"]
    finally:
        client.close()
        closing(app)


@pytest.fixture()
def server(models: Path) -> Iterator[ServerThread]:
    app = create_repository_app(models, allow_handlers=True, workers=1)
    with ServerThread(app, grpc_port=0, grpc_backend="grpcio") as srv:
        yield srv


def test_bad_handlers_are_unavailable_with_the_reason(server: ServerThread) -> None:
    client = th.InferenceServerClient(server.url[len("http://"):])
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["sentiment"]["state"] == index["broken"]["state"] == "READY"
    assert "INPUTS" in index["noinputs"]["reason"]
    assert "no tokenizer here" in index["crashes"]["reason"]
    assert "has no preprocess, so its INPUTS must be the model's" in index["mistyped"]["reason"]


def test_strings_in_and_out_over_every_encoding(server: ServerThread, models: Path) -> None:
    texts = [b"a great, warm film", "très lent, triste".encode(), b"ok"]
    labels, scores = _expected(models, texts)
    http = th.InferenceServerClient(server.url[len("http://"):])
    grpc = tg.InferenceServerClient(server.grpc_url)
    meta = http.get_model_metadata("sentiment")
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert [o["name"] for o in meta["outputs"]] == ["label", "score"]
    assert grpc.get_model_metadata("sentiment").inputs[0].datatype == "BYTES"
    data = np.array(texts, dtype=object)
    for client, module, binary in [(http, th, True), (http, th, False), (grpc, tg, None)]:
        given = module.InferInput("text", [3], "BYTES")
        if binary is None:
            given.set_data_from_numpy(data)
        else:
            given.set_data_from_numpy(data, binary_data=binary)
        outputs = None if binary is None else [
            module.InferRequestedOutput(n, binary_data=binary) for n in ("label", "score")]
        result = client.infer("sentiment", [given], outputs=outputs)
        assert [bytes(v) if not isinstance(v, str) else v.encode()
                for v in result.as_numpy("label")] == labels
        np.testing.assert_allclose(result.as_numpy("score"), scores, rtol=1e-6)


def test_a_handler_keeps_the_configs_max_batch_size(server: ServerThread) -> None:
    http = th.InferenceServerClient(server.url[len("http://"):])
    for rows, fits in ((2, True), (3, False)):
        given = th.InferInput("text", [rows], "BYTES")
        given.set_data_from_numpy(np.array([b"fine"] * rows, dtype=object))
        if fits:
            assert len(http.infer("capped", [given]).as_numpy("label")) == rows
        else:
            with pytest.raises(InferenceServerException, match="3 rows, over the model's "
                               "max_batch_size 2"):
                http.infer("capped", [given])


def test_a_failing_handler_answers_its_request_only(server: ServerThread) -> None:
    http = th.InferenceServerClient(server.url[len("http://"):])
    empty = th.InferInput("text", [1], "BYTES")
    empty.set_data_from_numpy(np.array([b""], dtype=object))
    with pytest.raises(InferenceServerException, match="refused the input: ValueError: an "
                       "empty text") as refused:
        http.infer("sentiment", [empty])
    assert refused.value.status() == "400"
    x = th.InferInput("input", [1, 16], "FP32")
    x.set_data_from_numpy(np.zeros((1, 16), np.float32))
    with pytest.raises(InferenceServerException, match="postprocess returned list") as failed:
        http.infer("broken", [x])
    assert failed.value.status() == "500"
    url = f"{server.url}/v2/models/sentiment/infer"
    wrong_count = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                               "data": ["one"]}]}
    r = httpx.post(url, json=wrong_count, timeout=WAIT_S)
    assert r.status_code == 400 and "1 strings but shape [2] needs 2" in r.json()["error"]
    head = json.dumps({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": 6}}]}).encode()
    r = httpx.post(url, content=head + b"\x09\x00\x00\x00ab", timeout=WAIT_S,
                   headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "says it has 9 bytes but only 2 remain" in r.json()["error"]
    assert "numbers take the model's datatype" in r.json()["error"]  # floats sent as BYTES
    words = th.InferInput("input", [1, 16], "BYTES")
    words.set_data_from_numpy(np.array([[b"w"] * 16], dtype=object))
    with pytest.raises(InferenceServerException, match="handler.py"):
        http.infer("plain", [words])
    ok = th.InferInput("text", [1], "BYTES")
    ok.set_data_from_numpy(np.array([b"fine"], dtype=object))
    # A request that matches the handler's INPUTS, whose preprocess gives float64 to a float32
    # model: the handler's fault (500), not the client's (400).
    with pytest.raises(InferenceServerException, match="handler.py preprocess returned.*"
                       "preprocess gave Tensor.*float64.*make preprocess return") as misfit:
        http.infer("misfit", [ok])
    assert misfit.value.status() == "500"
    assert http.infer("sentiment", [ok]).as_numpy("label").shape == (1,)
    assert http.is_server_ready()


def test_a_handler_raising_systemexit_fails_its_request_not_the_server(
        server: ServerThread) -> None:
    """SystemExit in preprocess and KeyboardInterrupt in postprocess: over grpcio they stopped
    the server, over HTTP they were a plain-text 500 counted as no failure."""
    grpc = tg.InferenceServerClient(server.grpc_url)
    http = th.InferenceServerClient(server.url[len("http://"):])
    for value, status, message in ((1.0, "400", "refused the input: SystemExit: 3"),
                                   (0.0, "500", "postprocess failed: KeyboardInterrupt")):
        for client, module in ((grpc, tg), (http, th)):
            x = module.InferInput("input", [1, 16], "FP32")
            x.set_data_from_numpy(np.full((1, 16), value, np.float32))
            with pytest.raises(InferenceServerException, match=message):
                client.infer("exits", [x])
        r = httpx.post(f"{server.url}/v2/models/exits/infer", timeout=WAIT_S, json={"inputs": [
            {"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [value] * 16}]})
        assert r.status_code == int(status) and message in r.json()["error"]
    assert grpc.is_server_live() and http.is_server_ready()
    metrics = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
    for reason in ("bad_request", "handler_error"):  # each counted, by transport: 3 a kind
        assert f'failures_total{{model="exits",reason="{reason}"}} 3.0' in metrics
    grpc.close()


def test_an_unload_lets_a_request_in_preprocess_finish_on_its_model(
        server: ServerThread) -> None:
    """It was a 404: the request looked the model up again after its preprocess."""
    import threading

    http = th.InferenceServerClient(server.url[len("http://"):], network_timeout=WAIT_S)
    x = np.random.default_rng(0).random((1, 16), dtype=np.float32)
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{server.url}/v2/models/slow/infer", timeout=WAIT_S, json={"inputs": [
            {"name": "input", "shape": [1, 16], "datatype": "FP32",
             "data": x.ravel().tolist()}]})))
    request.start()
    import time
    time.sleep(0.25)  # the request is in its 0.6 s preprocess
    http.unload_model("slow")
    request.join(WAIT_S)
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert not http.is_model_ready("slow")


def test_a_slow_handler_holds_up_only_its_own_model(tmp_path: Path) -> None:
    """Handlers ran on the threads all the server's work shares (anyio's 40): 80 requests on
    a handler that slept 5 s took them all, and another handler model's requests, the index,
    a classification request, all waited 8.6 s."""
    import asyncio

    flag = tmp_path / "open"
    _model(tmp_path / "models" / "held", _FP32_IN + "OUTPUTS = [{'name': 'output', "
           "'datatype': 'FP32', 'shape': [-1, 2]}]\nimport os, time, torch\n"
           "def preprocess(inputs):\n    end = time.monotonic() + 30\n"
           f"    while not os.path.exists({str(flag)!r}) and time.monotonic() < end:\n"
           "        time.sleep(0.01)\n    return torch.from_numpy(inputs['input'])\n")
    _model(tmp_path / "models" / "sentiment", _SENTIMENT)
    body = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32",
                        "data": [0.5] * 16}]}
    text = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                        "data": ["a fine day"]}]}
    app = create_repository_app(tmp_path / "models", allow_handlers=True, workers=1)

    async def crowd(url: str) -> tuple[bool, int, list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S,
                                     limits=httpx.Limits(max_connections=100)) as client:
            held = [asyncio.create_task(client.post("/v2/models/held/infer", json=body))
                    for _ in range(60)]
            await asyncio.sleep(0.5)  # every thread they can get is asleep in preprocess
            other = await client.post("/v2/models/sentiment/infer", json=text)
            went_on = not any(task.done() for task in held)
            flag.touch()
            return went_on, other.status_code, [r.status_code for r in
                                                await asyncio.gather(*held)]

    with ServerThread(app) as server:
        went_on, other, held = asyncio.run(crowd(server.url))
    assert went_on, "the other model's request waited for the held model's handler"
    assert other == 200 and held == [200] * 60


def _handler(preprocess: object = None, postprocess: object = None) -> Handler:
    model = ModelSignature((TensorSpec("a", "FP32", (-1, 2)), TensorSpec("b", "FP32", (-1, 2))),
                           (TensorSpec("output", "FP32", (-1, 2)),))
    public = ModelSignature((TensorSpec("x", "FP32", (-1, 2)),),
                            (TensorSpec("label", "BYTES", (-1,)),))
    return Handler(Path("handler.py"), preprocess, postprocess, public, model)  # type: ignore[arg-type]


def test_preprocess_may_return_a_dict_keyed_by_the_model_inputs() -> None:
    x = torch.ones(3, 2)
    handler = _handler(lambda inputs: {"b": torch.from_numpy(inputs["x"]) * 2,
                                       "a": torch.from_numpy(inputs["x"])})
    a, b = handler.to_model([x])
    assert torch.equal(a, x) and torch.equal(b, 2 * x)
    with pytest.raises(HandlerFailedError, match="missing: \\['b'\\]"):
        _handler(lambda inputs: {"a": x}).to_model([x])
    with pytest.raises(HandlerFailedError, match="returned str"):
        _handler(lambda inputs: "text").to_model([x])


def test_postprocess_outputs_are_checked_against_outputs() -> None:
    handler = _handler(postprocess=lambda out: {"label": np.array(["x"] * len(out),
                                                                  dtype=object)})
    assert list(handler.from_model(torch.zeros(2, 2))["label"]) == ["x", "x"]
    numbers = _handler(postprocess=lambda out: {"label": np.zeros(2, np.int64)})
    # it said torch.int64, which the handler never returned
    with pytest.raises(HandlerFailedError, match="returned numpy int64 for output 'label', "
                                                 "which OUTPUTS declares BYTES"):
        numbers.from_model(torch.zeros(2, 2))
    tensor = _handler(postprocess=lambda out: {"label": torch.zeros(2)})
    with pytest.raises(HandlerFailedError, match="returned torch.float32 for output 'label'"):
        tensor.from_model(torch.zeros(2, 2))
    with pytest.raises(HandlerFailedError, match="without outputs \\['label'\\]"):
        _handler(postprocess=lambda out: {}).from_model(torch.zeros(2, 2))
    # an object array of other things was sent as each item's str(): ["1", "None", ...]
    objects = _handler(postprocess=lambda out: {"label": np.array([1, None], dtype=object)})
    with pytest.raises(HandlerFailedError, match="holding int 1.*str or bytes only"):
        objects.from_model(torch.zeros(2, 2))


@pytest.mark.parametrize("value", [np.zeros(2, ">f4"), np.zeros(2, np.complex64),
                                   torch.zeros(2, dtype=torch.complex64),
                                   np.zeros(2, "datetime64[s]")])
def test_a_postprocess_array_torch_cannot_send_is_the_handlers_error(value: object) -> None:
    """A big-endian, complex or datetime array was 'the model failed' (reason model_error),
    though the model had run: it is what the handler returned."""
    handler = _handler(postprocess=lambda out: {"label": value})
    with pytest.raises(HandlerFailedError, match="postprocess returned, for output 'label', "
                                                 ".* that cannot be sent"):
        handler.from_model(torch.zeros(2, 2))


def test_a_model_refusing_what_preprocess_made_is_told_as_it_happened() -> None:
    """A 0-row preprocess result was said to meet a version on which 'none has run yet',
    though requests had: only a model that raised, before any input ran, is told that."""
    from paraloom.inference.errors import InvalidRequestError
    from paraloom.serving.served import _preprocess_misfit

    empty = InvalidRequestError("input has 0 rows; send at least one row",
                                received="Tensor(N, 1) float32")
    said = str(_preprocess_misfit("handler.py", empty))
    assert "(input has 0 rows; send at least one row): preprocess gave Tensor(N, 1) float32; " \
        "make preprocess return what the model takes" in said and "none has run" not in said
    raised = InvalidRequestError("failed", received="Tensor(N, 2) float32")
    raised.__cause__ = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert "RuntimeError: mat1" in str(_preprocess_misfit("handler.py", raised))
    assert "none has run on this version yet" in str(_preprocess_misfit("handler.py", raised))
    known = InvalidRequestError("failed", received="Tensor(N, 2) float32",
                                expected="Tensor(N, 3) float32")
    known.__cause__ = RuntimeError("shapes")
    assert str(_preprocess_misfit("handler.py", known)).endswith(
        "preprocess gave Tensor(N, 2) float32, the model takes Tensor(N, 3) float32; make "
        "preprocess return that")
