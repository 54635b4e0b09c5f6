"""A real Prometheus (Debian's ``prometheus`` and ``promtool``) holding a known load, without
the fleet: the series a fleet's gateway Prometheus would hold (the host agent's textfile
samples under job ``freetoken-guard`` with ``host=``, HAProxy's exporter under
``freetoken-gateway``), written as OpenMetrics text, backfilled with ``promtool tsdb
create-blocks-from openmetrics``, and served read-only by ``prometheus`` on a free loopback port.

The load is a list of ``Phase``s per host; ``expected`` derives the ledger's figures from the
same phases (durations times rates), not from the samples, so a test compares two different
roads to the same figure. The metric names are the shared contract the host agent writes
(``freetoken_agent_*``, ``freetoken_engine_*_total``, ``freetoken_gpu_*``,
``freetoken_firewall_table_loaded``) and HAProxy's built-in exporter's
(``haproxy/haproxy`` ``addons/promex/README``: ``haproxy_backend_current_queue``,
``haproxy_server_current_queue``, ``haproxy_backend_active_servers``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from freetoken_infra.core.owner import MODES
from freetoken_infra.ledger import AGENT_SILENT_S, GUARD_JOB, REASONS

SCRAPE_S = 15  # the simulated scrape interval
STEP_S = 60  # the ledger's grid in the tests
HOUR = 3600
SPAN_S = 6 * HOUR
GATEWAY_JOB = "freetoken-gateway"
INSTALL = "Debian's 'prometheus' package (apt-get install prometheus: /usr/bin/prometheus and /usr/bin/promtool)"


@dataclass(frozen=True)
class Phase:
    """[start, end) seconds after t0 of one host's life. ``up`` False: node_exporter does not
    answer (no other series). ``agent`` False: the agent died, its textfile stays as it was when
    the phase began (node_exporter keeps serving it). ``tok_s``/``req_s``: what the engine
    serves (its counters restart from 0 when a run of serving follows a phase without engine)."""

    start: int
    end: int
    mode: str | None = "serving"
    reason: str | None = None
    watts: float = 0.0
    tok_s: float = 0.0
    req_s: float = 0.0
    up: bool = True
    agent: bool = True
    engine: bool = True  # the engine answers: its counters are written


H = HOUR
LOAD: dict[str, list[Phase]] = {
    # Serving 3 h at 200 W, a game for 1 h, asleep 1 h, serving 1 h (the engine restarted).
    "ws1": [
        Phase(0, 3 * H, "serving", watts=200, tok_s=10, req_s=0.1),
        Phase(3 * H, 4 * H, "yielded", reason="game", watts=120, engine=False),
        Phase(4 * H, 5 * H, None, up=False),
        Phase(5 * H, SPAN_S + SCRAPE_S, "serving", watts=200, tok_s=10, req_s=0.1),
    ],
    # Serving 2 h at 250 W, down 30 min while it should serve, starting 5 min, serving with a
    # 20 min silent agent inside and a pending reboot's hold for 30 min.
    "ws2": [
        Phase(0, 2 * H, "serving", watts=250, tok_s=20, req_s=0.2),
        Phase(2 * H, 2 * H + 1800, None, up=False),
        Phase(2 * H + 1800, 2 * H + 2100, "starting", watts=80, engine=False),
        Phase(2 * H + 2100, 4 * H, "serving", watts=250, tok_s=20, req_s=0.2),
        Phase(4 * H, 4 * H + 1200, "serving", watts=250, tok_s=20, req_s=0.2, agent=False),
        Phase(4 * H + 1200, 5 * H, "serving", watts=250, tok_s=20, req_s=0.2),
        Phase(5 * H, 5 * H + 1800, "held", reason="reboot_pending", watts=250),
        Phase(5 * H + 1800, SPAN_S + SCRAPE_S, "serving", watts=250, tok_s=20, req_s=0.2),
    ],
    # node_exporter answers, no host agent on it.
    "ws3": [Phase(0, SPAN_S + SCRAPE_S, None)],
}
SIGNALS = ("gpu", "interop", "tasklist", "idle", "full_screen", "schedule")


@dataclass
class Expected:
    seen_h: float
    modes_h: dict[str, float]
    reasons_h: dict[str, float]
    asleep_h: float
    down_h: float
    silent_h: float
    tokens: float
    requests: float
    wh_serving: float
    wh_all: float
    transitions: int  # phase boundaries: each may move a figure by one step
    runs: int  # runs of the engine's counters: each loses up to one scrape's worth


def expected(host: str) -> Expected:
    """The ledger's figures for ``host`` over [t0, t0 + SPAN_S], from its phases alone."""
    phases = LOAD[host]
    e = Expected(SPAN_S / H, dict.fromkeys(MODES, 0.0), {}, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, len(phases), 0)
    last_mode = None
    engine_before = False
    for p in phases:
        d = min(p.end, SPAN_S) - p.start
        if not p.up:
            if last_mode in ("yielded", "held"):
                e.asleep_h += d / H
            else:
                e.down_h += d / H
            engine_before = False
            continue
        if p.mode is not None:
            live = d if p.agent else min(d, AGENT_SILENT_S)
            e.modes_h[p.mode] += live / H
            e.silent_h += (d - live) / H
            if p.reason:
                e.reasons_h[p.reason] = e.reasons_h.get(p.reason, 0.0) + live / H
            if p.mode == "serving":
                e.wh_serving += p.watts * live / H
            e.wh_all += p.watts * d / H
            last_mode = p.mode
        e.tokens += p.tok_s * d
        e.requests += p.req_s * d
        if p.engine and p.mode is not None and not engine_before:
            e.runs += 1
        engine_before = p.engine and p.mode is not None
    return e


