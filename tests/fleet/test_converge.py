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

from freetoken_infra.core.settings import DRIVER_PACKAGE_RE, Settings
from tests.fleet import harness
from tests.fleet.client import (
    SERVING,
    api_key,
    chat,
    deploy,
    engine_pid,
    fault,
    grand_total,
    swap_used_bytes,
    wait_healthy,
)
from tests.fleet.standins.cuda_repo import DRIVER_FAMILIES, NOT_A_DRIVER, OLD_KEYRING_VERSION, keyring_deb

pytestmark = pytest.mark.fleet
DEFAULTS = Settings()


def gate_table(out: str) -> dict[str, dict[str, str]]:
    """The health gate table a deploy ends with (operations/health.py, print_gate_report), by host:
    column name -> cell."""
    lines = out[out.rindex("== health gate ==") :].splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    rows = {}
    for line in lines[3:]:
        if re.match(r"\d+ host\(s\):", line):
            return rows
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = dict(zip(header, cells, strict=False))
    raise AssertionError(f"health gate table without its summary line:\n{lines}")


def no_changes(run: subprocess.CompletedProcess) -> bool:
    _, changed, errors, _ = grand_total(run)
    return (changed, errors) == ("-", "-")


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
    table = gate_table(out)
    for host in SERVING:
        reply = chat(sim_fleet, host, api_key(sim_fleet, host))
        assert reply["choices"][0]["message"]["content"], reply
        assert table[host]["health"] == "ok", table
        assert float(table[host]["decode tok/s"]) > 0, table
    assert "ws3" not in table or (
        table["ws3"]["health"] != "ok" and "refused at preflight" in table["ws3"].get("note", "")
    ), table


def test_ws3_is_refused_at_preflight_and_nothing_on_it_changed(sim_fleet, converged):
    out = converged["first"].stdout + converged["first"].stderr
    ws3 = out[out.index("== ws3: preflight ==") :]
    assert re.search(r"^wsl_version\s+BLOCK", ws3, re.M)
    assert re.search(r"^gpu_memory\s+BLOCK.*pitfall 4B", ws3, re.M | re.S)
    assert "[ws3] stopped: preflight blockers" in out
    assert harness.snapshot_diff(converged["ws3_before"], converged["ws3_after"]) == []


def test_second_converge_changes_nothing(sim_fleet, converged):
    again = deploy()
    out = again.stdout + again.stderr
    results = out[out.index("--> Results:") :]
    hosts_ops, changed, errors, unchanged = grand_total(again)
    assert (changed, errors) == ("-", "-"), results
    assert unchanged == hosts_ops
    assert "Health gate" in results  # the gate is there, and found nothing to prove again
    table = gate_table(out)
    for host in SERVING:
        assert table[host]["health"] == "ok" and "not re-checked" in table[host]["note"], table
        assert float(table[host]["decode tok/s"].rstrip("*")) > 0, table  # its last gate's


def test_a_refused_host_is_answered_from_its_record_until_an_input_changes(sim_fleet, converged):
    """ws3's old WSL stands until WSL is updated (a restart of its VM: a new boot), so a re-run
    answers its refusal from the record the run that refused it left, in the lock's one round
    trip, without reading a fact or probing its GPU again; any input of its facts changed, and
    the run reads every fact and decides again. The record is volatile: nothing on ws3 persists."""
    before = sim_fleet.snapshot("ws3")
    deploy("--limit", "ws3")  # whatever the runs before left: a full read records the refusal
    again = deploy("--limit", "ws3")
    out = again.stdout + again.stderr
    assert again.returncode != 0
    assert "[ws3] refused, unchanged since its last full read (" in out, out[-5000:]
    assert "wsl_version: WSL 2.6.1 < 2.7.13" in out and "== ws3: preflight ==" not in out, out[-5000:]
    assert "[ws3] stopped: preflight blockers: wsl_version (unchanged since its last full read)" in out
    assert "gpu_memory" not in out.split("[ws3] refused", 1)[1]  # the live probe's blocker is not cached
    # An input of its facts: chmod to its own mode moves only its ctime (what a user cannot undo).
    sim_fleet.run("ws3", 'chmod "$(stat -c %a /var/lib/dpkg/status)" /var/lib/dpkg/status', check=True)
    changed = deploy("--limit", "ws3")
    out = changed.stdout + changed.stderr
    assert "[ws3] reading every fact: changed: path /var/lib/dpkg/status" in out, out[-5000:]
    assert re.search(r"^gpu_memory\s+BLOCK", out[out.index("== ws3: preflight ==") :], re.M)
    full = deploy("--limit", "ws3", "--data", "fast_check=false")  # asked for: every fact
    assert "== ws3: preflight ==" in full.stdout + full.stderr
    assert harness.snapshot_diff(before, sim_fleet.snapshot("ws3")) == []


