"""The read-only doctor across the simulated fleet: `pyinfra -y inventories/sim.py deploys/doctor.py`.

One findings table per host and a fleet summary of the hosts in the run; ws3 (WSL 2.6.1 with
the WDDM allocation lock, pitfall 4B) is blocked, ws1 and ws2 pass or warn, the run exits
non-zero; under `--limit ws1` the summary covers that one host and the run exits 0. The doctor
changes nothing on any host (the harness's snapshot, before and after, less what a converged
host's guard timer writes on its own every 30 s).
"""

from __future__ import annotations

import os
import re
import subprocess

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
