import base64
import http.server
import json
import os
import subprocess
import threading

import pytest

from facts.engine import (
    EngineHealth,
    EngineHealthInfo,
    EngineInstall,
    parse_engine_install_output,
    parse_health_body,
    parse_health_output,
)
from tests.loopback import free_port


def run_sh(command):
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def make_venv(base, name, version=None):
    venv = base / name
    (venv / "lib" / "python3.12" / "site-packages").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if version:
        info = venv / "lib" / "python3.12" / "site-packages" / f"freetoken-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: freetoken\nVersion: {version}\n\nVersion: 9.9.9 in the description\n"
        )


def test_install_on_disk(tmp_path):
    make_venv(tmp_path, "0.2.0", "0.2.0")
    make_venv(tmp_path, "0.2.1", "0.2.1")
    make_venv(tmp_path, "broken")
    (tmp_path / "cache").mkdir()
    os.symlink(str(tmp_path / "0.2.1"), tmp_path / "active")
    fact = EngineInstall()
    info = fact.process(run_sh(fact.command(str(tmp_path))))
    assert info.versions == {"0.2.0": "0.2.0", "0.2.1": "0.2.1", "broken": None}
    assert info.active == "0.2.1" and info.active_target == str(tmp_path / "0.2.1")


def test_install_relative_and_dangling_links(tmp_path):
    make_venv(tmp_path, "0.2.1", "0.2.1")
    os.symlink("0.2.1", tmp_path / "active")
    fact = EngineInstall()
    assert fact.process(run_sh(fact.command(str(tmp_path)))).active == "0.2.1"
    os.remove(tmp_path / "active")
    os.symlink("0.9.9", tmp_path / "active")
    info = fact.process(run_sh(fact.command(str(tmp_path))))
    assert info.active is None and info.active_target == "0.9.9"


def test_install_missing_base(tmp_path):
    fact = EngineInstall()
    info = fact.process(run_sh(fact.command(str(tmp_path / "nope"))))
    assert info.versions == {} and info.active is None
    assert parse_engine_install_output("/opt/freetoken", []).base_dir == "/opt/freetoken"


# ---- health


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_health_loading():
    body = '{"status": "loading", "phase": "experts", "progress": {"done_bytes": 1024, "total_bytes": 4096}}'
    info = parse_health_output(["@@ft:http 200", "@@ft:body " + b64(body)])
    assert info.reachable and info.status == "loading" and info.phase == "experts"
    assert (info.done_bytes, info.total_bytes) == (1024, 4096)


def test_health_ok():
    info = parse_health_body(
        200, '{"status": "ok", "uptime_s": 12.5, "version": "0.2.1", "model": "Qwen3.6-35B-A3B-NVFP4-nvidia"}'
    )
    assert (info.status, info.version, info.model, info.uptime_s) == (
        "ok",
        "0.2.1",
        "Qwen3.6-35B-A3B-NVFP4-nvidia",
        12.5,
    )


def test_health_error():
    info = parse_health_body(200, '{"status": "error", "message": "backend worker died"}')
    assert info.status == "error" and info.message == "backend worker died" and info.error is None


def test_health_broken_json():
    info = parse_health_output(["@@ft:http 200", "@@ft:body " + b64("<html>nginx</html>")])
    assert info.reachable and info.status is None and "non-JSON" in info.error


def test_health_refused_and_empty():
    info = parse_health_output(['@@ft:unreachable "URLError: [Errno 111] Connection refused"'])
    assert not info.reachable and "Connection refused" in info.error
    assert not parse_health_output([]).reachable
    assert not parse_health_output(["@@ft:no-python"]).reachable


def test_every_health_that_says_nothing_readable_has_its_reason_and_nothing_else():
    """The answers that carry no health (EngineHealthInfo.unreadable / not_reached): every other
    field empty, the HTTP status kept where something answered."""
    nothing = (None,) * 7
    assert parse_health_output(["@@ft:http 502", "@@ft:body " + b64("<html>")]) == EngineHealthInfo(
        True, *nothing, "non-JSON /health body: '<html>'", 502
    )
    assert parse_health_body(200, "[1]") == EngineHealthInfo(True, *nothing, "unexpected /health JSON: '[1]'", 200)
    assert parse_health_output(["@@ft:http 200", "@@ft:body !!"]) == EngineHealthInfo(
        True, *nothing, "the /health body did not arrive intact (bad base64)", 200
    )
    assert parse_health_output(['@@ft:unreachable "URLError: x"']) == EngineHealthInfo(False, *nothing, "URLError: x")
    assert parse_health_output(["@@ft:unreachable 1x"]) == EngineHealthInfo(False, *nothing, "unreachable")
    assert parse_health_output(["@@ft:no-python"]) == EngineHealthInfo(False, *nothing, "python3 not found")
    assert parse_health_output([]) == EngineHealthInfo(False, *nothing, "no output") == EngineHealth.default()


@pytest.fixture
def health_server():
    payload = {"body": b""}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(payload["body"])

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], payload
    server.shutdown()


def test_health_command_against_local_server(health_server):
    port, payload = health_server
    payload["body"] = json.dumps({"status": "ok", "uptime_s": 3, "version": "0.2.1", "model": "m"}).encode()
    fact = EngineHealth()
    info = fact.process(run_sh(fact.command("127.0.0.1", port)))
    assert info.reachable and info.status == "ok" and info.http_status == 200 and info.model == "m"


def test_health_command_nothing_listening():
    fact = EngineHealth()
    port = free_port()
    info = fact.process(run_sh(fact.command(port=port)))
    assert info.reachable is False and info.error
