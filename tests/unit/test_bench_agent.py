"""bench/agent.py's parsing of /proc (the bench itself needs the simulated fleet)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "bench_agent", Path(__file__).resolve().parents[2] / "bench" / "agent.py"
)
assert _SPEC is not None and _SPEC.loader is not None
bench_agent = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_agent)

STATUS = "Name:\tpython3\nState:\tS (sleeping)\nVmPeak:\t   40000 kB\nVmRSS:\t   18236 kB\nRssAnon:\t    9000 kB\n"


def test_rss_is_vmrss_in_kib():
    assert bench_agent.rss_kib(STATUS) == 18236
    assert bench_agent.rss_kib("Name:\tkthreadd\n") is None  # a kernel thread has none
    assert bench_agent.rss_kib("VmRSS:\t12 MB\n") is None


def test_the_rate_is_per_second_of_each_host_read_twice():
    assert bench_agent.rate({"ws1": 1.0, "ws2": 2.0}, {"ws1": 1.3, "ws3": 5.0}, 60.0) == {
        "ws1": pytest.approx(0.3 / 60)
    }
    assert bench_agent.rate({"ws1": 1.0}, {"ws1": 2.0}, 0.0) == {}
