"""Secrets go nowhere else, each boundary attacked for real on this machine:

- an ``http_proxy`` on loopback (a working forwarding proxy that records what it relays) must
  see nothing of the health gate or the health fact, which talk to the engine stand-in;
- the engine's unit reads its key file without ``-``: a missing key file stops the start;
- ``pip_index_url`` credentials live in a root 0600 ``pip.conf``, never in an argument;
- the learned fact-request list never stores ``_stdin``, ``_env``, passwords or a path given
  for one run with ``--data``.
(The deleted key file on a real host: tests/fleet/test_trust_state.py.)
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from facts import batch
from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.layout import ENGINE_COMPLETE_MARKER
from freetoken_infra.core.settings import Settings
from tests.unit.fakehost import FakeHost
from tests.unit.test_health_gate import KEY, MODEL_NAME, SCRIPT, StandinEngine

PROXY_VARS = (
    "http_proxy",
    "HTTP_PROXY",
    "https_proxy",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
    "no_proxy",
    "NO_PROXY",
)


class RecordingProxy:
    """A plain HTTP forward proxy on loopback (absolute-form request lines, as urllib sends
    them to a proxy): it relays each request to its origin and records the request line and
    headers it saw, so a leak is both recorded and functional (the client would not notice)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                seen.append(
                    {
                        "line": self.requestline,
                        "headers": dict(self.headers.items()),
                        "body": (body or b"").decode("utf-8", "replace"),
                    }
                )
                url = urllib.parse.urlsplit(self.path)
                upstream = http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-connection", "connection")}
                upstream.request(
                    self.command, url.path + (f"?{url.query}" if url.query else ""), body=body, headers=headers
                )
                resp = upstream.getresponse()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.end_headers()
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    self.wfile.flush()
                upstream.close()

            do_GET = do_POST = _relay

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """This process's environment with every proxy variable pointing at this proxy and no
        exception for loopback (what a workstation behind a corporate proxy may well have)."""
        env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS and k != "FREETOKEN_API_KEY"}
        env.update({"http_proxy": self.url, "HTTP_PROXY": self.url, "all_proxy": self.url})
        return env

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def proxy() -> Iterator[RecordingProxy]:
    p = RecordingProxy()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model_dir) -> Iterator[StandinEngine]:
    e = StandinEngine(tmp_path_factory.mktemp("engine"), model_dir, load_seconds=0.2)
    e.wait_bound()
    yield e
    e.stop()


def test_the_proxy_relays_what_goes_through_it(proxy, engine):
    """The stand-in proxy is a real one: a client that honours http_proxy reaches the engine
    through it, and it records what it relayed."""
    code = (
        "import urllib.request,sys;print(urllib.request.urlopen(sys.argv[1] + '/health', timeout=10).read().decode())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, engine.url], env=proxy.env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "status" in json.loads(out.stdout)
    assert [s["line"] for s in proxy.seen] == [f"GET {engine.url}/health HTTP/1.1"]


def test_the_health_gate_never_talks_through_http_proxy(proxy, engine, tmp_path):
    key_file = tmp_path / "api.env"
    key_file.write_text(f"FREETOKEN_API_KEY={KEY}\n")
    key_file.chmod(0o600)
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--url",
            engine.url,
            "--timeout",
            "60",
            "--model",
            MODEL_NAME,
            "--key-file",
            str(key_file),
            "--max-tokens",
            "4",
        ],
        env=proxy.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["ok"], run.stdout + run.stderr
    assert proxy.seen == []  # not /health, not the chats, not the key