def test_wslconfig_keeps_the_users_comment_and_key(sim_fleet, converged):
    for host in SERVING:
        user = sim_fleet.hosts[host].profile["windows_user"]
        text = sim_fleet.run(host, f"cat /mnt/c/Users/{user}/.wslconfig", check=True).stdout
        assert "# my own settings - keep this comment" in text
        assert "guiApplications=false" in text
        assert re.search(r"^memory=24GB\r?$", text, re.M | re.I)
        assert re.search(r"^vmIdleTimeout=0\r?$", text, re.M)
        assert "systemd=true" in sim_fleet.run(host, "cat /etc/wsl.conf", check=True).stdout


def test_a_changed_wslconfig_says_restart_required_and_no_step_waits(sim_fleet, converged):
    host = "ws1"
    wslconfig = f"/mnt/c/Users/{sim_fleet.hosts[host].profile['windows_user']}/.wslconfig"

    def restart_line(run):
        lines = [
            line
            for line in (run.stdout + run.stderr).splitlines()
            if f"[{host}] restart required: run `wsl.exe --shutdown` from Windows" in line
        ]
        assert len(lines) == 1, (run.stdout + run.stderr)[-5000:]
        return lines[0]

    def user_file_kept(memory):
        text = sim_fleet.run(host, f"cat {wslconfig}", check=True).stdout
        assert "# my own settings - keep this comment" in text and "guiApplications=false" in text
        assert re.search(rf"^memory={memory}\r?$", text, re.M | re.I), text

    # Both Windows-side files differ: another memory limit, and systemd dropped from wsl.conf.
    sim_fleet.run(host, "sed -i '/^systemd=true/d' /etc/wsl.conf", check=True)
    try:
        changed = deploy("--limit", host, "--data", "wslconfig_memory=20GB")
        line = restart_line(changed)
        assert wslconfig in line and "/etc/wsl.conf" in line, line
        # systemd already runs the host: the VM limits wait for the restart, no later step does.
        assert "no later step waits for it" in line, line
        out = changed.stdout + changed.stderr
        assert changed.returncode == 0 and "Wait for the WSL restart" not in out, out[-5000:]
        assert gate_table(out)[host]["health"] == "ok"
        user_file_kept("20GB")
        assert "systemd=true" in sim_fleet.run(host, "cat /etc/wsl.conf", check=True).stdout
    finally:
        back = deploy("--limit", host)
    line = restart_line(back)
    assert wslconfig in line and "/etc/wsl.conf" not in line, line
    user_file_kept(DEFAULTS.wslconfig_memory)
    again = deploy("--limit", host)
    assert no_changes(again), again.stdout[-5000:]
    assert "restart required" not in again.stdout + again.stderr


def _candidates(fleet, host, packages) -> dict[str, str]:
    """apt's candidate version of each package, from one `apt-cache policy` of them all."""
    policy = fleet.run(host, "apt-cache policy " + " ".join(sorted(packages)), check=True).stdout
    found = dict(re.findall(r"^(\S+):\n(?:\s+Installed:.*\n)?\s+Candidate:\s*(\S+)", policy, re.M))
    assert set(found) == set(packages), f"{host}: apt knows no {sorted(set(packages) - set(found))}: {policy!r}"
    return found


