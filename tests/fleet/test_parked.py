"""Part-time PCs on the simulated fleet: a host that is powered off is parked, not
failed, and a catch-up run converges it when it is back; ``--dry --diff`` previews a change.

In order (the tests share the fleet's state):
1. ws2 powered off (its container stopped, as a PC switched off: nothing answers on its address):
   a rollout of the fleet ends with ws1 ok, ws2 parked, ws3 refused, exit status 4 ("parked"),
   one plain line of why per host that is not ok, and "-" where the deploy did nothing;
2. ws2 powered on: ``--only parked,failed --from REPORT`` converges ws2 only; ws1 and ws3 see
   no change;
3. ``pyinfra --dry --diff`` with one setting changed shows exactly that line of ``.wslconfig``
   and changes nothing; a changed API key shows only masked; the key never appears.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_infra.core import wsl_ini
from tests.fleet import harness
from tests.fleet.client import PYINFRA, ROOT, api_key, chat, engine_pid, report_rows, snapshot_without_guard_samples

pytestmark = pytest.mark.fleet

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def rollout(*args: str, state_home: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """The rollout CLI on the simulated fleet; its report written under `state_home` when it
    is given no --json (as every rollout does: the path is the line ``report: PATH``)."""
    run = subprocess.run(
        [sys.executable, "-m", "freetoken_infra.rollout", "inventories/sim.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=1500,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir()), "XDG_STATE_HOME": str(state_home)},
    )
    print(run.stdout[-30000:], run.stderr[-5000:], sep="\n")
    report = re.findall(r"^report: (.+)$", run.stdout, re.M)
    doc = json.loads(Path(report[-1]).read_text()) if report else {}
    return run, doc


def power_off(fleet, host: str) -> None:
    """Stop the host's container and everything in its network namespace, as a switched-off PC:
    its address stays on the bridge, nothing answers there."""
    h = fleet.state["hosts"][host]
    harness._stop_pid(h["pid"], "systemd-nspawn", term_wait=20)
    harness._kill_netns_processes(h["netns"])
    assert fleet.run(host, "true", timeout=30).returncode != 0, f"{host} still answers"


def power_on(fleet, host: str) -> None:
    state = fleet.state
    if harness._alive(state["hosts"][host]["pid"]):
        return
    harness._start_container(state, host)
    harness._wait_booted(state, [host], harness.BOOT_TIMEOUT_S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("parked")


@pytest.fixture(scope="module")
def parked(sim_fleet, workdir):
    """A rollout of the fleet (the README's default batches: ws1, then ws2, then ws3) while ws2
    is off; ws2 is powered on again when the module ends whatever happened."""
    power_off(sim_fleet, "ws2")
    try:
        yield rollout("--json", str(workdir / "parked.json"), state_home=workdir)
    finally:
        power_on(sim_fleet, "ws2")


def test_a_powered_off_host_is_parked_not_failed(sim_fleet, parked, workdir):
    run, doc = parked
    out = run.stdout
    assert run.returncode == 4, out[-5000:]
    assert doc["batches"] == [["ws1"], ["ws2"], ["ws3"]] and doc["stopped"] is None
    assert doc == json.loads((workdir / "parked.json").read_text())
    r = report_rows(doc)
    assert (r["ws1"]["result"], r["ws1"]["health"]) == ("ok", "ok") and r["ws1"]["tokens_per_s"] > 0
    assert r["ws2"]["result"] == "parked" and r["ws2"]["reason"].startswith("unreachable: "), r["ws2"]
    assert r["ws3"]["result"] == "refused", r["ws3"]
    assert r["ws3"]["reason"].startswith("refused at preflight:") and "wsl_version" in r["ws3"]["reason"]
    # the deploy did nothing on ws2 and ws3: what it would have done shows "-", never "restart: yes"
    for host in ("ws2", "ws3"):
        assert r[host]["restart_pending"] is None and r[host]["health"] == "-", r[host]
        assert r[host]["model"] is None and r[host]["tokens_per_s"] is None, r[host]
    table = out[out.index("== fleet report ==") :]
    for host in ("ws2", "ws3"):
        line = next(line for line in table.splitlines() if line.startswith(host + " "))
        cells = line.split(f"  {r[host]['result']}:")[0].split()
        assert cells[-4:] == ["-", "-", "-", "-"], line  # model, health, tok/s, restart
    assert "3 host(s): 1 ok, 1 parked, 1 refused, 0 failed, 0 not run" in table
    # each batch ends with one plain line of why; no pyinfra error reads like a crash of ours
    assert "    ws2 parked: unreachable: " in out
    assert "    ws3 refused: refused at preflight: " in out
    assert "pyinfra error" not in out and "no host left to deploy to" not in out
    assert "--> no host could be reached (ws2; " in out  # ws2's batch: pyinfra reached no host
    assert "catch up later: python -m freetoken_infra.rollout inventories/sim.py --only parked,failed " in out
    assert "exit status 4: " in out and "parked" in out.rstrip().splitlines()[-1]


@pytest.fixture(scope="module")
def caught_up(sim_fleet, parked, workdir):
    power_on(sim_fleet, "ws2")
    before = {h: snapshot_without_guard_samples(sim_fleet, h) for h in ("ws1", "ws3")}
    pid = engine_pid(sim_fleet, "ws1")
    run, doc = rollout("--only", "parked,failed", "--from", str(workdir / "parked.json"), state_home=workdir)
    after = {h: snapshot_without_guard_samples(sim_fleet, h) for h in ("ws1", "ws3")}
    return run, doc, before, after, pid


def test_the_catch_up_converges_only_the_parked_host(sim_fleet, caught_up, workdir):
    run, doc, before, after, pid = caught_up
    assert run.returncode == 0, run.stdout[-5000:]
    assert f"--> catch-up of {workdir / 'parked.json'}: ws2 (parked or failed there)" in run.stdout
    assert doc["batches"] == [["ws2"]] and doc["caught_up_from"] == str(workdir / "parked.json")
    # written without --json, where every rollout writes its report
    assert list((workdir / "freetoken-infra" / "rollouts").glob("rollout-*.json"))
    row = report_rows(doc)["ws2"]
    assert (row["result"], row["health"]) == ("ok", "ok") and row["tokens_per_s"] > 0, row
    assert chat(sim_fleet, "ws2", api_key(sim_fleet, "ws2"))["choices"][0]["message"]["content"]
    # the rest see no change: pyinfra never ran for them
    assert "--limit ws1" not in run.stdout and "--limit ws3" not in run.stdout
    for host in ("ws1", "ws3"):
        assert harness.snapshot_diff(before[host], after[host]) == [], host
    assert engine_pid(sim_fleet, "ws1") == pid


def wslconfig_line(fleet, host: str, key: str) -> str:
    """The `key` line of the host's .wslconfig, as the user's file spells it."""
    data = fleet.run(host, "base64 -w0 /mnt/c/Users/*/.wslconfig", check=True).stdout
    text = wsl_ini.decode(base64.b64decode(data), wsl_ini.WSLCONFIG)[0]
    return next(line.strip() for line in text.splitlines() if line.split("=")[0].strip().lower() == key)


def preview(*extra: str, env: dict | None = None) -> str:
    """``pyinfra --dry --diff`` on ws1 (no -y: pyinfra's change detection shows the diffs)."""
    run = subprocess.run(
        [PYINFRA, "--dry", "--diff", *extra, "inventories/sim.py", "deploys/freetoken.py", "--limit", "ws1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir()), **(env or {})},
    )
    out = _ANSI.sub("", run.stdout + run.stderr)
    print(out[-20000:])
    assert run.returncode == 0, out[-5000:]
    return out


def diff_lines(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if re.match(r"\s+[-+] ", line)]


def test_dry_diff_shows_the_one_changed_wslconfig_line_and_changes_nothing(sim_fleet, caught_up):
    before = snapshot_without_guard_samples(sim_fleet, "ws1")
    key = api_key(sim_fleet, "ws1")
    line = wslconfig_line(sim_fleet, "ws1", "memory")
    name, value = line.split("=", 1)
    new = "20GB" if value.strip() != "20GB" else "18GB"
    out = preview("--data", f"wslconfig_memory={new}")
    assert re.search(r"\[ws1\] Will modify /mnt/c/Users/[^/]+/\.wslconfig", out), out[-5000:]
    assert diff_lines(out) == [f"- {line}", f"+ {name}={new}"]
    assert key not in out
    assert harness.snapshot_diff(before, snapshot_without_guard_samples(sim_fleet, "ws1")) == []
    assert wslconfig_line(sim_fleet, "ws1", "memory") == line


def test_dry_diff_of_a_changed_api_key_is_masked(sim_fleet, caught_up):
    before = snapshot_without_guard_samples(sim_fleet, "ws1")
    key = api_key(sim_fleet, "ws1")
    new_key = "ft-preview-" + key[::-1][:12]
    out = preview("--data", "api_key_source=env:FT_PREVIEW_KEY", env={"FT_PREVIEW_KEY": new_key})
    assert "[ws1] Will modify /etc/freetoken/api-key.env" in out, out[-5000:]
    assert diff_lines(out) == ["- FREETOKEN_API_KEY=********", "+ FREETOKEN_API_KEY=******** (changed)"]
    assert key not in out and new_key not in out
    assert harness.snapshot_diff(before, snapshot_without_guard_samples(sim_fleet, "ws1")) == []
    assert api_key(sim_fleet, "ws1") == key


def test_dry_diff_holding_index_and_hub_credentials_prints_none_of_them(sim_fleet, caught_up):
    """A preview whose settings carry credentials (pip index, hub endpoint) and
    a new engine key shows the files that change (pip.conf, the engine's environment, the key
    file) with every secret masked, old or new, and changes nothing."""
    state = json.loads(harness.state_file().read_text())
    index, hub = state["services"]["wheelhouse"]["url"], state["services"]["hub"]["url"]
    with_pw = lambda url, pw: re.sub(r"^(\w+://)", rf"\1builder:{pw}@", url)  # noqa: E731
    before = snapshot_without_guard_samples(sim_fleet, "ws1")
    key = api_key(sim_fleet, "ws1")
    new_key = "ft-preview-" + key[::-1][:12]
    out = preview(
        "--data",
        f"pip_index_url={with_pw(index, 'PW-index-8c1f')}",
        "--data",
        f"hub_endpoint={with_pw(hub, 'PW-hub-42ad')}",
        "--data",
        "api_key_source=env:FT_PREVIEW_KEY",
        env={"FT_PREVIEW_KEY": new_key},
    )
    assert re.search(r"\[ws1\] Will modify /opt/freetoken/[^/]+/pip\.conf", out), out[-5000:]
    assert (
        "[ws1] Will modify /etc/freetoken/engine.env" in out and "[ws1] Will modify /etc/freetoken/api-key.env" in out
    )
    for secret in ("PW-index-8c1f", "PW-hub-42ad", key, new_key):
        assert secret not in out
    assert "builder:********@" in out
    assert harness.snapshot_diff(before, snapshot_without_guard_samples(sim_fleet, "ws1")) == []