def test_the_health_fact_never_talks_through_http_proxy(proxy, engine):
    from facts.engine import EngineHealth

    fact = EngineHealth()
    url = urllib.parse.urlsplit(engine.url)
    out = subprocess.run(
        ["sh", "-c", fact.command(url.hostname or "", url.port or 0)],
        env=proxy.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fact.process(out.stdout.splitlines()).reachable
    assert proxy.seen == []


# --------------------------------------------------------------------------- the key file


def test_a_missing_key_file_stops_the_engines_start():
    from operations.service import engine_unit

    s = Settings()
    lines = engine_unit(s, derive_plan(s, 16311, (12, 0))).splitlines()
    key_lines = [line for line in lines if "api-key.env" in line]
    # systemd skips a missing file only when its name starts with '-' (fail open).
    assert key_lines == ["EnvironmentFile=/etc/freetoken/api-key.env"]
    none = Settings(api_key_source="none")
    assert "api-key.env" not in engine_unit(none, derive_plan(none, 16311, (12, 0)))


# --------------------------------------------------------------------------- pip index


def built_engine_host(settings: Settings, files: dict[str, tuple[str, int]]) -> FakeHost:
    """The host of operations.engine.environment with ``files`` (path -> (text, mode)) and the
    settings' engine version built (its venv with the engine, ninja and the completion marker)
    and active."""
    from facts.engine import EngineInstallInfo

    v, base = settings.engine_version, settings.engine_base_dir
    venv = f"{base}/{v}"
    built = {p: "" for p in (f"{venv}/pyvenv.cfg", f"{venv}/bin/ninja", f"{venv}/{ENGINE_COMPLETE_MARKER}")}
    return FakeHost(
        files={**built, **files},
        links={f"{base}/active": venv},
        facts={"EngineInstall": EngineInstallInfo(base, {v: v}, v, venv)},
    )


SECRET_INDEX = "https://builder:s3cr3t-pw@mirror.example/simple"


def test_pip_index_credentials_live_in_a_root_only_file():
    from operations.engine import environment, pip_conf

    s = Settings(pip_index_url=SECRET_INDEX)
    conf = f"{s.engine_base_dir}/{s.engine_version}/pip.conf"
    bare = built_engine_host(s, {}).commands(environment, s)
    assert f"upload {conf}" in bare and f"chmod 600 {conf}" in bare
    assert not any("s3cr3t" in c for c in bare)  # in the file only, never in a command
    # A file an older deploy left world-readable is closed on the next run.
    assert built_engine_host(s, {conf: (pip_conf(s), 644)}).commands(environment, s) == [f"chmod 600 {conf}"]
    assert built_engine_host(s, {conf: (pip_conf(s), 600)}).commands(environment, s) == []


# --------------------------------------------------------------------------- learned requests


@pytest.fixture()
def local_host(tmp_path, monkeypatch) -> Iterator[tuple[Any, Any]]:
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.api.state import StateStage

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(batch.ENV_SWITCH, "1")
    one_off = str(tmp_path / "one-off-model")
    inventory = Inventory((["@local"], {}), override_data={"model_dir": one_off, "listen_port": 9123})
    state = State(inventory, Config())
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host("@local")
    yield state, host
    batch._memos.pop((id(state), host.name), None)


def _learned(host: Any) -> list[dict]:
    path = batch.learned_path(host)
    return json.loads(path.read_text()) if path.exists() else []


def test_the_learned_list_never_holds_stdin_env_passwords_or_one_off_data(local_host, tmp_path):
    from pyinfra.facts.files import File
    from pyinfra.facts.server import Command

    state, host = local_host
    batch.prefetch(state, host, [])
    host.get_fact(File, path="/etc/hostname")
    host.get_fact(Command, command="echo piped", _stdin="the key\n")
    host.get_fact(Command, command="echo env", _env={"HF_TOKEN": "hf_secret"})
    host.get_fact(Command, command="echo pw", _sudo_password="hunter2")
    host.get_fact(File, path=str(tmp_path / "one-off-model" / "manifest.json"))
    text = batch.learned_path(host).read_text()
    for secret in ("the key", "hf_secret", "hunter2", "one-off-model", "echo piped", "echo env", "echo pw"):
        assert secret not in text
    assert [d["kwargs"] for d in _learned(host)] == [{"path": "/etc/hostname"}]


def test_a_number_given_with_data_is_one_off_too(local_host):
    from facts.engine import EngineHealth

    state, host = local_host
    request = batch.make_request(state, host, EngineHealth, (), {"host": "127.0.0.1", "port": 9123})
    assert request.to_json() is not None
    assert request.to_json(batch.one_off_values(host)) is None


def test_a_list_an_older_version_wrote_is_cleaned_on_reading(tmp_path):
    path = tmp_path / "old.json"
    kept: dict[str, Any] = {
        "fact": "pyinfra.facts.files:File",
        "kwargs": {"path": "/etc/hostname"},
        "executor": {"_sudo": True},
    }
    leaked: dict[str, Any] | None = {
        "fact": "pyinfra.facts.server:Command",
        "kwargs": {"command": "true"},
        "executor": {"_stdin": "secret"},
    }
    path.write_text(json.dumps([kept, leaked]))
    assert batch._load_learned(Path(path)) == [kept]
