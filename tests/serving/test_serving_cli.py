"""``paraloom serve``: building the model from its arguments, and a real server process."""

from __future__ import annotations

import argparse
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as th
from safetensors.torch import save_file
from serving_helpers import WAIT_S
from torch import nn

import paraloom
from paraloom.models import MLP, LeNet
from paraloom.serving import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def saved(path: Path, seed: int, image_size: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    model = LeNet(image_size=image_size).eval()
    paraloom.save(model, path)
    return model


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_defaults_are_safe() -> None:
    args = parse("model.safetensors")
    assert (args.host, args.port, args.workers, args.batch_limit, args.max_wait_ms) == (
        "127.0.0.1", 8000, 2, 32, 0.0)


def test_a_saved_file_is_served_and_reloadable(tmp_path: Path) -> None:
    model = saved(tmp_path / "m.safetensors", 0)
    built, reloadable = cli.build_model(parse(str(tmp_path / "m.safetensors")))
    assert same_weights(built, model) and reloadable == str(tmp_path / "m.safetensors")


def test_factory_with_paraloom_weights_uses_the_files_kwargs(tmp_path: Path) -> None:
    model = saved(tmp_path / "w.safetensors", 0)
    built, reloadable = cli.build_model(parse("--factory", "paraloom.models:LeNet", "--weights",
                                              str(tmp_path / "w.safetensors")))
    assert built.config["image_size"] == 8 and same_weights(built, model)
    assert reloadable is not None


def test_a_model_file_with_a_factory_is_its_weights_as_evaluate_takes_them(
        tmp_path: Path) -> None:
    """MODEL --factory FN was refused ("not both"), and the error loading MODEL alone said to
    pass --factory: the two messages sent the user round in a circle."""
    path = tmp_path / "m.safetensors"
    model = saved(path, 3)
    built, reloadable = cli.build_model(parse(str(path), "--factory", "paraloom.models:LeNet"))
    assert same_weights(built, model) and reloadable == str(path)


def test_factory_with_plain_safetensors_weights_is_served_but_not_reloadable(tmp_path: Path
                                                                             ) -> None:
    torch.manual_seed(0)
    model = MLP()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "plain.safetensors"))
    built, reloadable = cli.build_model(parse("--factory", "paraloom.models:MLP", "--weights",
                                              str(tmp_path / "plain.safetensors")))
    assert same_weights(built, model) and reloadable is None


