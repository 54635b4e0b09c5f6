"""The host agent's port is root's from boot: the engine's user cannot take it first.

The agent answers the gateway's agent-check on an unprivileged port on the engine's address. A
process of the engine's user that bound it first would answer `ready` in the agent's place while
the agent died on `Address already in use`. systemd now holds the port (freetoken-agent.socket)
from boot, before any service; a squatter started as the engine's user at boot, ordered before
the agent, fails to bind, and the agent answers.
"""

from __future__ import annotations

import pytest

from freetoken_infra.core.settings import Settings
from tests.fleet.client import deploy

pytestmark = pytest.mark.fleet
HOST = "ws1"
SQUAT = "/etc/systemd/system/squat-agent-port.service"


@pytest.fixture(scope="module")
def converged(sim_fleet):
    run = deploy("--limit", HOST)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return sim_fleet


def test_the_engines_user_cannot_hold_the_agent_port_at_boot(converged):
    fleet = converged
    listen = fleet.run(HOST, "systemctl show -p Listen --value freetoken-agent.socket", check=True).stdout.strip()
    address, _, port = listen.split()[0].rpartition(":")
    assert port == str(Settings().agent_port), listen
    squatter = (
        "[Unit]\nDescription=test: the engine's user tries to hold the agent port at boot\n"
        "Before=freetoken-agent.service freetoken.service\n\n"
        '[Service]\nUser=freetoken\nExecStart=/usr/bin/python3 -c "import socket, time; s = socket.socket(); '
        f"s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{address}', {port})); s.listen(1); "
        "print('squatting', flush=True); time.sleep(600)\"\n\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    fleet.run(
        HOST,
        f"cat > {SQUAT} <<'EOF'\n{squatter}EOF\nsystemctl daemon-reload && systemctl enable -q squat-agent-port",
        check=True,
    )
    try:
        fleet.reboot(HOST)
        journal = fleet.run(HOST, "journalctl -b -u squat-agent-port --no-pager").stdout
        assert "squatting" not in journal and "Address already in use" in journal, journal
        # The agent answers on its port: one of its words, from the socket systemd handed it.
        probe = f"import socket; c = socket.create_connection(('{address}', {port}), timeout=10); print(c.recv(100).decode())"
        word = fleet.run(HOST, f'for i in $(seq 30); do python3 -c "{probe}" && break; sleep 1; done').stdout
        assert word.split()[:1] and word.split()[0] in ("up", "ready", "drain", "maint", "down"), word
        owner = fleet.run(HOST, f"ss -Htlnp 'sport = :{port}'").stdout
        assert "systemd" in owner or "python3" in owner, owner
        assert fleet.run(HOST, "systemctl is-active freetoken-agent.service").stdout.strip() == "active"
    finally:
        fleet.run(HOST, f"systemctl disable -q squat-agent-port; rm -f {SQUAT}; systemctl daemon-reload")
