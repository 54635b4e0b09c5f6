"""The read-only doctor across the simulated fleet: `pyinfra -y inventories/sim.py deploys/doctor.py`.

One findings table per host and a fleet summary of the hosts in the run; ws3 (WSL 2.6.1 with
the WDDM allocation lock, pitfall 4B) is blocked, ws1 and ws2 pass or warn, the run exits
non-zero; under `--limit ws1` the summary covers that one host and the run exits 0. The doctor
changes nothing on any host (the harness's snapshot, before and after, less what a converged
host's guard timer writes on its own every 30 s).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from tests.fleet import harness
from tests.fleet.client import PYINFRA, ROOT, snapshot_without_guard_samples

pytestmark = pytest.mark.fleet

HOSTS = ("ws1", "ws2", "ws3")


def doctor(*extra: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [PYINFRA, "-y", *extra, "inventories/sim.py", "deploys/doctor.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-20000:], run.stderr[-20000:], sep="\n")
    return run


def table(out: str, host: str) -> list[str]:
    """The rows of one host's findings table: (check, status) pairs as printed."""
    start = out.index(f"== {host}: preflight ==")
    end = out.find("\n== ", start + 1)
    rows = []
    for line in out[start : end if end != -1 else None].splitlines()[3:]:
        parts = line.split()
        if len(parts) >= 2 and not line.startswith(" ") and parts[1] in ("pass", "WARN", "BLOCK"):
            rows.append((parts[0], parts[1]))
    return rows


def flat(out: str) -> str:
    """The output with the table's wrapped lines and padding collapsed to single spaces."""
    return " ".join(out.split())


def summary(out: str) -> list[str]:
    text = out[out.index("== fleet preflight summary ==") :]
    lines = text.splitlines()[1:]
    end = next(i for i, line in enumerate(lines) if re.match(r"\d+ of \d+ host\(s\) ready$", line))
    return lines[: end + 1]


@pytest.fixture(scope="module")
def whole_fleet(sim_fleet):
    before = {h: snapshot_without_guard_samples(sim_fleet, h) for h in HOSTS}
    run = doctor()
    after = {h: snapshot_without_guard_samples(sim_fleet, h) for h in HOSTS}
    return run, before, after


def test_a_table_per_host_ws3_blocked_the_others_not(whole_fleet):
    run, _, _ = whole_fleet
    out = run.stdout + run.stderr
    assert run.returncode != 0, "ws3 has blockers: the doctor must exit non-zero"
    assert "Traceback" not in out
    for host in HOSTS:
        rows = table(out, host)
        assert len(rows) >= 10, (host, rows)
    ws3 = dict(table(out, "ws3"))
    assert ws3["wsl_version"] == "BLOCK" and ws3["gpu_memory"] == "BLOCK", ws3
    ws3_text = out[out.index("== ws3: preflight ==") :]
    assert re.search(r"^gpu_memory\s+BLOCK.*allocations fail.*pitfall 4B", ws3_text, re.M | re.S)
    for host in ("ws1", "ws2"):
        blocked = [check for check, status in table(out, host) if status == "BLOCK"]
        assert blocked == [], (host, blocked)


def test_the_fleet_summary_covers_every_host(whole_fleet):
    run, _, _ = whole_fleet
    lines = summary(run.stdout + run.stderr)
    by_host = {line.split()[0]: line for line in lines[:-1]}
    assert set(by_host) == set(HOSTS), lines
    assert by_host["ws1"].split()[1] == "ready" and by_host["ws2"].split()[1] == "ready", lines
    assert re.match(r"ws3\s+BLOCKED blockers: .*wsl_version.*gpu_memory", by_host["ws3"]), lines
    assert lines[-1] == "2 of 3 host(s) ready"


def test_the_doctor_changes_nothing(whole_fleet):
    _, before, after = whole_fleet
    for host in HOSTS:
        assert harness.snapshot_diff(before[host], after[host]) == [], host


def test_limit_one_healthy_host_exits_0_with_a_summary_of_one(sim_fleet):
    before = snapshot_without_guard_samples(sim_fleet, "ws1")
    run = doctor("--limit", "ws1")
    after = snapshot_without_guard_samples(sim_fleet, "ws1")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-5000:]
    assert "== ws1: preflight ==" in out
    assert "== ws2: preflight ==" not in out and "== ws3: preflight ==" not in out
    lines = summary(out)
    assert len(lines) == 2 and lines[0].split()[:2] == ["ws1", "ready"], lines
    assert lines[-1] == "1 of 1 host(s) ready"
    assert harness.snapshot_diff(before, after) == []


def _engine_active(fleet, host) -> bool:
    return fleet.run(host, "systemctl is-active --quiet freetoken.service").returncode == 0


