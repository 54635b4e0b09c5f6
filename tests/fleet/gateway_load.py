"""Clients of the fleet's gateway for the fleet tests and bench/gateway.py: a steady, bounded load
of concurrent streamed chat completions, and a watcher of HAProxy's server states on the gateway
host (polled there through the runtime socket, so the times are the gateway's own).

Traffic goes only to the simulated fleet's addresses."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from freetoken_infra.core.layout import GATEWAY_BACKEND, GATEWAY_RUNTIME_SOCKET, SERVED_BY_HEADER, SESSION_HEADER

MODEL = "Qwen3.6-35B-A3B-NVFP4-nvidia"
ROOT = Path(__file__).resolve().parents[2]
PORT, STATS_PORT = 8080, 8404
ENGINE_KEY = "sim-engine-key-7f3a9c2e5b1d4a60"
CLIENT_KEY = "sim-client-key-alice-0123456789"
METRICS_KEY = "sim-metrics-key-prom-0123456789"  # /metrics and /stats only


def write_keys(directory: Path) -> dict[str, Path]:
    """The fleet's engine key, the gateway's client keys and its metrics key, as files on the
    controller (0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    engine, clients, metrics = directory / "engine.key", directory / "gateway-keys", directory / "metrics-keys"
    engine.write_text(ENGINE_KEY + "\n")
    clients.write_text(f"# the simulated fleet's clients\n{CLIENT_KEY} alice\n")
    metrics.write_text(f"{METRICS_KEY} prometheus\n")
    for f in (engine, clients, metrics):
        f.chmod(0o600)
    return {"engine": engine, "clients": clients, "metrics": metrics}


# The shared gateway fleet's settings beyond the keys (tests/fleet/conftest.py, `gateway_fleet`):
# the owner's signals quick (test_owner.py, test_agent_metrics.py), and alerting on the gateway
# host with scrapes and evaluations every 2 s and a short `for` for a host down (test_alerts.py);
# the other alerts' `for`s long, so that a host's boot (its engine loading: HAProxy DOWN) or a
# load test's queue raises nothing the alert tests would see.
OWNER_QUIET_S = 5
OWNER_APP = "eldenring.exe"
OWNER_WINDOWS_INTERVAL_S = 1
ALERT_HOST_DOWN_FOR_S = 20
SHARED_SETTINGS = (
    f"owner_quiet_s={OWNER_QUIET_S}",
    f'owner_apps=["{OWNER_APP}"]',
    f"owner_windows_interval_s={OWNER_WINDOWS_INTERVAL_S}",
    "alerting_enabled=true",
    "alert_evaluation_interval_s=2",
    f"alert_host_down_for_s={ALERT_HOST_DOWN_FOR_S}",
    "alert_out_of_service_for_s=1800",
    "alert_queue_for_s=1800",
)


def data_args(keys: dict[str, Path], shared: bool = True) -> list[str]:
    """The settings of a fleet behind a gateway: engines on every address, one engine key; with
    ``shared``, the shared gateway fleet's settings too (every run in its modules uses them, so
    that a module's re-run converges to what the next module expects)."""
    settings = [
        "listen_host=0.0.0.0",
        f"api_key_source=file:{keys['engine']}",
        f"gateway_keys_source=file:{keys['clients']}",
        f"gateway_metrics_keys_source=file:{keys['metrics']}",
        *(SHARED_SETTINGS if shared else ()),
    ]
    return [a for setting in settings for a in ("--data", setting)]


def pyinfra(*args: str, timeout: int = 1500, quiet: bool = False) -> subprocess.CompletedProcess:
    """The pyinfra CLI on the simulated fleet's inventory, as a user runs it."""
    from tests.fleet import harness

    run = subprocess.run(
        [str(Path(sys.executable).with_name("pyinfra")), "-y", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    if not quiet or run.returncode != 0:
        print(run.stdout[-12000:], run.stderr[-6000:], sep="\n")
    return run


def converge_behind_gateway(
    keys: dict[str, Path], extra: Sequence[str] = (), shared: bool = True
) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """ws1 and ws2 with their engines on every address and the fleet's key, then the gateway;
    `extra`: more pyinfra arguments for the workstations' run; `shared`: see ``data_args``."""
    args = data_args(keys, shared)
    hosts = pyinfra(*args, *extra, "inventories/sim.py", "deploys/freetoken.py", "--limit", "ws1", "--limit", "ws2")
    gateway = pyinfra(*args, "inventories/sim.py", "deploys/gateway.py", "--limit", "gateway")
    return hosts, gateway


@dataclass
class Outcome:
    """One request: `started` once the gateway answered 200 (the stream began)."""

    t0: float
    t1: float = 0.0
    started: bool = False
    ok: bool = False
    host: str | None = None
    error: str = ""


def stream_chat(
    address: str, port: int, key: str, max_tokens: int = 12, session: str | None = None, timeout: float = 60
) -> Outcome:
    """One streamed chat completion through the gateway."""
    out = Outcome(time.time())
    body = json.dumps(
        {"model": MODEL, "stream": True, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}
    )
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if session:
        headers[SESSION_HEADER] = session
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        resp = conn.getresponse()
        out.host = resp.getheader(SERVED_BY_HEADER)
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:200]!r}"
            return out
        out.started = True
        while True:
            line = resp.readline()
            if not line:
                out.error = "stream cut before [DONE]"
                return out
            if line.strip() == b"data: [DONE]":
                out.ok = True
                return out
    except (OSError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        out.t1 = time.time()
        conn.close()


def openai_chat(
    address: str, port: int, key: str, max_tokens: int = 12, session: str | None = None, stream: bool = True
) -> Outcome:
    """One chat completion through the gateway with the `openai` Python client, as users call it
    (streamed or plain). Its own retries are off (max_retries=0): what fails here failed at the
    gateway. `started`: the gateway answered 200 (a stream's first event, or the whole reply)."""
    import openai

    out = Outcome(time.time())
    client = openai.OpenAI(
        base_url=f"http://{address}:{port}/v1",
        api_key=key,
        max_retries=0,
        timeout=120,
        http_client=openai.DefaultHttpxClient(trust_env=False),  # the simulated LAN: no proxy
    )
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=max_tokens,
            stream=stream,
            extra_headers={SESSION_HEADER: session} if session else None,
        )
        out.host = raw.headers.get(SERVED_BY_HEADER)
        out.started = True
        reply = raw.parse()
        if stream:
            finished = [c.choices[0].finish_reason for c in reply if c.choices and c.choices[0].finish_reason]
            out.ok = bool(finished)
            out.error = "" if out.ok else "stream ended without a finish_reason"
        else:
            out.ok = bool(reply.choices and reply.choices[0].message.content is not None)
    except openai.APIStatusError as exc:
        out.host = exc.response.headers.get(SERVED_BY_HEADER)
        wait = exc.response.headers.get("retry-after")
        out.error = (
            f"HTTP {exc.status_code}" + (f" (Retry-After {wait})" if wait else "") + f": {exc.response.text[:200]}"
        )
    except openai.APIError as exc:  # connection errors, a stream cut mid-way
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        out.t1 = time.time()
        client.close()
    return out


def session_on(host: str, address: str, port: int, key: str, tries: int = 64) -> str:
    """A session name the gateway keeps on `host` (its affinity bucket there), found by asking."""
    for i in range(tries):
        name = f"conversation-{i}"
        if stream_chat(address, port, key, max_tokens=2, session=name).host == host:
            return name
    raise AssertionError(f"no session of {tries} landed on {host}")


class Load:
    """`clients` threads sending streamed chat completions back to back until stop(), at most
    `max_requests` in all and for at most `max_seconds` (bounded in count and time). Client i
    sends the session header `sessions[i]` (its turns go to one host), the others none (the
    least busy host). `client` "openai": the `openai` Python client, streamed and plain turns
    alternating (openai_chat); "http": streamed, on http.client (stream_chat)."""

    def __init__(
        self,
        address: str,
        port: int,
        key: str,
        clients: int = 4,
        max_tokens: int = 12,
        max_requests: int = 5000,
        max_seconds: float = 900,
        sessions: Sequence[str] = (),
        client: str = "http",
    ):
        self.address, self.port, self.key, self.client = address, port, key, client
        self.clients, self.max_tokens, self.sessions = clients, max_tokens, list(sessions)
        self.max_requests, self.deadline = max_requests, time.time() + max_seconds
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        turn = 0
        while not self._stop.is_set() and time.time() < self.deadline:
            with self._lock:
                if len(self.outcomes) >= self.max_requests:
                    return
            session = self.sessions[i] if i < len(self.sessions) else None
            if self.client == "openai":
                o = openai_chat(self.address, self.port, self.key, self.max_tokens, session, stream=turn % 2 == 0)
            else:
                o = stream_chat(self.address, self.port, self.key, self.max_tokens, session=session)
            turn += 1
            with self._lock:
                self.outcomes.append(o)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        return self.outcomes

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)


