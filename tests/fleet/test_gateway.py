"""The fleet as one OpenAI endpoint (deploys/gateway.py): the simulated fleet's gateway host
(plain Debian, HAProxy from Debian through the fleet's apt proxy) in front of ws1 and ws2 (ws3 is
refused at preflight and never serves: it stays parked).

Molecule's sequence: the workstations converge with their engines on every address and the
fleet's one engine key, the gateway converges, converges again (nothing changes), then requests
go through it: keys, stats, sessions, the fleet CLI, and a steady load while ws1's engine is
killed, ws1 is powered off and back on, drained and upgraded by a rollout, and the gateway
reloads. At the end the gateway host is removed and ws1/ws2 converge back to the default
settings, as the other test modules expect them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

import pytest

from tests.fleet import client, harness
from tests.fleet.gateway_load import (
    CLIENT_KEY,
    ENGINE_KEY,
    PORT,
    STATS_PORT,
    Load,
    Watcher,
    converge_behind_gateway,
    data_args,
    pyinfra,
    session_on,
    stream_chat,
    summary,
    write_keys,
)
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME

ROOT = client.ROOT
OTHER_KEY = "sim-client-key-bob-9876543210ab"
# The engine's main process dies at once (systemd restarts it: Restart=on-failure).
KILL_ENGINE = "kill -9 $(systemctl show -p MainPID --value freetoken.service)"


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return write_keys(tmp_path_factory.mktemp("gateway") / "keys")


def deploy_gateway(keys) -> subprocess.CompletedProcess:
    return pyinfra(*data_args(keys), "inventories/sim.py", "deploys/gateway.py", "--limit", "gateway")


def fleet_cli(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "freetoken_infra.fleet", "-i", "inventories/sim.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout, run.stderr)
    return run


@pytest.fixture(scope="module")
def gateway(sim_fleet, keys):
    harness.start_gateway()
    try:
        hosts, first = converge_behind_gateway(keys)
        assert hosts.returncode == 0, "the workstations did not converge behind the gateway"
        yield {"fleet": sim_fleet, "first": first}
    finally:
        harness.stop_gateway()
        # Back to the default settings (engines on loopback), as the other modules expect them.
        client.deploy("--limit", "ws1", "--limit", "ws2")


def wait_in_service(fleet, hosts, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = {s["host"]: s["state"] for s in status_rows(fleet)}
        if all(states.get(h) == "in service" for h in hosts):
            return
        time.sleep(1)
    raise AssertionError(f"not in service within {timeout}s: {states}")


def eventually(check, timeout: float = 15) -> bool:
    """True once `check()` is (HAProxy's reload returns before the new worker serves)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return False


def status_rows(fleet) -> list[dict]:
    from freetoken_infra.fleet import parse_stat, runtime_command

    out = fleet.run(GATEWAY_NAME, runtime_command("show stat"), check=True).stdout
    return [{"host": s.host, "state": s.state, "active": s.active} for s in parse_stat(out)]


def test_the_gateway_converges_validated_and_a_second_run_changes_nothing(gateway, keys):
    fleet = gateway["fleet"]
    assert gateway["first"].returncode == 0
    assert fleet.run(GATEWAY_NAME, "haproxy -c -q -f /etc/haproxy/haproxy.cfg").returncode == 0
    assert fleet.run(GATEWAY_NAME, "systemctl is-active haproxy").stdout.strip() == "active"
    for path in ("/etc/haproxy/freetoken-gateway-keys.map", "/etc/haproxy/freetoken-engine-key.map"):
        assert fleet.run(GATEWAY_NAME, f"stat -c '%a %U' {path}").stdout.split() == ["600", "root"]
    before = fleet.snapshot(GATEWAY_NAME)
    again = deploy_gateway(keys)
    assert again.returncode == 0 and client.grand_total(again)[1] in ("-", "0")
    assert harness.snapshot_diff(before, fleet.snapshot(GATEWAY_NAME)) == []


# From the gateway host, with its own python3 (the base image has no curl): the body of a GET.
FETCH = "python3 -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=10).read().decode())' "


def test_the_generated_scrape_config_targets_serve_the_guards_metrics_and_a_rerun_changes_nothing(gateway, keys):
    """Item 8: every node_exporter target of the scrape config the gateway deploy wrote answers,
    from the gateway host, with the guard's samples; it listens there only (not on every
    interface); a second converge of the workstations changes nothing."""
    import yaml

    from freetoken_infra.core.layout import GATEWAY_SCRAPE_CONFIG, NODE_EXPORTER_DROPIN, NODE_EXPORTER_UNIT

    fleet = gateway["fleet"]
    scrape = yaml.safe_load(fleet.run(GATEWAY_NAME, f"cat {GATEWAY_SCRAPE_CONFIG}", check=True).stdout)
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    targets = {c["labels"]["host"]: c["targets"] for c in jobs["freetoken-guard"]["static_configs"]}
    # Every backend, ws3 too (parked: refused at preflight, its target down until it serves).
    assert set(targets) == {"ws1", "ws2", "ws3"}, targets
    for host in ("ws1", "ws2"):
        (target,) = targets[host]
        metrics: list[str] = []

        def guard_lines(target=target, metrics=metrics) -> bool:
            r = fleet.run(GATEWAY_NAME, FETCH + shlex.quote(f"http://{target}/metrics"))
            metrics[:] = [line for line in r.stdout.splitlines() if line.startswith("freetoken_guard_")]
            return r.returncode == 0 and bool(metrics)

        # The guard's timer writes its first samples within its interval (30 s).
        assert eventually(guard_lines, timeout=90), f"{host}: no guard metrics at {target}"
        assert any(line.startswith("freetoken_guard_tripped") for line in metrics), metrics
        assert not any(ENGINE_KEY in line or CLIENT_KEY in line for line in metrics)
        listening = fleet.run(host, "ss -Hltn 'sport = :9100'", check=True).stdout.split()
        assert target in listening and "*:9100" not in listening and "0.0.0.0:9100" not in listening, listening

    # Not restarted by a run that changes nothing: same process, same drop-in.
    probe = f"systemctl show -p MainPID --value {NODE_EXPORTER_UNIT}; stat -c %Y {NODE_EXPORTER_DROPIN}"
    before = {h: fleet.run(h, probe, check=True).stdout for h in ("ws1", "ws2")}
    again = pyinfra(*data_args(keys), "inventories/sim.py", "deploys/freetoken.py", "--limit", "ws1", "--limit", "ws2")
    assert again.returncode == 0 and client.grand_total(again)[1] in ("-", "0")
    assert {h: fleet.run(h, probe, check=True).stdout for h in ("ws1", "ws2")} == before


def test_requests_through_the_gateway_reach_the_serving_hosts_and_ws3_is_parked(gateway):
    wait_in_service(gateway["fleet"], ["ws1", "ws2"])
    hosts = {stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY).host for _ in range(8)}
    assert hosts == {"ws1", "ws2"}
    assert {s["host"]: s["state"] for s in status_rows(gateway["fleet"])}["ws3"] == "parked"