def test_no_driver_package_and_the_pin_blocks_them(sim_fleet, converged):
    for host in SERVING:
        pkgs = sim_fleet.run(host, "dpkg-query -W -f='${Package}\\n'", check=True).stdout.split()
        assert set(DEFAULTS.cuda_packages) <= set(pkgs)
        assert not [p for p in pkgs if DRIVER_PACKAGE_RE.match(p)]
        known = {
            p
            for p in sim_fleet.run(host, "apt-cache pkgnames", check=True).stdout.split()
            if DRIVER_PACKAGE_RE.match(p)
        }
        assert {"cuda-drivers", "cuda-13-0", *DRIVER_FAMILIES} <= known, sorted(known)
        allowed = [*DEFAULTS.cuda_packages, NOT_A_DRIVER]
        candidates = _candidates(sim_fleet, host, [*known, *allowed])
        # apt's own decision, one driver package at a time (one command, a line per package)
        attempts = sim_fleet.run(
            host,
            "for p in " + " ".join(sorted(known)) + "; do "
            'out=$(apt-get install -s "$p" 2>&1) && echo "$p exits-0" && continue; '
            'printf "%s\\n" "$out" | grep -q "^Inst $p " && echo "$p installs" || echo "$p refused"; done',
            check=True,
        ).stdout.split("\n")
        for pkg in sorted(known):
            assert candidates[pkg] == "(none)", f"{host}: the pin lets {pkg} in"
            assert f"{pkg} refused" in attempts, (host, pkg, attempts)
        # ...and the pin is no wider than the drivers: the toolkit and other NVIDIA tools install.
        for pkg in allowed:
            assert candidates[pkg] != "(none)", f"{host}: the pin blocks {pkg}"
        attempt = sim_fleet.run(host, "apt-get install -s --reinstall " + " ".join(allowed))
        for pkg in allowed:
            assert attempt.returncode == 0 and f"Inst {pkg} " in attempt.stdout, (host, pkg, attempt.stderr)


def test_an_older_cuda_keyring_is_kept_and_apt_still_works(sim_fleet, converged):
    """A host set up from an older NVIDIA guide has cuda-keyring 1.0-1 (downloaded from the
    repository's directory, as NVIDIA's instructions do): the deploy keeps it. It stays
    installed for the rest of the session, a state the deploy must accept anyway."""
    host = "ws2"
    url = sim_fleet.url("cuda_repo") + keyring_deb(OLD_KEYRING_VERSION)
    sim_fleet.run(
        host,
        f"python3 -c \"import urllib.request as u; u.urlretrieve('{url}', '/tmp/k.deb')\" "
        "&& dpkg -i /tmp/k.deb && rm /tmp/k.deb",
        check=True,
    )
    version = "dpkg-query -W -f='${Version}' cuda-keyring"
    installs = "grep -cE ' (install|upgrade) cuda-keyring:' /var/log/dpkg.log"
    assert sim_fleet.run(host, version, check=True).stdout == OLD_KEYRING_VERSION
    before = sim_fleet.run(host, installs).stdout
    first = deploy("--limit", host)
    # One change: the sources entry the keyring package brought back, a duplicate of the deploy's.
    assert grand_total(first)[1:3] == ("1", "-"), first.stdout[-5000:]
    assert sim_fleet.run(host, version, check=True).stdout == OLD_KEYRING_VERSION
    assert sim_fleet.run(host, installs).stdout == before, "the deploy reinstalled the keyring"
    apt = sim_fleet.run(host, "apt-get update 2>&1 && apt-get install -s --reinstall cuda-nvcc-13-0", timeout=600)
    assert apt.returncode == 0 and "Inst cuda-nvcc-13-0 " in apt.stdout, apt.stdout + apt.stderr
    assert not re.search(r"NO_PUBKEY|not signed|configured multiple times|^[WE]:", apt.stdout, re.M), apt.stdout
    again = deploy("--limit", host)
    assert no_changes(again), again.stdout[-5000:]


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
    # systemd restarts it after RestartSec=5: poll for a new process, bounded well above that.
    deadline = time.monotonic() + 60
    while engine_pid(sim_fleet, "ws1") in (0, pid):
        assert time.monotonic() < deadline, "the killed engine was not restarted within 60 s"
        time.sleep(0.5)
    wait_healthy(sim_fleet, "ws1")