def summary(outcomes: list[Outcome]) -> dict:
    by_host: dict[str, int] = {}
    for o in outcomes:
        if o.ok:
            by_host[o.host or "?"] = by_host.get(o.host or "?", 0) + 1
    return {
        "requests": len(outcomes),
        "ok": sum(o.ok for o in outcomes),
        "failed_before_streaming": [o.error for o in outcomes if not o.started],
        "failed_while_streaming": [o.error for o in outcomes if o.started and not o.ok],
        "by_host": by_host,
    }


# Runs on the gateway host: prints one JSON line per change of a server's status, with the time.
WATCH_SCRIPT = rf"""
import csv, io, json, socket, sys, time
seen = {{}}
while True:
    s = socket.socket(socket.AF_UNIX)
    s.connect({GATEWAY_RUNTIME_SOCKET!r})
    s.sendall(b"show stat\n")
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    text = data.decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    for r in rows:
        if r["pxname"] == {GATEWAY_BACKEND!r} and r["svname"] not in ("BACKEND", "FRONTEND"):
            if seen.get(r["svname"]) != r["status"]:
                seen[r["svname"]] = r["status"]
                print(json.dumps({{"t": time.time(), "host": r["svname"], "status": r["status"],
                                  "check": r["check_status"]}}), flush=True)
    time.sleep(0.05)
"""


@dataclass
class Watcher:
    """HAProxy's server status changes on the gateway host, timestamped there (every 50 ms)."""

    ssh_argv: list[str]
    events: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._proc = subprocess.Popen(
            self.ssh_argv + ["python3", "-u", "-c", shlex.quote(WATCH_SCRIPT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self.events.append(event)

    def status(self, host: str) -> str | None:
        with self._lock:
            last = [e for e in self.events if e["host"] == host]
        return last[-1]["status"] if last else None

    def wait_for(self, host: str, predicate, since: float, timeout: float) -> float | None:
        """The gateway's time of the first change of `host` after `since` whose status matches,
        or None after `timeout`."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self._lock:
                hits = [e for e in self.events if e["host"] == host and e["t"] >= since and predicate(e["status"])]
            if hits:
                return hits[0]["t"]
            time.sleep(0.1)
        return None

    def close(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
