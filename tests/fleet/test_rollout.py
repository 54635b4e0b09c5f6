"""The rollout on the simulated fleet: `python -m freetoken_infra.rollout`, exactly as a user runs
it, converging batches with the pyinfra CLI over real SSH.

In order (the tests share the fleet's state):
1. a rollout to ws1..ws3 plus a host nobody answers for: the canary and the batch converge,
   the report lists every host, the unreachable one is parked and ws3 refused, each with why;
2. the same rollout again changes nothing;
3. a canary upgraded to the broken engine 0.2.3 (the wheelhouse stand-in's) fails its health
   gate, is rolled back to 0.2.1 and serves again; the rollout stops and the other hosts are
   untouched;
4. a healthy upgrade (0.2.2) switches over, and a second rollout brings the host back to
   0.2.1, leaving the fleet as it found it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.client import ROOT, api_key, chat, engine_pid, health, report_rows, snapshot_without_guard_samples

pytestmark = pytest.mark.fleet

GONE = ("ws-gone", "10.213.0.250")  # an address on the bridge where no host lives
# Written by the guard timer every 30 s on a converged host: its own sampling, not the deploy.


def rollout(
    tmp_path: Path, *args: str, inventory: str = "inventories/sim.py"
) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"report-{len(list(tmp_path.glob('report-*.json')))}.json"
    run = subprocess.run(
        [sys.executable, "-m", "freetoken_infra.rollout", inventory, "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=1500,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-30000:], run.stderr[-5000:], sep="\n")
    doc = json.loads(out.read_text()) if out.exists() else {}
    return run, doc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rollout")


@pytest.fixture(scope="module")
def first(sim_fleet, workdir):
    """sim.py's hosts plus one at an address where nothing answers, canary then one batch."""
    inventory = workdir / "sim_plus_gone.py"
    inventory.write_text(
        "import runpy\n"
        f"_sim = runpy.run_path({str(ROOT / 'inventories' / 'sim.py')!r})\n"
        f"_gone = ({GONE[0]!r}, {{'ssh_hostname': {GONE[1]!r}}})\n"
        "rtx5060ti_16gb = _sim['rtx5060ti_16gb'] + [_gone]\n"
        "rtx5090_32gb = _sim['rtx5090_32gb']\n"
        f"sim = (_sim['sim'][0] + [{GONE[0]!r}], _sim['sim'][1])\n"
    )
    return rollout(workdir, "--batches", "1,100%", inventory=str(inventory))


def test_rollout_reports_every_host_and_parks_the_unreachable_one(sim_fleet, first):
    run, doc = first
    out = run.stdout
    assert run.returncode == 4, out[-5000:]  # no host failed, one is parked; the rollout ran to its end
    assert doc["batches"] == [["ws1"], ["ws2", "ws3", GONE[0]]] and doc["stopped"] is None
    r = report_rows(doc)
    assert set(r) == {"ws1", "ws2", "ws3", GONE[0]}
    for host in ("ws1", "ws2"):
        profile = sim_fleet.hosts[host].profile
        assert r[host]["result"] == "ok", r[host]
        assert r[host]["gpu"] == profile["gpu"]["name"]
        assert r[host]["vram_gb"] == round(profile["gpu"]["memory_total_mib"] / 1024)
        assert r[host]["wsl_version"] == profile["wsl_version"]
        assert (r[host]["engine_version"], r[host]["health"]) == ("0.2.1", "ok")
        assert r[host]["model"] == "nvidia/Qwen3.6-35B-A3B-NVFP4@main"
        assert r[host]["tokens_per_s"] > 0 and r[host]["restart_pending"] in (True, False)
        assert chat(sim_fleet, host, api_key(sim_fleet, host))["choices"][0]["message"]["content"]
    assert r["ws3"]["result"] == "refused"
    assert r["ws3"]["reason"].startswith("refused at preflight:") and "wsl_version" in r["ws3"]["reason"]
    assert r["ws3"]["wsl_version"] == sim_fleet.hosts["ws3"].profile["wsl_version"]
    assert r[GONE[0]]["result"] == "parked" and r[GONE[0]]["reason"].startswith("unreachable:"), r[GONE[0]]
    # the printed table: a line per host with its state
    table = out[out.index("== fleet report ==") :]
    for host, row in r.items():
        line = next(line for line in table.splitlines() if line.startswith(host + " "))
        assert f"{row['result']}: {row['reason']}" in line
    assert "4 host(s): 2 ok, 1 parked, 1 refused, 0 failed, 0 not run" in table