def _get(url: str, key: str | None = None) -> int:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_wrong_or_missing_key_is_refused(gateway):
    base = f"http://{GATEWAY_ADDRESS}:{PORT}"
    assert _get(base + "/v1/models", CLIENT_KEY) == 200
    assert _get(base + "/v1/models", ENGINE_KEY) == 401  # the engines' key is not a client key
    assert _get(base + "/v1/models", "sim-client-key-mallory-000000") == 401
    assert _get(base + "/v1/models") == 401
    assert _get(base + "/health") == 200  # like the engines' own /health


def test_the_stats_page_is_not_reachable_from_another_host_without_a_key(gateway):
    fleet = gateway["fleet"]
    script = (
        "import sys,urllib.request,urllib.error\n"
        "key=sys.stdin.readline().strip()\n"
        "for path,k in (('/stats',None),('/metrics',None),('/stats','x'*20),('/metrics',key)):\n"
        "  h={'Authorization':'Bearer '+k} if k else {}\n"
        "  try: print(urllib.request.urlopen(urllib.request.Request("
        f"'http://{GATEWAY_ADDRESS}:{STATS_PORT}'+path,headers=h),timeout=10).status)\n"
        "  except urllib.error.HTTPError as e: print(e.code)\n"
    )
    r = subprocess.run(
        fleet.ssh_argv("ws1") + ["python3", "-c", shlex.quote(script)],
        input=CLIENT_KEY + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.split() == ["401", "401", "401", "200"], r.stderr


def test_the_engine_key_is_in_no_argv_log_or_stats_page(gateway):
    # Compared on the gateway host, the key on stdin (never in an argument).
    script = (
        "import sys,os,subprocess,urllib.request\n"
        "key=sys.stdin.readline().strip();client=sys.stdin.readline().strip()\n"
        "argv=[open(f'/proc/{p}/cmdline','rb').read() for p in os.listdir('/proc') if p.isdigit()"
        " and os.path.exists(f'/proc/{p}/cmdline')]\n"
        "journal=subprocess.run(['journalctl','--no-pager','-o','cat'],capture_output=True).stdout\n"
        "req=urllib.request.Request('http://127.0.0.1:8404/stats;csv',\n"
        "  headers={'Authorization':'Bearer '+client})\n"
        "stats=urllib.request.urlopen(req,timeout=10).read()\n"
        "k=key.encode();c=client.encode()\n"
        "print(any(k in a for a in argv), k in journal, k in stats, c in journal)\n"
    )
    r = subprocess.run(
        gateway["fleet"].ssh_argv(GATEWAY_NAME) + ["python3", "-c", shlex.quote(script)],
        input=f"{ENGINE_KEY}\n{CLIENT_KEY}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.split() == ["False", "False", "False", "False"], r.stderr


def test_same_session_stays_on_one_host_and_moves_when_that_host_is_parked(gateway):
    fleet = gateway["fleet"]
    wait_in_service(fleet, ["ws1", "ws2"])
    hosts = [
        stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY, max_tokens=4, session="conversation-42").host for _ in range(20)
    ]
    home = max(set(hosts), key=hosts.count)
    assert hosts.count(home) >= 18, hosts  # >= 90 % on one host
    other = {"ws1": "ws2", "ws2": "ws1"}[home]
    fleet.run(home, "systemctl stop freetoken.service", check=True)  # the PC goes to play/sleep
    try:
        moved = [
            stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY, max_tokens=4, session="conversation-42") for _ in range(10)
        ]
        assert all(o.ok for o in moved), [o.error for o in moved]
        assert {o.host for o in moved} == {other}
        assert {s["host"]: s["state"] for s in status_rows(fleet)}[home] == "parked"
    finally:
        fleet.run(home, "systemctl start freetoken.service", check=True)
    wait_in_service(fleet, [home])


