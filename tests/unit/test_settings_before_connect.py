"""Bad settings stop `pyinfra INVENTORY deploys/X.py` before pyinfra connects to any host.

No fleet needed: the inventory's one host is 127.0.0.1 with `ssh_port` pointing at a TCP
listener here that counts the connections it accepts. A bad value (given with `--data` or in
group data) must stop the run with one line naming host, field, value and what is allowed,
exit non-zero, show no traceback, and leave the listener with zero connections. The control
case (good settings) shows the listener does see pyinfra's connection attempt.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.loopback import free_port

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOYS = ["deploys/doctor.py", "deploys/freetoken.py"]


class ConnectionRecorder:
    """A TCP listener on 127.0.0.1 that accepts, records and closes every connection."""

    def __init__(self):
        self.port = free_port()
        self.connections = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", self.port))
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()  # no SSH banner: pyinfra's connection fails at once

    def close(self):
        self._sock.close()


@pytest.fixture
def listener():
    rec = ConnectionRecorder()
    yield rec
    rec.close()


def inventory(tmp_path: Path, port: int, group_all: str | None = None) -> Path:
    inv = tmp_path / "inventory.py"
    inv.write_text(f'hosts = [("127.0.0.1", {{"ssh_port": {port}, "ssh_user": "nobody"}})]\n')
    if group_all is not None:  # group data beside the inventory applies as pyinfra's does
        (tmp_path / "group_data").mkdir()
        (tmp_path / "group_data" / "all.py").write_text(group_all)
    return inv


def pyinfra(*args: str) -> subprocess.CompletedProcess:
    # From the repository root: the same directory the README's commands run from.
    return subprocess.run(
        [PYINFRA, "-y", *args], cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120
    )


@pytest.mark.parametrize("deploy", DEPLOYS)
def test_bad_data_stops_the_run_before_any_connection(tmp_path, listener, deploy):
    inv = inventory(tmp_path, listener.port)
    run = pyinfra("--data", "listen_port=70000", "--data", "lisen_port=1", str(inv), deploy)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Traceback" not in out, out
    lines = [line.strip() for line in out.splitlines() if line.strip().startswith("host 127.0.0.1:")]
    assert sorted(lines) == [
        "host 127.0.0.1: setting 'listen_port' = 70000 is invalid: Input should be less than or equal to 65534",
        "host 127.0.0.1: unknown setting 'lisen_port' = 1; did you mean 'listen_port'?",
    ], out
    assert "no host was contacted" in out
    assert listener.connections == 0, out


@pytest.mark.parametrize("deploy", DEPLOYS)
def test_bad_group_data_stops_the_run_before_any_connection(tmp_path, listener, deploy):
    inv = inventory(tmp_path, listener.port, group_all='wslconfig_memory = "24 gigs"\n')
    run = pyinfra(str(inv), deploy)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Traceback" not in out, out
    assert (
        "host 127.0.0.1: setting 'wslconfig_memory' = '24 gigs' is invalid: "
        "must be a positive size such as '24GB' or '512MB'" in out
    ), out
    assert listener.connections == 0, out


def test_good_settings_do_reach_the_listener(tmp_path, listener):
    # The control: with nothing wrong, pyinfra connects (and fails: the listener speaks no SSH),
    # so the zero above is the validation's doing, not a listener that sees nothing.
    inv = inventory(tmp_path, listener.port)
    run = pyinfra(str(inv), "deploys/doctor.py")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "invalid setting" not in out, out
    assert listener.connections >= 1, out