def test_rerunning_a_finished_rollout_changes_nothing(sim_fleet, first, workdir):
    before = {h: snapshot_without_guard_samples(sim_fleet, h) for h in ("ws1", "ws2", "ws3")}
    pids = {h: engine_pid(sim_fleet, h) for h in ("ws1", "ws2")}
    # The default batches, as the README's "try it" command runs them: ws1, then ws2, then ws3
    # alone (a batch whose only host is refused at preflight still gets its report row).
    run, doc = rollout(workdir)
    assert doc["batches"] == [["ws1"], ["ws2"], ["ws3"]]
    r = report_rows(doc)
    for host in ("ws1", "ws2"):
        assert (r[host]["result"], r[host]["reason"], r[host]["changes"]) == ("ok", "no change", 0), r[host]
        assert r[host]["health"] == "ok" and r[host]["tokens_per_s"] > 0
        assert engine_pid(sim_fleet, host) == pids[host]
    assert r["ws3"]["result"] == "refused"
    assert r["ws3"]["reason"].startswith("refused at preflight:") and "gpu_memory" in r["ws3"]["reason"], r["ws3"]
    assert run.returncode == 5, run.stdout[-5000:]  # every reached host ok or refused, none parked
    for host, snap in before.items():
        assert harness.snapshot_diff(snap, snapshot_without_guard_samples(sim_fleet, host)) == [], host


@pytest.fixture(scope="module")
def broken_canary(sim_fleet, first, workdir):
    before = {h: snapshot_without_guard_samples(sim_fleet, h) for h in ("ws2", "ws3")}
    ws2_pid = engine_pid(sim_fleet, "ws2")
    run, doc = rollout(workdir, "--canary", "ws1", "--data", "engine_version=0.2.3")
    after = {h: snapshot_without_guard_samples(sim_fleet, h) for h in ("ws2", "ws3")}
    return {"run": run, "doc": doc, "before": before, "after": after, "ws2_pid": ws2_pid}


def test_a_failing_canary_stops_the_rollout_and_no_other_host_is_touched(sim_fleet, broken_canary):
    run, doc = broken_canary["run"], broken_canary["doc"]
    assert run.returncode == 3, run.stdout[-5000:]
    assert doc["batches"][0] == ["ws1"] and "canary" in doc["stopped"]
    r = report_rows(doc)
    assert r["ws1"]["result"] == "failed"
    for host in ("ws2", "ws3"):
        assert r[host]["result"] == "not run" and "canary" in r[host]["reason"]
        assert harness.snapshot_diff(broken_canary["before"][host], broken_canary["after"][host]) == [], host
    assert engine_pid(sim_fleet, "ws2") == broken_canary["ws2_pid"]
    assert "rollout batch 2" not in run.stdout  # pyinfra never ran for them


def test_the_broken_upgrade_is_rolled_back_and_the_old_version_serves(sim_fleet, broken_canary):
    row = report_rows(broken_canary["doc"])["ws1"]
    assert row["reason"].startswith("rolled back to 0.2.1: 0.2.3 failed the health gate in the health phase"), row
    assert "scheduler failed after load" in row["reason"]
    assert (row["engine_version"], row["health"]) == ("0.2.1", "ok") and row["tokens_per_s"] > 0
    assert "rolled back to 0.2.1" in broken_canary["run"].stdout  # the deploy's own error says it too
    link = sim_fleet.run("ws1", "readlink /opt/freetoken/active", check=True).stdout.strip()
    assert link == "/opt/freetoken/0.2.1"
    # installed beside: the broken version stays, the service runs the old one
    assert sim_fleet.run("ws1", "test -x /opt/freetoken/0.2.3/bin/python").returncode == 0
    assert health(sim_fleet, "ws1")["version"] == "0.2.1"
    assert chat(sim_fleet, "ws1", api_key(sim_fleet, "ws1"))["choices"][0]["message"]["content"]


def test_a_healthy_upgrade_switches_and_a_rollout_brings_it_back(sim_fleet, broken_canary, workdir):
    run, doc = rollout(workdir, "--limit", "ws1", "--data", "engine_version=0.2.2")
    row = report_rows(doc)["ws1"]
    assert run.returncode == 0, run.stdout[-5000:]
    assert row["result"] == "ok" and row["reason"].endswith("upgraded from 0.2.1"), row
    assert (row["engine_version"], row["health"]) == ("0.2.2", "ok")
    assert health(sim_fleet, "ws1")["version"] == "0.2.2"
    # back to the fleet's version (group_data/all.py), so later modules find ws1 as it was
    run, doc = rollout(workdir, "--limit", "ws1")
    row = report_rows(doc)["ws1"]
    assert run.returncode == 0 and row["engine_version"] == "0.2.1", row
    assert sim_fleet.run("ws1", "readlink /opt/freetoken/active", check=True).stdout.strip() == "/opt/freetoken/0.2.1"
