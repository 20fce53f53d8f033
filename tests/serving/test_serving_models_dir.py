"""A models directory served at once: several models, each in its own pool, loaded, replaced and
unloaded at run time over HTTP and gRPC (tritonclient.http and tritonclient.grpc)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc as grpc_lib
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from serving_helpers import WAIT_S
from torch import nn
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

import paraloom
from paraloom.models import MLP, LeNet
from paraloom.serving import ServerThread, create_repository_app


def _lenet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return LeNet(image_size=8).eval()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MLP(in_features=6, hidden=(8,), num_classes=3).eval()


@pytest.fixture()
def models_dir(tmp_path: Path) -> dict[str, object]:
    root = tmp_path / "models"
    root.mkdir()
    lenet = _lenet(0)
    paraloom.save(lenet, root / "lenet.safetensors")
    (root / "mlp").mkdir()
    mlp = _mlp(1)
    paraloom.save(mlp, root / "mlp" / "model.safetensors")
    (root / "mlp" / "config.json").write_text(json.dumps(
        {"name": "tabular", "workers": 1, "batch_limit": 4}))
    cnn = {v: _lenet(10 + v) for v in (1, 2, 3)}
    for v, model in cnn.items():
        (root / "cnn" / str(v)).mkdir(parents=True)
        paraloom.save(model, root / "cnn" / str(v) / "model.safetensors")
    (root / "cnn" / "config.json").write_text(json.dumps(
        {"version_policy": {"specific": {"versions": [2]}}}))
    torch.save(lenet.state_dict(), root / "pickled.pt")  # must never be opened
    outside = tmp_path / "outside.safetensors"
    paraloom.save(lenet, outside)
    os.symlink(outside, root / "escape.safetensors")
    return {"root": root, "lenet": lenet, "mlp": mlp, "cnn": cnn, "tmp": tmp_path}


@pytest.fixture()
def server(models_dir: dict) -> Iterator[ServerThread]:
    app = create_repository_app(models_dir["root"], workers=2, batch_limit=8, max_wait_ms=0)
    with ServerThread(app, grpc_port=0) as s:
        yield s


def _run(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def _http(server: ServerThread) -> th.InferenceServerClient:
    return th.InferenceServerClient(f"{server.host}:{server.port}", network_timeout=WAIT_S)


def _infer(client: th.InferenceServerClient | tg.InferenceServerClient, module, model: str,
           x: np.ndarray) -> np.ndarray:
    item = module.InferInput("input", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return client.infer(model, [item]).as_numpy("output")


def test_every_model_is_served_with_its_own_pool_and_config(server: ServerThread,
                                                            models_dir: dict) -> None:
    http, grpc = _http(server), tg.InferenceServerClient(server.grpc_url)
    img = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
    tab = np.random.default_rng(1).random((2, 6), dtype=np.float32)
    for client, module in ((http, th), (grpc, tg)):
        np.testing.assert_allclose(_infer(client, module, "lenet", img),
                                   _run(models_dir["lenet"], img), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_infer(client, module, "tabular", tab),
                                   _run(models_dir["mlp"], tab), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(_infer(client, module, "cnn", img),  # version 2, the policy
                                   _run(models_dir["cnn"][2], img), rtol=1e-5, atol=1e-6)
    assert http.get_model_metadata("cnn")["versions"] == ["2"]
    assert http.get_model_metadata("tabular")["inputs"] == [
        {"name": "input", "datatype": "FP32", "shape": [-1, 6]}]
    pools = server.app.state.repository.pools()
    assert len({id(p) for p in pools.values()}) == 3
    assert (pools["tabular"].workers, pools["tabular"]._config.batch_limit) == (1, 4)
    assert (pools["lenet"].workers, pools["lenet"]._config.batch_limit) == (2, 8)
    index = {row["name"]: row for row in http.get_model_repository_index()}
    assert {n: (r["state"], r["version"]) for n, r in index.items() if r["state"] == "READY"} \
        == {"cnn": ("READY", "2"), "lenet": ("READY", "1"), "tabular": ("READY", "1")}
    assert "pickle" in index["pickled"]["reason"] and index["pickled"]["state"] == "UNAVAILABLE"
    assert "outside the models directory" in index["escape"]["reason"]
    grpc_index = {m.name: m.state for m in grpc.get_model_repository_index().models}
    assert grpc_index == {n: r["state"] for n, r in index.items()}
    with pytest.raises(InferenceServerException, match="not loaded"):
        _infer(grpc, tg, "pickled", img)
    grpc.close()


def test_metrics_carry_each_model_label(server: ServerThread, models_dir: dict) -> None:
    import urllib.request

    http = _http(server)
    _infer(http, th, "lenet", np.zeros((1, 1, 8, 8), dtype=np.float32))
    _infer(http, th, "tabular", np.zeros((3, 6), dtype=np.float32))
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    assert 'paraloom_inference_requests_total{model="lenet"} 1.0' in text
    assert 'paraloom_inference_requests_total{model="tabular"} 1.0' in text
    assert 'paraloom_pool_rows_total{model="tabular"} 3.0' in text
    assert 'paraloom_pool_rows_total{model="cnn"} 0.0' in text
    # A load serves the model in a new pool; its counters go on from the old pool's.
    http.load_model("tabular")
    _infer(http, th, "tabular", np.zeros((2, 6), dtype=np.float32))
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    assert 'paraloom_pool_rows_total{model="tabular"} 5.0' in text, text
    assert 'paraloom_pool_requests_total{model="tabular"} 2.0' in text
    # The weights unchanged, the version stays (a client pinned to "1" got 404 after a load);
    # new weights in the file are the next version.
    assert 'paraloom_model_version{model="tabular"} 1.0' in text
    assert http.is_model_ready("tabular", "1")
    paraloom.save(_mlp(5), models_dir["root"] / "mlp" / "model.safetensors")
    http.load_model("tabular")
    assert http.is_model_ready("tabular", "2") and not http.is_model_ready("tabular", "1")


def test_unload_and_load_over_grpc_and_http(server: ServerThread, models_dir: dict) -> None:
    http, grpc = _http(server), tg.InferenceServerClient(server.grpc_url)
    img = np.random.default_rng(2).random((1, 1, 8, 8), dtype=np.float32)
    old_pool = server.app.state.repository.pools()["lenet"]
    grpc.unload_model("lenet")
    assert old_pool.closed
    assert not http.is_model_ready("lenet") and not grpc.is_model_ready("lenet")
    with pytest.raises(InferenceServerException) as caught:
        _infer(grpc, tg, "lenet", img)
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="not loaded"):
        _infer(http, th, "lenet", img)
    # The other models are untouched.
    np.testing.assert_allclose(_infer(http, th, "cnn", img), _run(models_dir["cnn"][2], img),
                               rtol=1e-5, atol=1e-6)
    http.load_model("lenet")
    np.testing.assert_allclose(_infer(grpc, tg, "lenet", img), _run(models_dir["lenet"], img),
                               rtol=1e-5, atol=1e-6)
    # A model added to the directory at run time is loaded by name.
    new = _lenet(99)
    paraloom.save(new, models_dir["root"] / "late.safetensors")
    grpc.load_model("late")
    np.testing.assert_allclose(_infer(http, th, "late", img), _run(new, img), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(InferenceServerException) as missing:
        grpc.load_model("nothere")
    assert missing.value.status() == "StatusCode.NOT_FOUND"
    grpc.close()


def test_load_replaces_a_model_and_in_flight_requests_finish_on_the_old_one(
        server: ServerThread, models_dir: dict) -> None:
    http = _http(server)
    root = models_dir["root"]
    img = np.random.default_rng(3).random((2, 1, 8, 8), dtype=np.float32)
    old = _run(models_dir["cnn"][2], img)
    # Change the policy to the latest version; a reload builds a new pool from the directory.
    (root / "cnn" / "config.json").write_text(json.dumps({"workers": 1}))
    old_pool = server.app.state.repository.pools()["cnn"]

    def call(i: int) -> np.ndarray:
        client = _http(server)
        return _infer(client, th, "cnn", img)

    with ThreadPoolExecutor(8) as pool:
        before = [pool.submit(call, i) for i in range(24)]
        time.sleep(0.01)
        http.load_model("cnn")
        answers = [f.result(WAIT_S) for f in before]
    # Every request got a whole answer of one version or the other, none failed.
    new = _run(models_dir["cnn"][3], img)
    for out in answers:
        assert np.allclose(out, old, atol=1e-5) or np.allclose(out, new, atol=1e-5)
    assert old_pool.closed
    assert http.get_model_metadata("cnn")["versions"] == ["3"]
    np.testing.assert_allclose(_infer(http, th, "cnn", img), new, rtol=1e-5, atol=1e-6)
    assert server.app.state.repository.pools()["cnn"].workers == 1


def test_loads_that_break_the_rules_are_refused(server: ServerThread, models_dir: dict) -> None:
    grpc = tg.InferenceServerClient(server.grpc_url)
    http = _http(server)
    channel = grpc_lib.insecure_channel(server.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc_lib.RpcError) as outside:  # weights from outside the model's folder
        stub.RepositoryModelLoad(_load_request("lenet", "../outside.safetensors"),
                                 timeout=WAIT_S)
    assert outside.value.code() == grpc_lib.StatusCode.PERMISSION_DENIED, outside.value.details()
    with pytest.raises(grpc_lib.RpcError) as escape:  # a symlink out of the directory
        stub.RepositoryModelLoad(_load_request("escape", ""), timeout=WAIT_S)
    assert escape.value.code() == grpc_lib.StatusCode.INVALID_ARGUMENT
    assert "outside the models directory" in escape.value.details()
    channel.close()
    with pytest.raises(InferenceServerException) as pickled:
        http.load_model("pickled")
    assert "pickle" in pickled.value.message()
    with pytest.raises(InferenceServerException) as upload:
        grpc.load_model("lenet", config='{"x": 1}')
    assert upload.value.status() == "StatusCode.PERMISSION_DENIED"
    assert "never takes model files or configs" in upload.value.message()
    grpc.close()


def _load_request(name: str, path: str) -> pb.RepositoryModelLoadRequest:
    request = pb.RepositoryModelLoadRequest(model_name=name)
    if path:
        request.parameters["path"].string_param = path
    return request


@pytest.mark.parametrize(("policy", "served"), [
    ({"latest": {"num_versions": 2}}, ["2", "3"]),
    ({"all": {}}, ["1", "2", "3"]),
    ({"specific": {"versions": [3, 1]}}, ["1", "3"]),
])
def test_a_version_policy_serves_several_versions_each_in_its_own_pool(
        tmp_path: Path, policy: dict, served: list[str]) -> None:
    root = tmp_path / "models"
    cnn = {v: _lenet(20 + v) for v in (1, 2, 3)}
    for v, model in cnn.items():
        (root / "cnn" / str(v)).mkdir(parents=True)
        paraloom.save(model, root / "cnn" / str(v) / "model.safetensors")
    (root / "cnn" / "config.json").write_text(json.dumps({"version_policy": policy,
                                                          "workers": 1}))
    app = create_repository_app(root, workers=1, batch_limit=8)
    x = np.random.default_rng(3).random((2, 1, 8, 8), dtype=np.float32)
    with ServerThread(app, grpc_port=0) as server:
        http, grpc = _http(server), tg.InferenceServerClient(server.grpc_url)
        assert http.get_model_metadata("cnn")["versions"] == served
        assert grpc.get_model_metadata("cnn").versions == served
        for v in served:
            for client, module in ((http, th), (grpc, tg)):
                item = module.InferInput("input", list(x.shape), "FP32")
                item.set_data_from_numpy(x)
                result = client.infer("cnn", [item], model_version=v)
                np.testing.assert_allclose(result.as_numpy("output"), _run(cnn[int(v)], x),
                                           rtol=1e-5, atol=1e-6)
            assert http.is_model_ready("cnn", v) and grpc.is_model_ready("cnn", v)
        latest = _infer(http, th, "cnn", x)  # no version: the latest served
        np.testing.assert_allclose(latest, _run(cnn[int(served[-1])], x), rtol=1e-5, atol=1e-6)
        for v in {"1", "2", "3"} - set(served):
            with pytest.raises(InferenceServerException, match=f"no version '{v}'"):
                item = th.InferInput("input", list(x.shape), "FP32")
                item.set_data_from_numpy(x)
                http.infer("cnn", [item], model_version=v)
        index = http.get_model_repository_index()
        assert [(r["name"], r["version"], r["state"]) for r in index] == \
            [("cnn", v, "READY") for v in served]
        assert len({id(p) for p in app.state.repository.pools().values()}) == len(served)
        http.unload_model("cnn")  # every version goes, and comes back with a load
        assert not http.is_model_ready("cnn")
        assert [(r["version"], r["state"], r["reason"])
                for r in http.get_model_repository_index()] == \
            [(v, "UNAVAILABLE", "unloaded") for v in served]
        grpc.load_model("cnn")
        assert http.get_model_metadata("cnn")["versions"] == served
        grpc.close()


def test_a_version_policy_naming_a_missing_version_serves_the_others_or_malformed_is_refused(
        tmp_path: Path) -> None:
    """A missing version folder refused the whole model; Triton loads the versions present
    and reports the missing one, as paraloom does for a version whose file is missing."""
    root = tmp_path / "models"
    for name, policy in (("gone", {"specific": {"versions": [1, 4]}}),
                         ("none", {"specific": {"versions": [5]}}),
                         ("bad", {"latest": {"num_versions": 0}}),
                         ("odd", {"newest": {}})):
        (root / name / "1").mkdir(parents=True)
        paraloom.save(_lenet(0), root / name / "1" / "model.safetensors")
        (root / name / "config.json").write_text(json.dumps({"version_policy": policy}))
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        http = _http(server)
        rows = http.get_model_repository_index()
        gone = {r["version"]: r for r in rows if r["name"] == "gone"}
        index = {r["name"]: r for r in rows}
        assert gone["1"]["state"] == "READY" and http.is_model_ready("gone", "1")
        assert gone["4"]["state"] == "UNAVAILABLE"
        assert "names version 4, which is not in gone/ (found [1])" in gone["4"]["reason"]
        item = th.InferInput("input", [1, 1, 8, 8], "FP32")
        item.set_data_from_numpy(np.zeros((1, 1, 8, 8), np.float32))
        assert http.infer("gone", [item]).get_response()["model_version"] == "1"
    assert "names version 5, which is not in none/" in index["none"]["reason"]
    assert "num_versions" in index["bad"]["reason"] and "not supported" in index["bad"]["reason"]
    assert "version_policy" in index["odd"]["reason"]
    assert {r["state"] for r in index.values()} == {"UNAVAILABLE"}


def test_a_weights_path_cannot_swap_a_numbered_version(models_dir: dict) -> None:
    """A numbered version is its folder's weights: a swap would serve a version number that
    names no folder (and one a later folder would collide with)."""
    import urllib.error
    import urllib.request

    app = create_repository_app(models_dir["root"], workers=1)
    with ServerThread(app) as server:
        http = _http(server)
        request = urllib.request.Request(
            f"{server.url}/v2/repository/models/cnn/load", method="POST",
            data=json.dumps({"parameters": {"path": "cnn/1/model.safetensors"}}).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=WAIT_S)
        assert refused.value.code == 400
        text = refused.value.read().decode()
        assert "numbered versions ['2']" in text and "3/model.safetensors" in text
        assert http.get_model_metadata("cnn")["versions"] == ["2"]
        x = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
        np.testing.assert_allclose(_infer(http, th, "cnn", x), _run(_lenet(12), x),
                                   rtol=1e-5, atol=1e-6)


def test_a_top_level_model_swaps_weights_from_the_models_dir(models_dir: dict) -> None:
    """DIR/lenet.safetensors: its own folder is DIR, so a path names a file there."""
    import urllib.request

    root = models_dir["root"]
    paraloom.save(_lenet(7), root / "lenet-v2.safetensors")
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        http = _http(server)
        request = urllib.request.Request(
            f"{server.url}/v2/repository/models/lenet/load", method="POST",
            data=json.dumps({"parameters": {"path": "lenet-v2.safetensors"}}).encode())
        with urllib.request.urlopen(request, timeout=WAIT_S) as answer:
            assert json.loads(answer.read())["version"] == "2"
        x = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
        np.testing.assert_allclose(_infer(http, th, "lenet", x), _run(_lenet(7), x),
                                   rtol=1e-5, atol=1e-6)
        # a rebuild from the folder is the next version again (it was 1 again, so a request
        # pinned to version 1 got weights that were never version 1)
        paraloom.save(_lenet(8), root / "lenet.safetensors")
        http.load_model("lenet")
        assert http.get_model_metadata("lenet")["versions"] == ["3"]
        item = th.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        for stale in ("1", "2"):
            with pytest.raises(InferenceServerException, match="version"):
                http.infer("lenet", [item], model_version=stale)
        pinned = http.infer("lenet", [item], model_version="3").as_numpy("output")
        np.testing.assert_allclose(pinned, _run(_lenet(8), x), rtol=1e-5, atol=1e-6)


def test_version_folders_are_numbers_not_starting_with_0(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for folder, seed in (("2", 2), ("007", 7), ("0", 0), ("v9", 9), ("\u00b2", 4)):
        (root / "cnn" / folder).mkdir(parents=True)
        paraloom.save(_lenet(seed), root / "cnn" / folder / "model.safetensors")
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        http = _http(server)
        assert http.get_model_metadata("cnn")["versions"] == ["2"]  # Triton ignores the rest
        x = np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32)
        np.testing.assert_allclose(_infer(http, th, "cnn", x), _run(_lenet(2), x),
                                   rtol=1e-5, atol=1e-6)


def test_a_model_whose_declared_shapes_have_no_batch_dimension_says_so_in_its_config(
        tmp_path: Path) -> None:
    # mode "inplace": each request runs alone, its shapes as declared (here 3 x 6, no rows).
    folder = tmp_path / "fixed"
    folder.mkdir()
    paraloom.save(_mlp(0), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "mode": "inplace",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 6]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [3, 3]}]}))
    app = create_repository_app(tmp_path, workers=1)
    with ServerThread(app) as server:
        config = _http(server).get_model_config("fixed")
        assert config["max_batch_size"] == 0
        assert [t["dims"] for t in (*config["input"], *config["output"])] == [[3, 6], [3, 3]]
        x = np.random.default_rng(0).random((3, 6), dtype=np.float32)
        np.testing.assert_allclose(_infer(_http(server), th, "fixed", x), _run(_mlp(0), x),
                                   rtol=1e-5, atol=1e-6)


def test_labels_for_a_missing_file_or_an_unknown_output_make_the_model_unavailable(
        tmp_path: Path) -> None:
    """Both were taken silently: classification then answered without labels."""
    root = tmp_path / "models"
    for name, labels in (("typo", {"output": "lables.txt"}), ("other", {"logits": "l.txt"}),
                         ("good", {"output": "l.txt"})):
        (root / name).mkdir(parents=True)
        paraloom.save(_lenet(0), root / name / "model.safetensors")
        (root / name / "l.txt").write_text("\n".join(f"class {i}" for i in range(10)))
        (root / name / "config.json").write_text(json.dumps({"labels": labels}))
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        index = {r["name"]: r for r in _http(server).get_model_repository_index()}
        assert index["good"]["state"] == "READY"
        assert index["typo"]["state"] == "UNAVAILABLE"
        assert "labels names ['lables.txt'], not in the model's folder" in index["typo"]["reason"]
        assert index["other"]["state"] == "UNAVAILABLE"
        assert "outputs ['logits'], which 'other' does not have; its outputs are ['output']" \
            in index["other"]["reason"]


def test_a_specific_version_policy_on_a_folder_without_versions_says_so(tmp_path: Path) -> None:
    """It served the folder's weights as version 1, whatever versions the policy named."""
    root = tmp_path / "models"
    (root / "flat").mkdir(parents=True)
    paraloom.save(_lenet(0), root / "flat" / "model.safetensors")
    (root / "flat" / "config.json").write_text(json.dumps(
        {"version_policy": {"specific": {"versions": [7]}}}))
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        (row,) = _http(server).get_model_repository_index()
    assert row["state"] == "UNAVAILABLE"
    assert "serves versions [7], but flat/ has no numbered version folders" in row["reason"]


