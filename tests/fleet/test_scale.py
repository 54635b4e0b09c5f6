"""A fleet of 12 simulated hosts (FREETOKEN_SIM_HOSTS=12 scale): hosts beyond ws3 repeat the healthy
profiles (tests/fleet/profiles.py), each with its own name, address and GPU UUID.

The fast part checks the profile cycling and address allocation without any host. The slow part
(marker `slow`) brings up its own 12-host fleet, whatever fleet the session holds (it is
brought back afterwards, fresh, for the modules after this one), and rolls the deploy out to it as
a user would: `python -m freetoken_infra.rollout inventories/sim.py --batches 1,25%,100%` with ws1
as the LAN model cache. Then: every host but ws3 (refused at preflight by design) serves, the hub
sent the model once for the whole fleet, the same rollout again changes nothing and reads nothing
from the hub, and a no-op whole-fleet converge sends at most 2 remote commands per host (counted by
bench/converge.py's --pyinfra-hook mode, which records every call pyinfra's SSH connector makes).
Timings and memory are printed (figures, not assertions: bench/converge.py, bench/rollout.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.fleet import client, harness
from tests.fleet.client import ROOT, health, hub
from tests.fleet.profiles import (
    BRIDGE_ADDRESS,
    MAX_HOSTS,
    PROFILES,
    host_address,
    profile_for,
)
from tests.fleet.standins import hub_repos

pytestmark = pytest.mark.fleet

SCALE_HOSTS = 12
REFUSED = "ws3"
CACHE = ("--data", "model_cache_host=ws1")
# 25 % of 12 hosts is 3: the second batch is ws2, ws3, ws4, and ws3's refusal is 1 of 3.
MAX_FAIL_PCT = "50"


def test_hosts_beyond_the_profiles_repeat_the_healthy_ones(monkeypatch):
    names = harness.host_names(SCALE_HOSTS)
    profiles = {n: profile_for(n) for n in names}
    assert [p.name for p in profiles.values()] == names
    for name in PROFILES:
        assert profiles[name] == PROFILES[name]
    # ws4 like ws1, ws5 like ws2, ws6 like ws1, ...: only name, GPU UUID and notes differ
    for number in range(4, SCALE_HOSTS + 1):
        p = profiles[f"ws{number}"]
        base = PROFILES["ws1" if number % 2 == 0 else "ws2"]
        assert replace(p, name=base.name, gpu=replace(p.gpu, uuid=base.gpu.uuid), notes=base.notes) == base
        assert p.healthy
    assert [n for n, p in profiles.items() if not p.healthy] == [REFUSED]
    assert len({p.gpu.uuid for p in profiles.values()}) == SCALE_HOSTS
    addresses = [host_address(n) for n in names]
    assert len(set(addresses)) == SCALE_HOSTS and BRIDGE_ADDRESS not in addresses
    assert all(a.rsplit(".", 1)[0] == BRIDGE_ADDRESS.rsplit(".", 1)[0] for a in addresses)
    assert int(host_address(f"ws{MAX_HOSTS}").rsplit(".", 1)[1]) <= 254
    monkeypatch.setenv("FREETOKEN_SIM_HOSTS", str(SCALE_HOSTS))
    assert harness.host_count() == SCALE_HOSTS
    monkeypatch.setenv("FREETOKEN_SIM_HOSTS", str(MAX_HOSTS + 1))
    with pytest.raises(harness.FleetError, match="FREETOKEN_SIM_HOSTS"):
        harness.host_count()


def fleet_needed_later(session: pytest.Session) -> bool:
    """Whether a test after the last slow one uses the session's fleet (tests/fleet/conftest.py
    orders the slow tests last, so in a whole run none does)."""
    items = session.items
    last_slow = max((i for i, item in enumerate(items) if item.get_closest_marker("slow")), default=-1)
    return any("sim_fleet" in getattr(item, "fixturenames", ()) for item in items[last_slow + 1 :])


@pytest.fixture(scope="module")
def fleet12(request) -> Iterator[harness.Fleet]:
    """A fresh fleet of 12 hosts for this module; the fleet that was up before (the session's)
    comes back afterwards with as many hosts, fresh, when a later test needs it."""
    if os.geteuid() != 0:
        pytest.skip("the simulated fleet needs root (systemd-nspawn, network namespaces)")
    with harness.exclusive():
        before = harness.load_state()
        previous = len(before["hosts"]) if before else 0
        fleet = harness.up(SCALE_HOSTS)  # what was up is torn down first
        try:
            yield fleet
        finally:
            harness.down()
            if previous and fleet_needed_later(request.session):
                harness.up(previous)
            elif not previous:
                left = client.leftovers()
                assert not left, "the 12-host fleet's teardown left these behind:\n  " + "\n  ".join(left)


def rollout(tmp_path: Path, name: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp_path / f"{name}.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "freetoken_infra.rollout",
            "inventories/sim.py",
            "--batches",
            "1,25%,100%",
            *CACHE,
            "--max-fail-pct",
            MAX_FAIL_PCT,
            "--json",
            str(report),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=3000,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
    return run, json.loads(report.read_text()) if report.exists() else {}


def upstream_bytes(fleet: harness.Fleet) -> int:
    return sum(hub(fleet, "/_standin/stats")["by_file"].values())


def model_size() -> int:
    return sum(len(b) for b in hub_repos.repo_files(hub_repos.SUPPORTED_REPO).values())


@pytest.fixture(scope="module")
def rolled_out(fleet12, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, int]:
    run, doc = rollout(tmp_path_factory.mktemp("scale"), "first")
    return run, doc, upstream_bytes(fleet12)


@pytest.mark.slow
def test_twelve_hosts_boot_as_their_profiles(fleet12):
    assert sorted(fleet12.hosts) == sorted(harness.host_names(SCALE_HOSTS))
    for name, host in fleet12.hosts.items():
        p = profile_for(name)
        r = fleet12.run(
            name, "hostname; /usr/lib/wsl/lib/nvidia-smi --query-gpu=name,uuid --format=csv,noheader", check=True
        )
        assert r.stdout == f"{name}\n{p.gpu.name}, {p.gpu.uuid}\n"
        assert host.address == host_address(name)
    from bench.fleet_up import format_memory, host_memory

    print(format_memory("booted, idle", host_memory(), None))


@pytest.mark.slow
def test_a_rollout_of_twelve_serves_every_allowed_host_and_reads_the_hub_once(fleet12, rolled_out):
    run, doc, sent = rolled_out
    rows = {r["host"]: r for r in doc["hosts"]}
    assert sorted(rows) == sorted(harness.host_names(SCALE_HOSTS)), run.stdout[-3000:]
    assert [len(b) for b in doc["batches"]] == [1, 3, 8]
    assert not doc["stopped"], doc["stopped"]
    assert rows[REFUSED]["result"] != "ok"
    assert {h for h, r in rows.items() if r["result"] == "ok"} == set(rows) - {REFUSED}, run.stdout[-5000:]
    for name in rows:
        if name != REFUSED:
            assert health(fleet12, name).get("status") == "ok", name
    assert sent == model_size(), f"the hub sent {sent} bytes for a model of {model_size()}"
    from bench.fleet_up import format_memory, host_memory

    print(format_memory("converged, engines serving", host_memory(), None))


@pytest.mark.slow
def test_the_same_rollout_again_changes_nothing(fleet12, rolled_out, tmp_path):
    hub(fleet12, "/_standin/reset", {})
    run, doc = rollout(tmp_path, "again")
    rows = {r["host"]: r for r in doc["hosts"]}
    for name, row in rows.items():
        if name != REFUSED:
            assert (row["result"], row["reason"]) == ("ok", "no change"), (name, row)
    assert upstream_bytes(fleet12) == 0


@pytest.mark.slow
def test_a_no_op_converge_of_twelve_sends_at_most_two_commands_per_serving_host(fleet12, rolled_out, tmp_path):
    # The first run after a first converge reads the checksums of the files that converge created
    # one by one (facts/batch.py learns them then): the steady no-op run is the one after it.
    client.deploy(*CACHE)
    out = tmp_path / "calls.json"
    run = subprocess.run(
        [
            sys.executable,
            "bench/converge.py",
            "--pyinfra-hook",
            str(out),
            "--",
            "-y",
            *CACHE,
            "inventories/sim.py",
            "deploys/freetoken.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-5000:], run.stderr[-3000:], sep="\n")
    total = client.parse_grand_total(run.stdout + run.stderr)
    assert total is not None and total[1] == "-", "a no-op converge changed something"
    calls = json.loads(out.read_text())["calls"]
    # A serving host: at most the host lock with every fact in one round trip and the lock's
    # release; one command (the lock's fast check) once its last run recorded a converge. ws3,
    # refused by its old WSL (a blocker that stands until WSL's update restarts its VM), is
    # answered from its record in one command: not even its GPU memory probe runs again.
    commands = Counter(c["host"] for c in calls if c["call"] != "connect")
    assert sorted(commands) == sorted(harness.host_names(SCALE_HOSTS))
    assert max(commands.values()) <= 2, dict(commands)
    assert commands[REFUSED] == 1 and not [c for c in calls if c["label"] == "GpuMemoryProbe"], dict(commands)
    assert f"[{REFUSED}] refused, unchanged since its last full read" in run.stdout + run.stderr