def test_guard_stops_the_engine_on_an_oom_line_and_records_why(sim_fleet, converged):
    host = "ws2"
    assert sim_fleet.run(host, "systemctl is-active freetoken-guard.timer").stdout.strip() == "active"
    fault(sim_fleet, host, "oom")
    time.sleep(2)
    sim_fleet.run(host, "systemctl start freetoken-guard.service", check=True)
    assert sim_fleet.run(host, "systemctl is-active freetoken.service").stdout.strip() != "active"
    state = json.loads(sim_fleet.run(host, "cat /var/lib/freetoken-deploy/guard-state.json", check=True).stdout)
    assert state["tripped"] and "out of memory" in state["reason"].lower()
    assert (
        "freetoken-guard: stopped freetoken.service"
        in sim_fleet.run(host, "journalctl -u freetoken-guard.service --no-pager -o cat", check=True).stdout
    )


def test_guard_timer_stops_the_engine_when_swap_grows(sim_fleet, converged):
    """Nobody starts the guard here: its timer (every guard_interval_s) must trip on its own."""
    host = "ws1"
    wait_healthy(sim_fleet, host)
    state_file = "/var/lib/freetoken-deploy/guard-state.json"
    assert sim_fleet.run(host, f"test -e {state_file}").returncode != 0
    restarts = sim_fleet.run(host, "systemctl show -p NRestarts --value freetoken.service", check=True).stdout
    # The engine's memory spills into swap and keeps growing (the stand-in's swap fault).
    fault(sim_fleet, host, "swap", mib_per_s=256)
    deadline = time.monotonic() + 5 * DEFAULTS.guard_interval_s  # bounded, well above one period
    while sim_fleet.run(host, f"test -e {state_file}").returncode != 0:
        assert time.monotonic() < deadline, sim_fleet.run(
            host, "systemctl list-timers --all --no-pager freetoken-guard.timer"
        ).stdout
        time.sleep(2)
    state = json.loads(sim_fleet.run(host, f"cat {state_file}", check=True).stdout)
    assert state["tripped"] and "swap" in state["reason"] and "stop failed" not in state["reason"], state
    # Stopped for good: not restarted by systemd (RestartSec=5) a while later, its swap freed.
    time.sleep(12)
    assert sim_fleet.run(host, "systemctl is-active freetoken.service").stdout.strip() == "inactive"
    assert sim_fleet.run(host, "systemctl show -p NRestarts --value freetoken.service", check=True).stdout == restarts
    assert swap_used_bytes(sim_fleet, host) < DEFAULTS.guard_swap_limit_gb * 1024**3
    log = sim_fleet.run(host, "journalctl -u freetoken-guard.service --no-pager -o cat", check=True).stdout
    assert re.search(r"^freetoken-guard: stopped freetoken\.service: swap", log, re.M), log
    prom = sim_fleet.run(host, "cat /var/lib/freetoken-deploy/metrics/freetoken.prom", check=True).stdout
    assert "freetoken_guard_swap_used_bytes" in prom


def test_a_converge_after_the_guard_tripped_brings_the_engine_back(sim_fleet, converged):
    deploy()
    for host in SERVING:
        wait_healthy(sim_fleet, host)
        assert sim_fleet.run(host, "test -e /var/lib/freetoken-deploy/guard-state.json").returncode != 0


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