def _poll(what: str, predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(1.0)


def test_an_owner_holding_the_gpu_stops_the_engine_start_and_the_doctor_says_so(sim_fleet):
    """On a host: the owner's game (the nvidia-smi stand-in's used memory; under
    WSL nvidia-smi lists no Windows process) holds all but 1 GiB of ws2's card while its engine is
    stopped. The doctor blocks on gpu_free, saying what is held and that nvidia-smi names no one;
    the deploy stops at its preflight without changing anything; a start the deploy does not make
    (at boot, systemd's restart after a crash) is held back by the unit's own check, which says
    why. Once the game lets go, systemd's next try starts the engine and the doctor passes."""
    from tests.fleet.client import deploy
    from tests.fleet.profiles import PROFILES

    host, total = "ws2", PROFILES["ws2"].gpu.memory_total_mib
    if sim_fleet.run(host, "test -f /etc/systemd/system/freetoken.service").returncode != 0:
        first = deploy("--limit", host)  # this module alone: converge ws2 first
        assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    was_active = _engine_active(sim_fleet, host)
    if was_active:  # an engine of ours holding the card is not judged: stop it, as a crash would
        sim_fleet.run(host, "systemctl stop freetoken.service", check=True)
    sim_fleet.run(host, f"echo {total - 1024} > /.sim/gpu-memory-used-mib", check=True)
    try:
        before = snapshot_without_guard_samples(sim_fleet, host)
        run = doctor("--limit", host)
        out = run.stdout + run.stderr
        assert run.returncode != 0 and dict(table(out, host))["gpu_free"] == "BLOCK", out[-5000:]
        assert (
            "gpu_free BLOCK 30.8 GiB of 31.8 GiB in use, held by Windows-side processes (not listed under WSL);"
            in flat(out)
        ), out[-5000:]
        converge = deploy("--limit", host)
        out = converge.stdout + converge.stderr
        assert f"[{host}] stopped: preflight blockers: gpu_free" in out, out[-5000:]
        assert "Traceback" not in out
        assert harness.snapshot_diff(before, snapshot_without_guard_samples(sim_fleet, host)) == []
        assert not _engine_active(sim_fleet, host)

        since = sim_fleet.run(host, "date +%s", check=True).stdout.strip()
        sim_fleet.run(host, "systemctl start --no-block freetoken.service", check=True)

        def refused() -> bool:
            journal = sim_fleet.run(host, f"journalctl -u freetoken.service --since @{since} -o cat").stdout
            return "gpu_free: 30.8 GiB of 31.8 GiB held by other processes" in journal

        _poll("the unit's GPU check refusing the start", refused, 60)
        assert not _engine_active(sim_fleet, host)
    finally:
        sim_fleet.run(host, "rm -f /.sim/gpu-memory-used-mib", check=True)
    # The game let go: systemd tries again (RestartSec=5) and the engine starts.
    _poll("the engine started again by systemd", lambda: _engine_active(sim_fleet, host), 120)
    if not was_active:
        sim_fleet.run(host, "systemctl stop freetoken.service", check=True)
    run = doctor("--limit", host)
    out = run.stdout + run.stderr
    assert dict(table(out, host)).get("gpu_free") in (None, "pass"), out[-5000:]


def test_the_doctor_names_who_holds_the_card_and_no_name_can_forge_its_findings(sim_fleet):
    """nvidia-smi (the stand-in, listing as a Linux host's does) names a process
    holding 19.5 GiB of ws2's card while more is held by nobody it lists (under WSL, Windows'
    apps). The doctor's gpu_memory, launch_plan and gpu_free say how much and who. The names are
    any process's text: one carries terminal escapes, another newlines and a forged GPU line; the
    doctor prints them made safe, the forged line changes nothing, and the launch plan stays the
    card's (the same plan as with the card free)."""
    from tests.fleet.client import deploy
    from tests.fleet.profiles import PROFILES

    host, total = "ws2", PROFILES["ws2"].gpu.memory_total_mib
    if sim_fleet.run(host, "test -f /etc/systemd/system/freetoken.service").returncode != 0:
        first = deploy("--limit", host)
        assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    free_run = doctor("--limit", host)
    free_plan = next(
        line for line in (free_run.stdout + free_run.stderr).splitlines() if line.startswith("launch_plan")
    )
    was_active = _engine_active(sim_fleet, host)
    if was_active:
        sim_fleet.run(host, "systemctl stop freetoken.service", check=True)
    processes = [
        {"pid": 4242, "name": "game\x1b]0;owned\x07\x1b[2J", "used_mib": 20000},
        {"pid": 4343, "name": "evil\n@@ft:query\n0, FORGED, 9.0, 999999, 0, 999999, 1.0", "used_mib": 5},
    ]
    sim_fleet.run(host, f"echo {total - 1024} > /.sim/gpu-memory-used-mib", check=True)
    sim_fleet.run(host, f"cat > /.sim/gpu-processes.json <<'EOF'\n{json.dumps(processes)}\nEOF", check=True)
    try:
        run = doctor("--limit", host)
    finally:
        sim_fleet.run(host, "rm -f /.sim/gpu-memory-used-mib /.sim/gpu-processes.json", check=True)
        if was_active:
            sim_fleet.run(host, "systemctl start freetoken.service", check=True)
    out = run.stdout + run.stderr
    rows = dict(table(out, host))
    assert rows["gpu_free"] == "BLOCK" and rows["launch_plan"] == "pass", out[-5000:]
    who = "held by game?]0;owned??[2J (pid 4242, 19.5 GiB) and Windows-side processes (not listed under WSL) (11.3 GiB)"
    text = flat(out)
    assert f"gpu_free BLOCK 30.8 GiB of 31.8 GiB in use, {who};" in text, out[-5000:]
    assert f"on the card; 30.8 GiB of it {who} now (see gpu_free)" in text, out[-5000:]
    # the engine is stopped (above), so /health does not answer and the doctor probes the card
    gpu_memory = text.split("gpu_memory", 1)[1].split("nvcc", 1)[0]
    assert "not probed" not in gpu_memory, out[-5000:]
    assert f"30.8 GiB {who}" in gpu_memory, out[-5000:]
    assert "\x1b" not in out and "\x07" not in out and "FORGED" not in out
    # the plan is the card's, not the moment's: the same cache and tokens as with the card free
    assert (
        free_plan.split(":")[0]
        == next(line for line in out.splitlines() if line.startswith("launch_plan")).split(":")[0]
    )
