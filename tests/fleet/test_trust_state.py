"""Trust boundaries on a real host (issue 13, items 1 and 6): what the engine's service user can
write never aims what root does, and a missing key file stops the engine instead of opening it.

The attacker is the service user itself (``freetoken``, what a compromised engine runs as): it
plants links in the folders it owns, named as the files root used to write there, aimed at
files of its choosing in /etc. Then the deploy runs the steps that wrote them (a re-verify that
restarts the engine and runs the health gate). Nothing may appear at the links' targets.
ws1 only; the tests in this module run in order.
"""

from __future__ import annotations

import json
import shlex

import pytest

from freetoken_infra.core.layout import DEPLOY_STATE_DIR, HostLayout
from freetoken_infra.core.settings import Settings
from tests.fleet.client import deploy, grand_total, health, wait_healthy

pytestmark = pytest.mark.fleet
HOST = "ws1"
LAYOUT = HostLayout.of(Settings())
KEY_FILE = LAYOUT.api_key_file
# Where the service user aims its links: files only root may create.
PLANTS = {
    f"{LAYOUT.state_dir}/health-gate.json": "/etc/ft-planted-gate",  # the old gate record
    LAYOUT.reverify_request_file: "/etc/ft-planted-reverify",
}


def as_service_user(fleet, command: str) -> None:
    user = Settings().service_user
    fleet.run(HOST, f"setpriv --reuid={user} --regid={user} --clear-groups -- sh -c {shlex.quote(command)}", check=True)


@pytest.fixture(scope="module")
def converged(sim_fleet):
    run = deploy("--limit", HOST)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    wait_healthy(sim_fleet, HOST)
    return run


def test_roots_state_directory_is_roots_and_outside_the_engines_reach(sim_fleet, converged):
    stat = sim_fleet.run(HOST, f"stat -c '%U %G %a' {DEPLOY_STATE_DIR}", check=True).stdout.split()
    assert stat == ["root", "root", "755"]
    writable = sim_fleet.run(HOST, "systemctl show -p ReadWritePaths --value freetoken.service", check=True).stdout
    assert DEPLOY_STATE_DIR not in writable and LAYOUT.state_dir in writable
    gate = json.loads(sim_fleet.run(HOST, f"cat {LAYOUT.last_gate_file}", check=True).stdout)
    assert gate["ok"] is True
    # The guard (root) samples into root's folder only.
    guard_unit = sim_fleet.run(HOST, "systemctl cat freetoken-guard.service", check=True).stdout
    assert f"ReadWritePaths=-{DEPLOY_STATE_DIR}" in guard_unit
    assert f"ReadWritePaths=-{LAYOUT.state_dir}\n" not in guard_unit
    sim_fleet.run(HOST, f"rm -f {LAYOUT.guard_textfile} && systemctl start freetoken-guard.service", check=True)
    prom = sim_fleet.run(HOST, f"cat {LAYOUT.guard_textfile}", check=True).stdout
    assert "freetoken_guard_swap_used_bytes" in prom


def test_links_planted_by_the_service_user_aim_nothing_root_does(sim_fleet, converged):
    for link, target in PLANTS.items():
        sim_fleet.run(HOST, f"rm -f {target}")
        as_service_user(sim_fleet, f"rm -f {link} && ln -s {target} {link}")
    # A re-verify: the request file is (re)made, the fetcher re-hashes, the engine restarts and
    # the health gate runs and records its result.
    run = deploy("--limit", HOST, "--data", "model_reverify=true")
    out = run.stdout + run.stderr
    planted = sim_fleet.run(HOST, "ls -l " + " ".join(PLANTS.values()) + " 2>/dev/null; true").stdout
    assert planted.strip() == "", f"root wrote where the service user aimed it:\n{planted}"
    assert run.returncode == 0, out[-5000:]
    assert "== health gate ==" in out and grand_total(run)[1] != "-"
    # The request link was replaced by the service user's own file (then used and removed by
    # the fetcher), never followed.
    left = sim_fleet.run(HOST, f"test -L {shlex.quote(LAYOUT.reverify_request_file)}")
    assert left.returncode != 0
    gate = json.loads(sim_fleet.run(HOST, f"cat {LAYOUT.last_gate_file}", check=True).stdout)
    assert gate["ok"] is True


def test_a_deleted_key_file_stops_the_engine_instead_of_opening_it(sim_fleet, converged):
    backup = "/root/api-key.env.kept-by-test"
    sim_fleet.run(HOST, f"cp -p {KEY_FILE} {backup} && rm -f {KEY_FILE}", check=True)
    try:
        sim_fleet.run(HOST, "systemctl restart freetoken.service")
        state = sim_fleet.run(HOST, "systemctl is-active freetoken.service").stdout.strip()
        assert state != "active", "the engine started without its key file"
        log = sim_fleet.run(HOST, "journalctl -u freetoken.service -n 20 --no-pager -o cat").stdout
        assert "Failed to load environment files" in log, log
        assert health(sim_fleet, HOST)["status"] == "down", "something serves the API without the key"
    finally:
        sim_fleet.run(
            HOST,
            f"mv {backup} {KEY_FILE} && systemctl reset-failed freetoken.service; systemctl restart freetoken.service",
            check=True,
        )
    wait_healthy(sim_fleet, HOST)
