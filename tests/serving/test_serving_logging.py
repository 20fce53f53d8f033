"""Triton's logging extension: ``GET/POST /v2/logging`` and gRPC ``LogSettings``, with
tritonclient's own ``get_log_settings`` and ``update_log_settings`` on both gRPC back ends,
the settings' effect on the records written, and ``paraloom serve --log-file``."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serving_helpers import WAIT_S, Client, closing
from test_serving_cli import Process, infer, saved
from torch import nn
from tritonclient.utils import InferenceServerException

from paraloom.serving import ServerThread, TensorSpec, create_app
from paraloom.serving.errors import ForbiddenError, ProtocolError
from paraloom.serving.log_settings import SERVER_LOG, SERVER_LOGGERS, LogSettings

_DEFAULTS = {"log_file": "", "log_info": True, "log_warnings": True, "log_errors": True,
             "log_verbose_level": 0, "log_format": "default"}


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Every test leaves the process's loggers as it found them."""
    levels = {name: logging.getLogger(name).level for name in SERVER_LOGGERS}
    for name in SERVER_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    yield
    SERVER_LOG.reset()
    SERVER_LOG.refuse_changes = None
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="module", params=["uvicorn", "grpcio"])
def server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    torch.manual_seed(0)
    app = create_app(nn.Linear(4, 2), name="m", workers=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 4))])
    with ServerThread(app, grpc_port=0, grpc_backend=str(request.param)) as s:
        yield s


def _written(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "paraloom.serving"]


def test_settings_are_checked_by_name_type_and_range() -> None:
    settings = LogSettings()
    assert settings.as_wire() == _DEFAULTS
    assert settings.changed({"log_verbose_level": 2, "log_info": False}).as_wire() == {
        **_DEFAULTS, "log_verbose_level": 2, "log_info": False}
    bad = [({"log_level": 1}, r"unknown log settings \['log_level'\].*'log_errors'"),
           ({"log_info": "false"}, "log_info='false'; expected true or false"),
           ({"log_errors": 1}, "log_errors=1; expected true or false"),
           ({"log_verbose_level": True}, "log_verbose_level=True; expected a whole number"),
           ({"log_verbose_level": -1}, "log_verbose_level=-1"),
           ({"log_verbose_level": 1 << 32}, "log_verbose_level=4294967296"),
           ({"log_verbose_level": 1.5}, "log_verbose_level=1.5"),
           ({"log_format": "json"}, r"log_format='json'; expected one of \['default', 'ISO8601'"),
           ({"log_file": 3}, "log_file=3; expected a string")]
    for changes, message in bad:
        with pytest.raises(ProtocolError, match=message):
            settings.changed(changes)
    assert settings.changed({"log_file": ""}) == settings  # the file in force may be named
    with pytest.raises(ForbiddenError, match="--log-file PATH"):
        settings.changed({"log_file": "/tmp/elsewhere.log"})