def test_declared_inputs_the_model_cannot_take_are_warned_about_at_load(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It was READY in silence, and every request then failed with a 500."""
    root = tmp_path / "models"
    (root / "wrong").mkdir(parents=True)
    paraloom.save(_mlp(0), root / "wrong" / "model.safetensors")  # takes 6 features
    (root / "wrong" / "config.json").write_text(json.dumps({
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 5]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]}))
    with caplog.at_level("WARNING", logger="paraloom.serving"):
        app = create_repository_app(root, workers=1)
    try:
        assert "failed on zeros shaped as its declared inputs (input [-1, 5])" in caplog.text
    finally:
        for served in app.state.repository.every():
            served.pool.close(drain=False)


def test_an_unknown_models_404_lists_the_served_ones_apart_from_the_unavailable(
        tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    paraloom.save(_lenet(0), root / "good.safetensors")
    torch.save({}, root / "bad.pt")  # a pickle: listed, never served
    app = create_repository_app(root, workers=1)
    with ServerThread(app) as server:
        with pytest.raises(InferenceServerException) as info:
            _http(server).get_model_metadata("nope")
    assert "this server serves ['good'] (not serving now: ['bad'])" in str(info.value)


def test_a_version_that_fails_to_load_leaves_the_others_serving(tmp_path: Path) -> None:
    """As Triton: each version loads on its own; one that fails is UNAVAILABLE with its reason,
    and a request without a version goes to the latest that loaded."""
    root = tmp_path / "models"
    cnn = {v: _lenet(30 + v) for v in (1, 2, 3)}
    for v, model in cnn.items():
        (root / "cnn" / str(v)).mkdir(parents=True)
        paraloom.save(model, root / "cnn" / str(v) / "model.safetensors")
    (root / "cnn" / "3" / "model.safetensors").write_bytes(b"not safetensors")
    (root / "cnn" / "config.json").write_text(json.dumps({"version_policy": {"all": {}},
                                                          "workers": 1}))
    x = np.random.default_rng(4).random((2, 1, 8, 8), dtype=np.float32)
    app = create_repository_app(root, workers=1)
    with ServerThread(app, grpc_port=0) as server:
        http, grpc = _http(server), tg.InferenceServerClient(server.grpc_url)
        try:
            rows = [(r["version"], r["state"]) for r in http.get_model_repository_index()]
            assert rows == [("1", "READY"), ("2", "READY"), ("3", "UNAVAILABLE")]
            reason = http.get_model_repository_index()[2]["reason"]
            assert "safetensors" in reason, reason
            np.testing.assert_allclose(_infer(http, th, "cnn", x), _run(cnn[2], x),
                                       rtol=1e-5, atol=1e-6)  # the latest that loaded
            assert http.is_model_ready("cnn") and http.is_model_ready("cnn", "1")
            assert not http.is_model_ready("cnn", "3") and not grpc.is_model_ready("cnn", "3")
            item = th.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            with pytest.raises(InferenceServerException, match="version 3 is not loaded"):
                http.infer("cnn", [item], model_version="3")
            paraloom.save(cnn[3], root / "cnn" / "3" / "model.safetensors")  # fixed: reload
            grpc.load_model("cnn")
            assert http.get_model_metadata("cnn")["versions"] == ["1", "2", "3"]
            np.testing.assert_allclose(_infer(grpc, tg, "cnn", x), _run(cnn[3], x),
                                       rtol=1e-5, atol=1e-6)
            for v in ("1", "2", "3"):
                (root / "cnn" / v / "model.safetensors").write_bytes(b"broken")
            with pytest.raises(InferenceServerException, match="no version loads: version 1"):
                http.load_model("cnn")  # none loads: the old versions keep serving
            assert http.get_model_metadata("cnn")["versions"] == ["1", "2", "3"]
        finally:
            grpc.close()


def test_a_new_version_that_fails_to_load_is_listed_with_why_while_the_old_serves(
        tmp_path: Path) -> None:
    """Triton lists a version that failed to load as UNAVAILABLE with its reason; here it
    was missing from the index (only the old version's READY row), so nothing said why."""
    root = tmp_path / "models"
    (root / "cnn" / "1").mkdir(parents=True)
    v1 = _lenet(41)
    paraloom.save(v1, root / "cnn" / "1" / "model.safetensors")
    x = np.random.default_rng(5).random((2, 1, 8, 8), dtype=np.float32)
    with ServerThread(create_repository_app(root, workers=1)) as server:
        http = _http(server)
        (root / "cnn" / "2").mkdir()
        (root / "cnn" / "2" / "model.safetensors").write_bytes(b"half a file")
        with pytest.raises(InferenceServerException, match="the old version keeps serving"):
            http.load_model("cnn")
        rows = [(r["version"], r["state"]) for r in http.get_model_repository_index()]
        assert rows == [("1", "READY"), ("2", "UNAVAILABLE")]
        assert "safetensors" in http.get_model_repository_index()[1]["reason"]
        assert not http.is_model_ready("cnn", "2")
        np.testing.assert_allclose(_infer(http, th, "cnn", x), _run(v1, x), rtol=1e-5,
                                   atol=1e-6)
        v2 = _lenet(42)
        paraloom.save(v2, root / "cnn" / "2" / "model.safetensors")  # fixed: it loads
        http.load_model("cnn")
        assert [(r["version"], r["state"]) for r in http.get_model_repository_index()] == [
            ("2", "READY")]
        np.testing.assert_allclose(_infer(http, th, "cnn", x), _run(v2, x), rtol=1e-5,
                                   atol=1e-6)


def test_reading_the_models_directory_holds_no_other_request_up(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The index and loads read every config on the event loop: with 400 folders each index
    took 0.43 s, and every other client's inference waited for it (10 ms became 907 ms)."""
    from paraloom.serving.repository.directory import ModelsDir

    scan = ModelsDir.scan

    def slow_scan(self: ModelsDir) -> dict:
        time.sleep(2.0)  # a large directory on a slow disk
        return scan(self)

    monkeypatch.setattr(ModelsDir, "scan", slow_scan)
    base = f"http://{server.host}:{server.port}"
    grpc = tg.InferenceServerClient(server.grpc_url)
    with ThreadPoolExecutor(3) as pool:
        index = pool.submit(httpx.post, f"{base}/v2/repository/index", timeout=WAIT_S)
        load = pool.submit(grpc.load_model, "lenet")
        time.sleep(0.3)  # both are reading the directory now
        started = time.monotonic()
        assert httpx.get(f"{base}/v2/health/live", timeout=WAIT_S).status_code == 200
        answered = time.monotonic() - started
        assert {row["name"] for row in index.result(timeout=WAIT_S).json()} >= {"lenet",
                                                                               "tabular"}
        load.result(timeout=WAIT_S)
    assert answered < 1.0, f"a liveness check waited {answered:.2f} s behind the scans"
    grpc.close()
