"""The main job on the simulated fleet: real pyinfra over real SSH into real systemd hosts.

Molecule's sequence: converge -> idempotence -> verify -> break things and watch them heal.
ws1 and ws2 must serve; ws3 (old WSL, allocation-locked GPU memory) must be refused at
preflight with nothing on it changed. The tests in this module run in order and share
the converged fleet.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.fleet import harness
from tests.fleet.client import SERVING, api_key, chat, deploy, engine_pid, grand_total, wait_healthy

pytestmark = pytest.mark.fleet


@pytest.fixture(scope="module")
def converged(sim_fleet):
    before = sim_fleet.snapshot("ws3")
    first = deploy()
    after = sim_fleet.snapshot("ws3")
    return {"first": first, "ws3_before": before, "ws3_after": after}


def test_first_converge_serves_on_ws1_and_ws2(sim_fleet, converged):
    out = converged["first"].stdout + converged["first"].stderr
    # ws3 is refused, so the run as a whole reports a failed host.
    assert converged["first"].returncode != 0
    for host in SERVING:
        reply = chat(sim_fleet, host, api_key(sim_fleet, host))
        assert reply["choices"][0]["message"]["content"], reply
        assert re.search(rf"{host}.*tok/s|{host}.*decode", out, re.S), f"no decode report for {host}"


def test_ws3_is_refused_at_preflight_and_nothing_on_it_changed(sim_fleet, converged):
    out = converged["first"].stdout + converged["first"].stderr
    ws3 = out[out.index("== ws3: preflight =="):]
    assert re.search(r"^wsl_version\s+BLOCK", ws3, re.M)
    assert re.search(r"^gpu_memory\s+BLOCK.*pitfall 4B", ws3, re.M | re.S)
    assert "[ws3] stopped: preflight blockers" in out
    assert harness.snapshot_diff(converged["ws3_before"], converged["ws3_after"]) == []


def test_second_converge_changes_nothing(sim_fleet, converged):
    again = deploy()
    out = again.stdout + again.stderr
    results = out[out.index("--> Results:"):]
    hosts_ops, changed, errors, unchanged = grand_total(again)
    assert (changed, errors) == ("-", "-"), results
    assert unchanged == hosts_ops
    assert "Health gate" in results  # the gate is there, and found nothing to prove again


def test_wslconfig_keeps_the_users_comment_and_key(sim_fleet, converged):
    for host in SERVING:
        user = sim_fleet.hosts[host].profile["windows_user"]
        text = sim_fleet.run(host, f"cat /mnt/c/Users/{user}/.wslconfig", check=True).stdout
        assert "# my own settings - keep this comment" in text
        assert "guiApplications=false" in text
        assert re.search(r"^memory=24GB\r?$", text, re.M | re.I)
        assert re.search(r"^vmIdleTimeout=0\r?$", text, re.M)
        assert "systemd=true" in sim_fleet.run(host, "cat /etc/wsl.conf", check=True).stdout


def test_no_driver_package_and_the_pin_blocks_them(sim_fleet, converged):
    for host in SERVING:
        pkgs = sim_fleet.run(host, "dpkg-query -W -f='${Package}\\n'", check=True).stdout.split()
        assert "cuda-nvcc-13-0" in pkgs
        assert not [p for p in pkgs if p.startswith(("cuda-drivers", "nvidia-driver")) or p == "cuda-13-0"]
        policy = sim_fleet.run(host, "apt-cache policy cuda-drivers cuda-13-0").stdout
        assert "-1" in policy, policy
        attempt = sim_fleet.run(host, "apt-get install -y -s cuda-13-0")
        assert attempt.returncode != 0, attempt.stdout


def test_engine_runs_as_a_non_root_user_and_the_key_is_hidden(sim_fleet, converged):
    for host in SERVING:
        key = api_key(sim_fleet, host)
        assert sim_fleet.run(host, "stat -c %a /etc/freetoken/api-key.env", check=True).stdout.strip() == "600"
        user = sim_fleet.run(host, f"ps -o user= -p {engine_pid(sim_fleet, host)}", check=True).stdout.strip()
        assert user == "freetoken"
        ps = sim_fleet.run(host, "ps -eo args", check=True).stdout
        journal = sim_fleet.run(host, "journalctl --no-pager -o cat", check=True).stdout
        assert key not in ps and key not in journal


def test_killed_engine_is_restarted_by_systemd(sim_fleet, converged):
    pid = engine_pid(sim_fleet, "ws1")
    sim_fleet.run("ws1", f"kill -9 {pid}", check=True)
    time.sleep(8)
    assert engine_pid(sim_fleet, "ws1") not in (0, pid)
    wait_healthy(sim_fleet, "ws1")


def test_guard_stops_the_engine_on_an_oom_line_and_records_why(sim_fleet, converged):
    host = "ws2"
    key = api_key(sim_fleet, host)
    assert sim_fleet.run(host, "systemctl is-active freetoken-guard.timer").stdout.strip() == "active"
    r = subprocess.run(
        sim_fleet.ssh_argv(host) + ["python3", "-c", json.dumps(
            "import sys,urllib.request;k=sys.stdin.readline().strip();"
            "urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:8000/_standin/fault',"
            "data=b'{\"kind\": \"oom\"}',headers={'Authorization':'Bearer '+k,'Content-Type':'application/json'}))")],
        input=key + "\n", capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    time.sleep(2)
    sim_fleet.run(host, "systemctl start freetoken-guard.service", check=True)
    assert sim_fleet.run(host, "systemctl is-active freetoken.service").stdout.strip() != "active"
    state = json.loads(sim_fleet.run(host, "cat /var/lib/freetoken/guard-state.json", check=True).stdout)
    assert state["tripped"] and "out of memory" in state["reason"].lower()
    assert "freetoken-guard: stopped freetoken.service" in sim_fleet.run(
        host, "journalctl -u freetoken-guard.service --no-pager -o cat", check=True).stdout


def test_guard_stops_the_engine_when_swap_grows(sim_fleet, converged):
    host = "ws1"
    wait_healthy(sim_fleet, host)
    sim_fleet.set_swap_used(host, int(2.6 * 1024**3))
    try:
        # The timer may fire in the same moment; what counts is the outcome, not who acted.
        run = sim_fleet.run(host, "systemctl start freetoken-guard.service")
        log = sim_fleet.run(host, "journalctl -u freetoken-guard.service --no-pager -o cat -n 40").stdout
        assert sim_fleet.run(host, "systemctl is-active freetoken.service").stdout.strip() != "active", (run, log)
        state = json.loads(sim_fleet.run(host, "cat /var/lib/freetoken/guard-state.json", check=True).stdout)
        assert state["tripped"] and "swap" in state["reason"], (state, log)
        assert "stop failed" not in state["reason"], log
        prom = sim_fleet.run(host, "cat /var/lib/freetoken/metrics/freetoken.prom", check=True).stdout
        assert "freetoken_guard_swap_used_bytes" in prom
    finally:
        sim_fleet.set_swap_used(host, 0)


def test_a_converge_after_the_guard_tripped_brings_the_engine_back(sim_fleet, converged):
    deploy()
    for host in SERVING:
        wait_healthy(sim_fleet, host)
        assert sim_fleet.run(host, "test -e /var/lib/freetoken/guard-state.json").returncode != 0


def test_rebooted_host_comes_back_healthy(sim_fleet, converged):
    sim_fleet.reboot("ws1")
    wait_healthy(sim_fleet, "ws1", timeout=180)


def test_opt_in_windows_autostart_creates_the_scheduled_task_once(sim_fleet, converged):
    first = deploy("--limit", "ws1", "--data", "windows_autostart=true")
    assert "Windows: start the distro at logon" in first.stdout + first.stderr
    tasks = sim_fleet.run("ws1", "cat /mnt/c/.sim/schtasks.json", check=True).stdout
    assert "FreeToken-WSL" in tasks and "wsl.exe" in tasks
    again = deploy("--limit", "ws1", "--data", "windows_autostart=true")
    assert grand_total(again)[1] == "-", again.stdout