def test_the_settings_decide_which_records_are_written(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    log = logging.getLogger("paraloom.serving")
    caplog.set_level(logging.DEBUG)
    log.setLevel(logging.WARNING)  # as paraloom serve --log-level warning leaves it
    assert SERVER_LOG.settings().as_wire() == {**_DEFAULTS, "log_info": False}
    SERVER_LOG.update({"log_info": True, "log_warnings": False, "log_verbose_level": 1})
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        log.log(level, "record at %d", level)
    assert _written(caplog) == [(logging.DEBUG, "record at 10"), (logging.INFO, "record at 20"),
                                (logging.ERROR, "record at 40")]
    caplog.clear()
    SERVER_LOG.update({"log_errors": False, "log_verbose_level": None})  # None: unchanged
    assert SERVER_LOG.settings().log_verbose_level == 1
    log.error("dropped")
    log.info("kept")
    assert _written(caplog) == [(logging.INFO, "kept")]
    SERVER_LOG.reset()
    assert log.level == logging.WARNING and not log.filters
    assert SERVER_LOG.settings().as_wire() == {**_DEFAULTS, "log_info": False}


def test_log_format_is_refused_without_a_handler_of_the_servers_own() -> None:
    with pytest.raises(ForbiddenError, match="your logging configuration's formatters"):
        SERVER_LOG.update({"log_format": "ISO8601"})
    assert SERVER_LOG.settings().log_format == "default"
    assert SERVER_LOG.update({"log_format": "default"}).log_format == "default"


def test_tritonclient_reads_and_changes_the_settings_over_http_and_grpc(
        server: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = tg.InferenceServerClient(server.grpc_url)
    assert "logging" in http.get_server_metadata()["extensions"]
    assert http.get_log_settings() == _DEFAULTS
    got = grpc.get_log_settings(as_json=True)["settings"]  # each a {"bool_param": ...}
    assert {k: next(iter(v.values())) for k, v in got.items()} == _DEFAULTS
    caplog.set_level(logging.DEBUG, logger="paraloom.serving")

    changed = grpc.update_log_settings({"log_verbose_level": 1, "log_warnings": False})
    assert changed.settings["log_verbose_level"].uint32_param == 1
    assert changed.settings["log_warnings"].bool_param is False
    assert changed.settings["log_format"].string_param == "default"
    assert http.get_log_settings() == {**_DEFAULTS, "log_verbose_level": 1,
                                       "log_warnings": False}
    x = np.ones((1, 4), dtype=np.float32)
    item = th.InferInput("input", [1, 4], "FP32")
    item.set_data_from_numpy(x)
    http.infer("m", [item], request_id="req-7")
    answered = [m for _, m in _written(caplog) if "answered request" in m]
    assert answered and "'req-7'" in answered[-1], _written(caplog)

    assert http.update_log_settings({"log_verbose_level": 0}) == {
        **_DEFAULTS, "log_warnings": False}
    caplog.clear()
    http.infer("m", [item], request_id="req-8")
    assert not [m for _, m in _written(caplog) if "req-8" in m]
    http.close()
    grpc.close()


def test_a_bad_change_is_that_requests_error_and_changes_nothing(server: ServerThread) -> None:
    http = th.InferenceServerClient(server.url.removeprefix("http://"))
    grpc = tg.InferenceServerClient(server.grpc_url)
    for client, bad_request, forbidden in [(http, "400", "403"),
                                           (grpc, "StatusCode.INVALID_ARGUMENT",
                                            "StatusCode.PERMISSION_DENIED")]:
        with pytest.raises(InferenceServerException, match="unknown log settings") as e:
            client.update_log_settings({"log_colour": True})
        assert e.value.status() == bad_request
        with pytest.raises(InferenceServerException, match="a client may not choose") as e:
            client.update_log_settings({"log_file": "/tmp/x.log", "log_info": False})
        assert e.value.status() == forbidden
        with pytest.raises(InferenceServerException, match="log_format"):
            client.update_log_settings({"log_format": "ISO8601"})
    assert http.get_log_settings() == _DEFAULTS
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as raw:
        for body, message in [(b"[1]", "must be an object"), (b"{", "not valid JSON")]:
            answer = raw.post("/v2/logging", content=body)
            assert answer.status_code == 400 and message in answer.json()["error"]
        assert raw.put("/v2/logging").status_code == 405
    assert http.is_server_ready()
    http.close()
    grpc.close()


_VALUES = st.none() | st.booleans() | st.integers(-5, 1 << 33) | \
    st.floats(allow_nan=False, allow_infinity=False) | \
    st.sampled_from(["default", "ISO8601", "", "x"]) | st.lists(st.integers(), max_size=2)
_NAMES = st.sampled_from([*_DEFAULTS, "log_level", ""]) | st.text(max_size=8)


def test_any_json_object_is_applied_whole_or_refused_whole() -> None:
    app = create_app(nn.Linear(4, 2), name="m", workers=1,
                     inputs=[TensorSpec("input", "FP32", (-1, 4))])
    client = Client(app)

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.dictionaries(_NAMES, _VALUES, max_size=4))
    def check(changes: dict[str, object]) -> None:
        before = client.get("/v2/logging").json()
        answer = client.post("/v2/logging", json=changes)
        after = client.get("/v2/logging").json()
        assert answer.status_code in (200, 400, 403), answer.text
        if answer.status_code == 200:
            wanted = {k: v for k, v in changes.items() if v is not None}
            assert answer.json() == after == {**before, **wanted}
        else:
            assert after == before and answer.json()["error"]
        assert set(after) == set(_DEFAULTS)

    try:
        check()
    finally:
        client.close()
        closing(app)


def test_serve_log_file_takes_uvicorns_records_and_log_format_sets_their_format(
        tmp_path: Path) -> None:
    path, log_file = tmp_path / "lenet.safetensors", tmp_path / "server.log"
    saved(path, 1)
    proc = Process(str(path), "--name", "lenet", "--port", "0", "--workers", "1",
                   "--log-file", str(log_file))
    try:
        port = _port_from(log_file)
        http = th.InferenceServerClient(f"127.0.0.1:{port}")
        assert http.get_log_settings()["log_file"] == str(log_file)
        assert http.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        http.load_model("lenet")  # logs "model 'lenet' now serves version 1"
        infer(port, np.zeros((1, 1, 8, 8), dtype=np.float32))
        http.close()
    finally:
        assert proc.stop() == 0
    text = log_file.read_text()
    assert "INFO: Application startup complete" in text  # uvicorn's, in the server's format
    assert "Application shutdown complete" in text
    stamped = re.search(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO: model 'lenet' now "
                        r"serves version 1$", text, re.MULTILINE)
    assert stamped, text
    console = []
    while (line := proc.lines.get(timeout=WAIT_S)) != "":  # "": the end of its output
        console.append(line)
    assert console == [], console


def _port_from(log_file: Path) -> int:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if log_file.exists():
            found = re.search(r"paraloom serving on http://127\.0\.0\.1:(\d+)",
                              log_file.read_text())
            if found:
                return int(found.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no port in {log_file} within {WAIT_S} s")
