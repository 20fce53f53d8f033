"""The serving benchmark's pure parts (the benchmark itself is not part of the test suite)."""

from __future__ import annotations

import pytest

from paraloom.bench.serving import _parse_wrk

WRK = """Running 15s test @ http://127.0.0.1:40001/v2/models/lenet/infer
  2 threads and 64 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    30.12ms   20.01ms 400.00ms   90.00%
    Req/Sec     1.09k   200.00     1.50k    70.00%
  Latency Distribution
     50%   25.99ms
     75%   31.99ms
     90%   48.86ms
     99%  116.85ms
  32506 requests in 15.02s, 10.00MB read
  Socket errors: connect 0, read 0, write 0, timeout 3
  Non-2xx or 3xx responses: 5
Requests/sec:   2164.88
Transfer/sec:    681.00KB
"""


def test_wrk_output_is_read_into_numbers() -> None:
    assert _parse_wrk(WRK) == {
        "requests_per_s": 2164.88, "requests": 32506, "p50_ms": 25.99, "p75_ms": 31.99,
        "p90_ms": 48.86, "p99_ms": 116.85, "non_2xx": 5,
        "socket_errors": "connect 0, read 0, write 0, timeout 3"}


def test_latency_units_are_converted_to_ms() -> None:
    text = WRK.replace("25.99ms", "850.00us").replace("116.85ms", "1.20s")
    parsed = _parse_wrk(text)
    assert parsed["p50_ms"] == pytest.approx(0.85) and parsed["p99_ms"] == pytest.approx(1200.0)


def test_unreadable_output_says_so() -> None:
    with pytest.raises(ValueError, match="cannot read wrk's output"):
        _parse_wrk("wrk: connection refused")