@pytest.mark.parametrize(("argv", "message"), [
    ((), "nothing to serve"),
    (("a.safetensors", "--factory", "paraloom.models:LeNet", "--weights", "b.safetensors"),
     "MODEL and --weights both name the weights"),
    (("missing.safetensors", "--factory", "paraloom.models:LeNet"), "do not exist"),
    (("--factory", "paraloom.models"), "must look like 'package.module:function'"),
    (("--factory", "paraloom.models:LeNet", "--weights", "missing.safetensors"),
     "do not exist"),
    (("missing.safetensors",), "does not exist"),
])
def test_bad_arguments_exit_2_with_a_message(argv: tuple[str, ...], message: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(parse(*argv)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value"), [
    ("--max-wait-ms", "inf"), ("--max-wait-ms", "nan"), ("--max-wait-ms", "-1"),
    ("--graceful-timeout", "inf"), ("--graceful-timeout", "0"),
    ("--max-body-mb", "0"), ("--gil-switch-ms", "0"), ("--gil-switch-ms", "-1"),
    ("--gil-switch-ms", "nan"),
])
def test_a_bad_duration_or_size_is_refused_by_the_parser_naming_the_option(
        tmp_path: Path, option: str, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    saved(tmp_path / "m.safetensors", 0)
    with pytest.raises(SystemExit) as stopped:
        parse(str(tmp_path / "m.safetensors"), option, value)
    assert stopped.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_input_shape_must_be_integers(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    saved(tmp_path / "m.safetensors", 0)
    assert cli.run(parse(str(tmp_path / "m.safetensors"), "--input-shape=-1,a")) == 2
    assert "integers separated by commas" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--input-datatype=INT64", "--input-name=ids"])
def test_an_input_option_without_input_shape_is_refused_instead_of_ignored(
        tmp_path: Path, option: str) -> None:
    saved(tmp_path / "m.safetensors", 0)
    with pytest.raises(ValueError, match=f"{option.split('=')[0]} needs --input-shape"):
        cli._build_app(parse(str(tmp_path / "m.safetensors"), option))  # run() exits 2 on it
    with pytest.raises(ValueError, match="with a models directory"):
        cli._build_app(parse("--models-dir", str(tmp_path), option))


class FiveIds(nn.Module):
    """Takes rows of exactly five token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(20, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).reshape(ids.shape[0], 20))


def test_input_datatype_with_input_shape_is_served_and_a_failed_probe_says_what_to_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--factory", f"{__name__}:FiveIds", "--input-shape=-1,5",
                 "--input-datatype", "INT64", "--input-name", "ids")
    app, _ = cli._build_app(args)
    try:
        meta = app.state.repository.get("model").metadata()
        assert meta["inputs"] == [{"name": "ids", "datatype": "INT64", "shape": [-1, 5]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 2]}]
    finally:
        app.state.served.pool.close()
    # Read from the Embedding as ids of any length: the probe's 8 ids are not five.
    assert cli.run(parse("--factory", f"{__name__}:FiveIds")) == 2
    err = capsys.readouterr().err
    assert "failed on the probe input (INT64 [1, 8])" in err and "--input-shape" in err


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) * weights.unsqueeze(-1)).sum(1)


def test_a_model_with_two_inputs_is_described_by_repeated_input_options() -> None:
    args = parse("--factory", f"{__name__}:TwoInputs", "--input-shape=-1,3",
                 "--input-shape=-1,3", "--input-datatype", "INT64", "--input-datatype", "FP32",
                 "--input-name", "ids", "--input-name", "weights")
    app, _ = cli._build_app(args)
    try:
        meta = app.state.repository.get("model").metadata()
        assert meta["inputs"] == [{"name": "ids", "datatype": "INT64", "shape": [-1, 3]},
                                  {"name": "weights", "datatype": "FP32", "shape": [-1, 3]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]
    finally:
        app.state.served.pool.close()
    with pytest.raises(ValueError, match="2 --input-shape but 1 --input-name"):
        cli._input_specs(parse("--input-shape=-1,3", "--input-shape=-1,3", "--input-name", "x"))


class Process:
    """``python -m paraloom.serving.cli`` with its log lines readable with a timeout."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "paraloom.serving.cli", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def wait_for(self, pattern: str) -> re.Match[str]:
        while True:
            try:
                line = self.lines.get(timeout=WAIT_S)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} within {WAIT_S} s: {self.seen}") from None
            self.seen.append(line)
            if line == "":
                raise AssertionError(f"the server exited before {pattern!r}; log: {self.seen}")
            if (match := re.search(pattern, line)) is not None:
                return match

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(WAIT_S)
            raise


@pytest.fixture()
def process(tmp_path: Path) -> Iterator[tuple[Process, Path]]:
    path = tmp_path / "lenet.safetensors"
    saved(path, 1)
    running = Process(str(path), "--name", "lenet", "--port", "0", "--workers", "1",
                      "--log-level", "info")
    try:
        yield running, path
    finally:
        running.stop()


def infer(port: int, x: np.ndarray) -> th.InferResult:
    client = th.InferenceServerClient(url=f"127.0.0.1:{port}", connection_timeout=WAIT_S,
                                      network_timeout=WAIT_S)
    try:
        item = th.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        return client.infer("lenet", [item])
    finally:
        client.close()


def test_serve_then_reload_on_sighup_then_stop_cleanly(process: tuple[Process, Path]) -> None:
    proc, path = process
    port = int(proc.wait_for(r"paraloom serving on http://127\.0\.0\.1:(\d+)").group(1))
    x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
    with torch.no_grad():
        v1 = paraloom.load(path).eval()(torch.from_numpy(x)).numpy()
    first = infer(port, x)
    np.testing.assert_allclose(first.as_numpy("output"), v1, rtol=1e-5, atol=1e-6)

    v2_model = saved(path, 2)  # paraloom.save replaces the file atomically
    proc.proc.send_signal(signal.SIGHUP)
    proc.wait_for(r"SIGHUP: model 'lenet' now serves version 2")
    second = infer(port, x)
    assert second.get_response()["model_version"] == "2"
    with torch.no_grad():
        np.testing.assert_allclose(second.as_numpy("output"),
                                   v2_model(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-6)
    # A graceful stop is a clean exit: uvicorn raised the SIGTERM again once shutdown was done,
    # and the process died of it (exit status 143) after every request had been answered.
    assert proc.stop() == 0
    proc.wait_for("Application shutdown complete")


def test_a_taken_port_exits_2_and_stops_the_pool(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    saved(tmp_path / "m.safetensors", 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.name for t in threading.enumerate()}
        code = cli.run(parse(str(tmp_path / "m.safetensors"), "--port", str(port),
                             "--workers", "1"))
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    leaked = {t.name for t in threading.enumerate()} - before
    assert not [n for n in leaked if n.startswith("paraloom-inference")]


def _answers_as(client: object, module: object, name: str, model: nn.Module,
                x: np.ndarray) -> None:
    """Model ``name`` on the server answers ``x`` as ``model`` does here (tritonclient's
    http or grpc ``module`` and its ``client``)."""
    item = module.InferInput("input", list(x.shape), "FP32")  # type: ignore[attr-defined]
    item.set_data_from_numpy(x)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy()
    got = client.infer(name, [item]).as_numpy("output")  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_models_dir_with_grpc_port_0_serves_every_model_over_both(tmp_path: Path) -> None:
    import tritonclient.grpc as tg

    root = tmp_path / "models"
    root.mkdir()
    a = saved(root / "a.safetensors", 1)
    b = saved(root / "b.safetensors", 2)
    running = Process("--models-dir", str(root), "--port", "0", "--grpc-port", "0",
                      "--workers", "1", "--log-level", "info")
    try:
        grpc_port = int(running.wait_for(r"paraloom: gRPC on 127\.0\.0\.1:(\d+)").group(1))
        port = int(running.wait_for(r"paraloom serving on http://127\.0\.0\.1:(\d+)").group(1))
        x = np.random.default_rng(0).random((2, 1, 8, 8), dtype=np.float32)
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        for name, model in (("a", a), ("b", b)):
            _answers_as(client, tg, name, model, x)
        client.close()
        http = th.InferenceServerClient(url=f"127.0.0.1:{port}")
        assert [m["name"] for m in http.get_model_repository_index()] == ["a", "b"]
        # SIGHUP reloads the directory (it killed a models-dir server: no handler was set)
        a2, c = saved(root / "a.safetensors", 3), saved(root / "c.safetensors", 4)
        running.proc.send_signal(signal.SIGHUP)
        running.wait_for(r"SIGHUP: model 'a' now serves version 2")  # sorted by name
        running.wait_for(r"SIGHUP: model 'c' now serves version 1")  # a folder added since
        assert running.proc.poll() is None
        for name, model in (("a", a2), ("c", c)):
            _answers_as(http, th, name, model, x)
        http.close()
    finally:
        assert running.stop() == 0


def test_a_taken_grpc_port_exits_2_and_stops_the_pool(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    saved(tmp_path / "m.safetensors", 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = {t.name for t in threading.enumerate()}
        code = cli.run(parse(str(tmp_path / "m.safetensors"), "--port", "0", "--grpc-port",
                             str(port), "--workers", "1"))
    assert code == 2
    assert f"cannot listen for gRPC on 127.0.0.1:{port}" in capsys.readouterr().err
    leaked = {t.name for t in threading.enumerate()} - before
    assert not [n for n in leaked if n.startswith("paraloom-inference")]


def test_processes_share_the_ports_refuse_api_loads_and_reload_together(tmp_path: Path
                                                                        ) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as tg

    path = tmp_path / "lenet.safetensors"
    saved(path, 1)
    proc = Process(str(path), "--name", "lenet", "--port", "0", "--grpc-port", "0",
                   "--processes", "2", "--workers", "1", "--log-level", "info")
    try:
        port = int(proc.wait_for(r"2 processes serving on http://127\.0\.0\.1:(\d+)").group(1))
        grpc_port = int(proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1))
        for _ in range(2):  # both children up (each logs once it listens)
            proc.wait_for(rf"paraloom serving on http://127\.0\.0\.1:{port}")
        x = np.random.default_rng(0).random((3, 1, 8, 8), dtype=np.float32)
        with torch.no_grad():
            v1 = paraloom.load(path).eval()(torch.from_numpy(x)).numpy()
        with ThreadPoolExecutor(8) as pool:  # a fresh connection each: both processes answer
            results = list(pool.map(lambda _: infer(port, x), range(16)))
        for r in results:
            np.testing.assert_allclose(r.as_numpy("output"), v1, rtol=1e-5, atol=1e-6)
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        item = tg.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        np.testing.assert_allclose(client.infer("lenet", [item]).as_numpy("output"), v1,
                                   rtol=1e-5, atol=1e-6)
        with pytest.raises(Exception, match="--processes 1"):  # one process of two: refused
            client.load_model("lenet")
        client.close()
        refused = th.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(Exception, match="kill -HUP"):
            refused.unload_model("lenet")
        with pytest.raises(Exception, match="each with its own log settings"):
            refused.update_log_settings({"log_info": False})
        assert refused.get_log_settings()["log_info"] is True
        refused.close()

        v2_model = saved(path, 2)
        proc.proc.send_signal(signal.SIGHUP)  # the parent relays it: every process reloads
        for _ in range(2):
            proc.wait_for(r"SIGHUP: model 'lenet' now serves version 2")
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: infer(port, x), range(16)))
        with torch.no_grad():
            v2 = v2_model(torch.from_numpy(x)).numpy()
        for r in results:
            assert r.get_response()["model_version"] == "2"
            np.testing.assert_allclose(r.as_numpy("output"), v2, rtol=1e-5, atol=1e-6)
    finally:
        assert proc.stop() == 0
    proc.wait_for("Application shutdown complete")


def test_allow_handlers_is_for_a_models_directory_and_reaches_it(tmp_path: Path) -> None:
    saved(tmp_path / "m.safetensors", 0)
    with pytest.raises(ValueError, match="--allow-handlers applies to a models directory"):
        cli._build_app(parse(str(tmp_path / "m.safetensors"), "--allow-handlers"))
    with pytest.raises(ValueError, match="--allow-torchscript applies to a models directory"):
        cli._build_app(parse(str(tmp_path / "m.safetensors"), "--allow-torchscript"))
    folder = tmp_path / "repo" / "texts" / "2"
    folder.mkdir(parents=True)
    saved(folder / "model.safetensors", 0)
    (folder.parent / "handler.py").write_text(  # the model's folder: every version uses it
        'INPUTS = [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]\n'
        'OUTPUTS = [{"name": "y", "datatype": "FP32", "shape": [-1, 10]}]\n'
        'def postprocess(out):\n    return {"y": out.numpy()}\n')
    for allow, state in ((False, "UNAVAILABLE"), (True, "READY")):
        argv = ["--models-dir", str(tmp_path / "repo"), "--workers", "1"]
        app, _ = cli._build_app(parse(*argv, *(["--allow-handlers"] if allow else [])))
        try:
            (row,) = app.state.repository.index()
            assert (row["name"], row["state"]) == ("texts", state)
            if allow:
                served = app.state.repository.get("texts")
                assert served.version == "2" and served.handler is not None
                assert [s.name for s in served.signature.outputs] == ["y"]
        finally:
            for served in app.state.repository.every():
                served.pool.close(drain=False)


def test_a_factory_is_imported_from_the_current_folder_and_must_build_a_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    (tmp_path / "served_here.py").write_text(
        "from paraloom.models import MLP\n\ndef build():\n    return MLP()\n\n"
        "def number():\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".")])
    built, _ = cli.build_model(parse("--factory", "served_here:build"))
    assert isinstance(built, MLP)
    with pytest.raises(TypeError, match="returned a int; expected a torch.nn.Module"):
        cli.build_model(parse("--factory", "served_here:number"))
    with pytest.raises(ValueError, match="cannot import 'elsewhere'.*run from the folder"):
        cli.build_model(parse("--factory", "elsewhere:build"))
    assert cli.run(parse("m.safetensors", "--port", "8123", "--grpc-port", "8123")) == 2
    assert "is the HTTP --port too" in capsys.readouterr().err


def test_import_makes_a_models_directory_of_ones_own_classes_servable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_arch.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Tiny(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = nn.Linear(3, 2)\n\n"
        "    def forward(self, x):\n        return self.l(x)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_arch  # type: ignore[import-not-found]

    (tmp_path / "models").mkdir()
    paraloom.save(my_arch.Tiny(), tmp_path / "models" / "tiny.safetensors")
    monkeypatch.delitem(sys.modules, "my_arch")  # a fresh server has not imported it
    refused, _ = cli._build_app(parse("--models-dir", str(tmp_path / "models")))
    try:
        reason = {r["name"]: r["reason"] for r in refused.state.repository.index()}["tiny"]
        assert "has not imported" in reason and "--import MODULE" in reason
    finally:
        for served in refused.state.repository.every():
            served.pool.close()
    app, _ = cli._build_app(parse("--models-dir", str(tmp_path / "models"), "--import",
                                  "my_arch"))
    try:
        assert app.state.repository.get("tiny").ready
    finally:
        for served in app.state.repository.every():
            served.pool.close()