def test_fleet_cli_drains_readies_and_prints_one_status_table(gateway, keys):
    fleet = gateway["fleet"]
    wait_in_service(fleet, ["ws1", "ws2"])
    run = fleet_cli("status")
    assert run.returncode == 0
    rows = {line.split()[0]: line for line in run.stdout.splitlines() if line.startswith("ws")}
    assert "in service" in rows["ws1"] and "in service" in rows["ws2"] and "parked" in rows["ws3"]
    assert float(rows["ws1"].split()[-1]) > 0  # decode tok/s of ws1's last health gate
    assert fleet_cli("drain", "ws1").returncode == 0
    try:
        assert {s["host"]: s["state"] for s in status_rows(fleet)}["ws1"] == "draining"
        hosts = {stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY, max_tokens=4, session=f"s{i}").host for i in range(10)}
        assert hosts == {"ws2"}  # new requests, sessions too, go elsewhere
        # A config change reloads HAProxy: the drained host stays drained.
        keys["clients"].write_text(keys["clients"].read_text() + "sim-client-key-carol-5555555555 carol\n")
        assert deploy_gateway(keys).returncode == 0
        assert eventually(lambda: stream_chat(GATEWAY_ADDRESS, PORT, "sim-client-key-carol-5555555555").ok)
        assert {s["host"]: s["state"] for s in status_rows(fleet)}["ws1"] == "draining"
    finally:
        assert fleet_cli("ready", "ws1").returncode == 0
    wait_in_service(fleet, ["ws1"])
    bad = fleet_cli("drain", "ws9")
    assert bad.returncode == 1 and "ws9: not a backend of the gateway" in bad.stderr