def _samples(host: str, t0: int) -> dict[str, list[tuple[str, float, int]]]:
    """Per metric name: (labels, value, time) of every scrape of ``host``."""
    out: dict[str, list[tuple[str, float, int]]] = {}

    def add(name: str, labels: str, value: float, t: int) -> None:
        out.setdefault(name, []).append((labels, value, t))

    base = f'job="{GUARD_JOB}",instance="{host}:9100",host="{host}"'
    tokens = requests_ = 0.0
    engine_running = False
    frozen: dict[str, float] | None = None
    for p in LOAD[host]:
        for off in range(p.start, p.end, SCRAPE_S):
            t = t0 + off
            if off > SPAN_S:
                break
            add("up", base, 1 if p.up else 0, t)
            if not p.up or p.mode is None:
                engine_running = False
                continue
            engine = p.engine
            if engine and not engine_running:
                tokens = requests_ = 0.0  # a new engine process: its counters start again
            engine_running = engine
            # What the agent writes at this scrape (or wrote before it died).
            written = {"loop": float(t), "tokens": tokens, "requests": requests_, "watts": p.watts}
            if not p.agent:
                frozen = frozen or written
                written = frozen
            else:
                frozen = None
            for m in MODES:
                add("freetoken_agent_mode", f'{base},mode="{m}"', 1 if m == p.mode else 0, t)
            for r in REASONS:
                add("freetoken_agent_yield_reason", f'{base},reason="{r}"', 1 if r == p.reason else 0, t)
            for s in SIGNALS:
                add("freetoken_agent_signal_up", f'{base},signal="{s}"', 1, t)
            add("freetoken_agent_last_loop_timestamp_seconds", base, written["loop"], t)
            add("freetoken_gpu_power_watts", base, written["watts"], t)
            add("freetoken_gpu_memory_used_bytes", base, 20 * 2**30, t)
            add("freetoken_gpu_memory_total_bytes", base, 32 * 2**30, t)
            add("freetoken_firewall_table_loaded", base, 1, t)
            if engine:
                add("freetoken_engine_generated_tokens_total", base, written["tokens"], t)
                add("freetoken_engine_requests_total", base, written["requests"], t)
            tokens += p.tok_s * SCRAPE_S
            requests_ += p.req_s * SCRAPE_S
    return out


def _gateway_samples(t0: int) -> dict[str, list[tuple[str, float, int]]]:
    out: dict[str, list[tuple[str, float, int]]] = {}
    base = f'job="{GATEWAY_JOB}",instance="gateway:8405",proxy="freetoken"'
    for off in range(0, SPAN_S + 1, SCRAPE_S):
        t = t0 + off
        queue = (off // 600) % 4  # a queue that comes and goes
        out.setdefault("up", []).append((f'job="{GATEWAY_JOB}",instance="gateway:8405"', 1, t))
        out.setdefault("haproxy_backend_current_queue", []).append((base, queue, t))
        out.setdefault("haproxy_backend_active_servers", []).append((base, 2, t))
        for server in ("ws1", "ws2"):
            out.setdefault("haproxy_server_current_queue", []).append((f'{base},server="{server}"', 0, t))
    return out


def openmetrics(t0: int) -> str:
    """The whole load as OpenMetrics text: each metric family's samples together, each series in
    time order, ``# EOF`` last."""
    families: dict[str, list[tuple[str, float, int]]] = {}
    for part in [_samples(h, t0) for h in LOAD] + [_gateway_samples(t0)]:
        for name, samples in part.items():
            families.setdefault(name, []).extend(samples)
    lines = []
    for name, samples in families.items():
        lines.append(
            f"# TYPE {name} gauge" if not name.endswith("_total") else f"# TYPE {name[: -len('_total')]} counter"
        )
        series: dict[str, list[tuple[float, int]]] = {}
        for labels, value, t in samples:
            series.setdefault(labels, []).append((value, t))
        for labels, points in series.items():
            lines += [f"{name}{{{labels}}} {value!r} {t}" for value, t in sorted(points, key=lambda p: p[1])]
    return "\n".join(lines) + "\n# EOF\n"


@dataclass(frozen=True)
class LoadedPrometheus:
    url: str
    t0: int  # the load's start (a whole hour: on the ledger's grid)
    end: int  # t0 + SPAN_S: the ledger's window is [t0, end]


def _tool(name: str, path: str | None = None) -> str:
    """The tool's path on ``path`` (default $PATH); a failed test naming the package when absent."""
    found = shutil.which(name, path=path)
    if not found:
        pytest.fail(f"{name} is not installed: these tests need {INSTALL}", pytrace=False)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(tmp: Path) -> Iterator[LoadedPrometheus]:
    promtool, prometheus = _tool("promtool"), _tool("prometheus")
    # Whole hours, well inside the default retention (15 d) and ended before now.
    t0 = (int(time.time()) // HOUR) * HOUR - SPAN_S - 2 * HOUR
    source, data = tmp / "load.om", tmp / "data"
    source.write_text(openmetrics(t0))
    made = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, f"promtool could not backfill the load: {made.stderr[-2000:]}"
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 15s\nscrape_configs: []\n")
    port = _free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=30d",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise AssertionError(
                    f"prometheus exited ({proc.returncode}): {(tmp / 'prometheus.log').read_text()[-2000:]}"
                )
            try:
                if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready in 120 s: {(tmp / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield LoadedPrometheus(url, t0, t0 + SPAN_S)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def loaded_prometheus(tmp_path_factory) -> Iterator[LoadedPrometheus]:
    """Debian's Prometheus serving the known load (LOAD), for the module."""
    yield from start_prometheus(tmp_path_factory.mktemp("prometheus"))