def test_under_load_kill_power_off_sleep_drain_upgrade_and_reload_fail_no_unstarted_request(gateway, keys):
    fleet = gateway["fleet"]
    wait_in_service(fleet, ["ws1", "ws2"])
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    figures: dict[str, float] = {}
    phases: dict[str, tuple[float, float]] = {}
    try:
        # A conversation on each host (retried elsewhere when its host goes) and two clients
        # without a session (the least busy host).
        sessions = [session_on(h, GATEWAY_ADDRESS, PORT, CLIENT_KEY) for h in ("ws1", "ws2")]
        with Load(
            GATEWAY_ADDRESS,
            PORT,
            CLIENT_KEY,
            clients=4,
            max_tokens=24,
            max_requests=20000,
            max_seconds=900,
            sessions=sessions,
        ) as load:
            time.sleep(3)
            # 1. ws1's engine is killed (systemd restarts it; it rejoins after its checks).
            t = time.time()
            fleet.run("ws1", KILL_ENGINE, check=True)
            out = watcher.wait_for("ws1", lambda s: not s.startswith("UP"), t, 30)
            assert out is not None, watcher.events
            figures["engine killed: out of service after s"] = out - t
            assert watcher.wait_for("ws1", lambda s: s == "UP", out, 120), watcher.events
            # 2. ws1 is powered off, then on again (its engine starts at boot).
            t = time.time()
            fleet.power_off("ws1")
            out = watcher.wait_for("ws1", lambda s: not s.startswith("UP"), t, 30)
            assert out is not None, watcher.events
            figures["powered off: out of service after s"] = out - t
            time.sleep(5)
            t = time.time()
            fleet.power_on("ws1")
            back = watcher.wait_for("ws1", lambda s: s == "UP", t, 180)
            assert back, watcher.events
            figures["powered on: back in service after s"] = back - t
            # 3. ws1 goes silent (its network gone, as a PC that falls asleep): nothing refused,
            # nothing answered; its checks time out. Then it wakes up.
            t = time.time()
            fleet.set_network("ws1", up=False)
            try:
                out = watcher.wait_for("ws1", lambda s: not s.startswith("UP"), t, 30)
                assert out is not None, watcher.events
                figures["silent (asleep): out of service after s"] = out - t
            finally:
                fleet.set_network("ws1", up=True)
            assert watcher.wait_for("ws1", lambda s: s == "UP", out, 60), watcher.events
            # 4. A rollout upgrades ws1's engine: drained first, ready after its gate.
            t = time.time()
            roll = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "freetoken_infra.rollout",
                    "inventories/sim.py",
                    "--limit",
                    "ws1",
                    *data_args(keys),
                    "--data",
                    "engine_version=0.2.2",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=1500,
                env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
            )
            print(roll.stdout[-8000:], roll.stderr[-3000:])
            assert roll.returncode == 0
            assert "--> gateway: draining ws1" in roll.stdout and "--> gateway: ws1 ready" in roll.stdout
            assert watcher.wait_for("ws1", lambda s: s == "UP", t, 60), watcher.events
            phases["rollout"] = (t, time.time())
            # 5. The gateway's config changes (a new client key): validated, reloaded under load.
            keys["clients"].write_text(keys["clients"].read_text() + f"{OTHER_KEY} bob\n")
            t = time.time()
            assert deploy_gateway(keys).returncode == 0
            phases["reload"] = (t, time.time())
            assert eventually(lambda: stream_chat(GATEWAY_ADDRESS, PORT, OTHER_KEY).ok)
            time.sleep(3)
        outcomes = load.stop()
    finally:
        watcher.close()
    result = summary(outcomes)
    in_phase = lambda name: [  # noqa: E731
        o for o in outcomes if o.t1 >= phases[name][0] and o.t0 <= phases[name][1]
    ]
    print(
        f"gateway under load: {result['requests']} requests, {result['ok']} ok, "
        f"by host {result['by_host']}; "
        f"failed before streaming: {len(result['failed_before_streaming'])}, "
        f"cut while streaming: {len(result['failed_while_streaming'])}"
    )
    for name, seconds in figures.items():
        print(f"  {name}: {seconds:.2f}")
    assert result["failed_before_streaming"] == []  # zero failed requests that had not started
    assert result["by_host"].get("ws1") and result["by_host"].get("ws2")
    # Drained before its engine was touched and put back after its gate; a reload drops nothing.
    for name in ("rollout", "reload"):
        assert in_phase(name), f"no request during the {name}"
        assert all(o.ok for o in in_phase(name)), [o.error for o in in_phase(name) if not o.ok]
