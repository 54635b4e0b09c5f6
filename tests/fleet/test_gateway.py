"""The fleet as one OpenAI endpoint (deploys/gateway.py): the simulated fleet's gateway host
(plain Debian, HAProxy from Debian through the fleet's apt proxy) in front of ws1 and ws2 (ws3 is
refused at preflight and never serves: it stays parked).

Molecule's sequence: the workstations converge with their engines on every address and the
fleet's one engine key, the gateway converges, converges again (nothing changes), then requests
go through it: keys, stats, sessions, the fleet CLI, and a steady load while ws1's engine is
killed, ws1 is powered off and back on, drained and upgraded by a rollout, and the gateway
reloads. At the end the gateway host is removed and ws1/ws2 converge back to the default
settings, as the other test modules expect them.

Attacks on the gateway's LAN: a key taken from ws1 opens no other
engine (the workstations' firewall admits the engine port from the gateway and loopback only),
node_exporter answers the gateway only, a keyless engine on the LAN is refused, HTTPS on the
client side, and `--dry --diff` of the gateway prints no key. The scrape key
opens the metrics only, a client key no metrics."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

from tests.fleet import client, harness
from tests.fleet.gateway_load import (
    CLIENT_KEY,
    ENGINE_KEY,
    METRICS_KEY,
    PORT,
    STATS_PORT,
    Load,
    Watcher,
    data_args,
    openai_chat,
    pyinfra,
    session_on,
    stream_chat,
    summary,
)
from tests.fleet.profiles import BRIDGE_ADDRESS, GATEWAY_ADDRESS, GATEWAY_NAME, host_address

pytestmark = pytest.mark.fleet

ROOT = client.ROOT
OTHER_KEY = "sim-client-key-bob-9876543210ab"
# The engine's main process dies at once (systemd restarts it: Restart=on-failure).
KILL_ENGINE = "kill -9 $(systemctl show -p MainPID --value freetoken.service)"


@pytest.fixture(scope="module")
def keys(gateway_fleet):
    return gateway_fleet.up()["keys"]


def deploy_gateway(keys, *extra: str) -> subprocess.CompletedProcess:
    return pyinfra(*data_args(keys), *extra, "inventories/sim.py", "deploys/gateway.py", "--limit", "gateway")


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
def gateway(gateway_fleet):
    """The shared gateway fleet (tests/fleet/conftest.py): ws1 and ws2 behind the gateway host."""
    shared = gateway_fleet.up()
    return {"fleet": shared["fleet"], "first": shared["first"]}


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
    for path in (
        "/etc/haproxy/freetoken-gateway-keys.map",
        "/etc/haproxy/freetoken-engine-key.map",
        "/etc/haproxy/freetoken-metrics-keys.map",
    ):
        assert fleet.run(GATEWAY_NAME, f"stat -c '%a %U' {path}").stdout.split() == ["600", "root"]
    before = fleet.snapshot(GATEWAY_NAME)
    again = deploy_gateway(keys)
    assert again.returncode == 0 and client.grand_total(again)[1] in ("-", "0")
    assert harness.snapshot_diff(before, fleet.snapshot(GATEWAY_NAME)) == []


# From the gateway host, with its own python3 (the base image has no curl): the body of a GET.
FETCH = "python3 -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=10).read().decode())' "


def test_the_generated_scrape_config_targets_serve_the_guards_metrics_and_a_rerun_changes_nothing(gateway, keys):
    """Every node_exporter target of the scrape config the gateway deploy wrote answers,
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


def test_the_gateways_prometheus_scrapes_every_serving_target_up(gateway):
    """Debian's Prometheus on the gateway host, as the gateway deploy with `alerting_enabled`
    configured it (the scrape config it wrote, the metrics key in its credentials file): the
    gateway's exporter and every serving host's node_exporter are up, HAProxy's and the guard's
    series are there. ws3 never converged (refused at preflight): its target is down."""
    fleet = gateway["fleet"]
    api = "http://127.0.0.1:9090/api/v1/"
    health: dict[str, str] = {}

    def all_scraped() -> bool:
        r = fleet.run(GATEWAY_NAME, FETCH + shlex.quote(api + "targets"))
        if r.returncode != 0:
            return False
        for t in json.loads(r.stdout)["data"]["activeTargets"]:
            health[t["labels"].get("host") or t["labels"]["job"]] = t["health"]
        return len(health) == 4 and all(v != "unknown" for v in health.values())

    assert eventually(all_scraped, timeout=90), health
    assert health == {"freetoken-gateway": "up", "ws1": "up", "ws2": "up", "ws3": "down"}, health

    def series(query: str) -> set[str]:
        r = fleet.run(GATEWAY_NAME, FETCH + shlex.quote(api + "query?query=" + query), check=True)
        return {m["metric"].get("host") or m["metric"].get("proxy", "") for m in json.loads(r.stdout)["data"]["result"]}

    assert "freetoken" in series("haproxy_backend_active_servers")
    assert {"ws1", "ws2"} <= series("freetoken_guard_tripped")


def test_requests_through_the_gateway_reach_the_serving_hosts_and_ws3_is_parked(gateway):
    wait_in_service(gateway["fleet"], ["ws1", "ws2"])
    # One at a time: idle hosts take turns.
    alone = {stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY).host for _ in range(8)}
    assert alone == {"ws1", "ws2"}
    # Three at once: ws2's two slots and ws1's one.
    with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=3, max_tokens=24, max_requests=6, max_seconds=30) as load:
        time.sleep(5)
    outcomes = load.stop()
    assert all(o.ok for o in outcomes) and {o.host for o in outcomes} == {"ws1", "ws2"}
    assert {s["host"]: s["state"] for s in status_rows(gateway["fleet"])}["ws3"] == "parked"


def engine_active(fleet, host: str) -> int:
    """Requests FreeToken holds (running and waiting inside it), from its own /v1/stats."""
    out = fleet.run(
        host,
        f"curl -sf --noproxy '*' -H 'Authorization: Bearer {ENGINE_KEY}' http://127.0.0.1:8000/v1/stats",
        check=True,
    ).stdout
    return json.loads(out)["requests"]["active"]


def test_no_engine_gets_more_streams_than_its_slots_and_the_rest_wait_at_the_gateway(gateway, keys):
    """Twice the fleet's slots (ws1: 1, the 16 GB plan; ws2: 2, the 32 GB one) of openai clients:
    no engine ever holds more than it runs (nothing queued inside an engine, where the gateway
    cannot move it), every slot is used, every request is answered."""
    fleet = gateway["fleet"]
    wait_in_service(fleet, ["ws1", "ws2"])
    slots = {"ws1": 1, "ws2": 2}
    peak = {h: 0 for h in slots}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for h in slots:
                peak[h] = max(peak[h], engine_active(fleet, h))

    watcher = threading.Thread(target=watch, daemon=True)
    with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=6, max_tokens=24, max_seconds=12, client="openai") as load:
        watcher.start()
        time.sleep(12)
    outcomes = load.stop()
    stop.set()
    watcher.join(timeout=30)
    result = summary(outcomes)
    print(f"6 clients on 3 slots: {result['requests']} requests, by host {result['by_host']}, engine peaks {peak}")
    assert result["ok"] == result["requests"] > 0, result
    assert peak == slots  # never above, and every slot used
    assert result["by_host"]["ws2"] > result["by_host"]["ws1"] > 0

    # A full queue: the request beyond it gets a 503 with Retry-After at once, never a hang.
    assert deploy_gateway(keys, "--data", "gateway_queue_max=1").returncode == 0
    try:
        burst: list = []
        threads = [
            threading.Thread(target=lambda: burst.append(openai_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY, 48)))
            for _ in range(7)
        ]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=120)
        refused = [o for o in burst if not o.ok]
        print([(o.ok, o.host, o.error, round(o.t1 - o.t0, 2)) for o in burst])
        assert len(burst) == 7 and len([o for o in burst if o.ok]) >= 4  # 3 slots and 1 queued
        # "busy" is the full-queue rule's answer, given before queueing (a request that waited in
        # the queue and ran out of time gets "no engine slot became free in time" instead)
        assert refused and all(o.error.startswith("HTTP 503 (Retry-After 5)") and "busy" in o.error for o in refused)
    finally:
        assert deploy_gateway(keys).returncode == 0


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


def test_the_stats_page_is_not_reachable_from_another_host_without_a_metrics_key(gateway):
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
        input=METRICS_KEY + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.split() == ["401", "401", "401", "200"], r.stderr


def test_the_engine_key_is_in_no_argv_log_or_stats_page(gateway):
    # Compared on the gateway host, the key on stdin (never in an argument).
    script = (
        "import sys,os,subprocess,urllib.request\n"
        "key=sys.stdin.readline().strip();client=sys.stdin.readline().strip();m=sys.stdin.readline().strip()\n"
        "argv=[open(f'/proc/{p}/cmdline','rb').read() for p in os.listdir('/proc') if p.isdigit()"
        " and os.path.exists(f'/proc/{p}/cmdline')]\n"
        "j=subprocess.run(['journalctl','--no-pager','-o','cat'],capture_output=True);journal=j.stdout\n"
        "req=urllib.request.Request('http://127.0.0.1:8404/stats;csv',\n"
        "  headers={'Authorization':'Bearer '+m})\n"
        "stats=urllib.request.urlopen(req,timeout=10).read()\n"
        "k=key.encode();c=client.encode();m=m.encode()\n"
        "print(any(k in a for a in argv), k in journal, k in stats, c in journal, any(m in a for a in argv), m in journal)\n"
        "print('journalctl', j.returncode, len(journal.splitlines()) > 10 and b'-- No entries --' not in journal)\n"
    )
    r = subprocess.run(
        gateway["fleet"].ssh_argv(GATEWAY_NAME) + ["python3", "-c", shlex.quote(script)],
        input=f"{ENGINE_KEY}\n{CLIENT_KEY}\n{METRICS_KEY}\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    # the journal was read (a failed journalctl would hide the key by reading nothing)
    assert r.stdout.split() == ["False"] * 6 + ["journalctl", "0", "True"], (r.stdout, r.stderr)


# A GET from another host of the fleet, its key on stdin: the HTTP status, or "unreachable"
# when no HTTP answer comes (refused, reset, timed out).
PROBE = (
    "import sys,urllib.request as u,urllib.error as e\n"
    "key=sys.stdin.readline().strip()\n"
    "h={'Authorization':'Bearer '+key} if key else {}\n"
    "o=u.build_opener(u.ProxyHandler({}))\n"
    "try: print(o.open(u.Request(sys.argv[1],headers=h),timeout=5).status)\n"
    "except e.HTTPError as x: print(x.code)\n"
    "except OSError as x: print('unreachable', type(x).__name__)\n"
)


def probe(fleet, host: str, url: str, key: str = "") -> str:
    r = subprocess.run(
        fleet.ssh_argv(host) + ["python3", "-c", shlex.quote(PROBE), shlex.quote(url)],
        input=key + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    print(host, url, r.stdout, r.stderr)
    return r.stdout.strip()


def test_a_key_taken_from_ws1_opens_no_other_engine(gateway):
    """Every engine holds the fleet's one engine key. Someone with ws1 (its
    engine's key file) tries ws2's engine directly: its port answers the gateway and loopback only."""
    fleet = gateway["fleet"]
    wait_in_service(fleet, ["ws1", "ws2"])
    assert client.api_key(fleet, "ws1") == ENGINE_KEY  # what ws1 gives away
    ws2 = f"http://{host_address('ws2')}:8000/v1/models"
    assert probe(fleet, GATEWAY_NAME, ws2, ENGINE_KEY) == "200"  # the key and the address are right
    assert probe(fleet, "ws1", ws2, ENGINE_KEY).startswith("unreachable")
    assert probe(fleet, "ws1", f"http://{host_address('ws2')}:8001/", ENGINE_KEY).startswith("unreachable")
    assert probe(fleet, "ws2", "http://127.0.0.1:8000/v1/models", ENGINE_KEY) == "200"  # loopback still
    # Nor from this machine, another host of the fleet's LAN (the bridge).
    with pytest.raises(OSError):
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        req = urllib.request.Request(ws2, headers={"Authorization": f"Bearer {ENGINE_KEY}"})
        opener.open(req, timeout=5)
    print(f"ws2's engine refused {BRIDGE_ADDRESS} and ws1")
    # The rule set is ours alone, loaded by our unit.
    rules = fleet.run("ws2", "nft list table inet freetoken", check=True).stdout
    assert GATEWAY_ADDRESS in rules, rules


def test_a_flushed_firewall_is_noticed_by_the_fast_check_and_loaded_again(gateway, keys):
    """`nft flush ruleset` (Debian's own nftables.service does one when it starts) left the
    oneshot unit `active` and the engine port open to the LAN until the next boot: the live table
    is now a fact and an input of the fast check."""
    fleet = gateway["fleet"]
    ws2 = f"http://{host_address('ws2')}:8000/v1/models"
    before = fleet.run("ws2", "nft list table inet freetoken", check=True).stdout
    fleet.run("ws2", "nft flush ruleset", check=True)
    assert fleet.run("ws2", "systemctl is-active freetoken-firewall").stdout.strip() == "active"
    assert probe(fleet, "ws1", ws2, ENGINE_KEY) == "200"  # open to the LAN
    run = pyinfra(*data_args(keys), "inventories/sim.py", "deploys/freetoken.py", "--limit", "ws2")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "unchanged since its last converge" not in out, out[-3000:]
    assert fleet.run("ws2", "nft list table inet freetoken", check=True).stdout == before
    assert probe(fleet, "ws1", ws2, ENGINE_KEY).startswith("unreachable")


def test_the_scrape_key_buys_metrics_only_and_a_client_key_no_metrics(gateway):
    """Both frontends read one key map, so the scrape credential in a file on
    the Prometheus host was a full inference key. From another host of the fleet: the scrape key
    gets 401 on the API and 200 on /metrics, a client key 401 on /metrics."""
    fleet = gateway["fleet"]
    api, metrics = f"http://{GATEWAY_ADDRESS}:{PORT}/v1/models", f"http://{GATEWAY_ADDRESS}:{STATS_PORT}/metrics"
    assert probe(fleet, "ws1", api, METRICS_KEY) == "401"
    assert probe(fleet, "ws1", metrics, METRICS_KEY) == "200"
    assert probe(fleet, "ws1", metrics, CLIENT_KEY) == "401"
    assert probe(fleet, "ws1", api, CLIENT_KEY) == "200"  # the client key is still one


def test_node_exporter_answers_the_gateway_and_no_other_host(gateway):
    """With the engines on every address, node_exporter answered /metrics to
    anyone on the LAN without a key."""
    fleet = gateway["fleet"]
    metrics = f"http://{host_address('ws1')}:9100/metrics"
    assert probe(fleet, GATEWAY_NAME, metrics) == "200"  # the scrape config's source
    assert probe(fleet, "ws2", metrics).startswith("unreachable")


def test_the_gateway_refuses_a_keyless_engine_on_the_lan_before_any_change(gateway, keys):
    """With api_key_source "none" the gateway deployed in front of engines that
    anyone on the LAN could use without a key."""
    fleet = gateway["fleet"]
    before = fleet.snapshot(GATEWAY_NAME)
    run = pyinfra(
        "--data",
        "listen_host=0.0.0.0",
        "--data",
        "api_key_source=none",
        "--data",
        f"gateway_keys_source=file:{keys['clients']}",
        "inventories/sim.py",
        "deploys/gateway.py",
        "--limit",
        "gateway",
    )
    assert run.returncode != 0
    assert "host ws1: api_key_source 'none' with listen_host 0.0.0.0" in run.stdout + run.stderr
    assert harness.snapshot_diff(before, fleet.snapshot(GATEWAY_NAME)) == []


def test_dry_diff_of_the_gateway_shows_changed_keys_masked_and_prints_none(gateway, keys, tmp_path):
    """`--dry --diff` printed the clients' keys and the engine key, old and new."""
    import re

    fleet = gateway["fleet"]
    new_engine, new_client = "sim-engine-key-rotated-0123456789", "sim-client-key-alice-rotated-42"
    (tmp_path / "engine.key").write_text(new_engine + "\n")
    (tmp_path / "clients").write_text(f"{new_client} alice\n")
    before = fleet.snapshot(GATEWAY_NAME)
    run = subprocess.run(
        [
            client.PYINFRA,
            "--dry",
            "--diff",
            "--data",
            "listen_host=0.0.0.0",
            "--data",
            f"api_key_source=file:{tmp_path / 'engine.key'}",
            "--data",
            f"gateway_keys_source=file:{tmp_path / 'clients'}",
            "--data",
            f"gateway_metrics_keys_source=file:{keys['metrics']}",
            "inventories/sim.py",
            "deploys/gateway.py",
            "--limit",
            "gateway",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    print(out[-12000:])
    assert run.returncode == 0
    assert "******** alice (changed)" in out and "engine ******** (changed)" in out
    for key in (ENGINE_KEY, new_engine, CLIENT_KEY, new_client, METRICS_KEY):
        assert key not in out
    assert harness.snapshot_diff(before, fleet.snapshot(GATEWAY_NAME)) == []


def test_https_on_the_client_side_with_gateway_tls_cert_file(gateway, keys, tmp_path):
    """Clients' keys and prompts crossed the LAN in clear; with a certificate
    the gateway speaks HTTPS only on both of its ports."""
    import http.client
    import ssl

    fleet = gateway["fleet"]
    cert, key, pem = tmp_path / "gw.crt", tmp_path / "gw.key", tmp_path / "gw.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={GATEWAY_NAME}"]
        + ["-addext", f"subjectAltName=IP:{GATEWAY_ADDRESS}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    pem.write_text(cert.read_text() + key.read_text())
    pem.chmod(0o600)
    context = ssl.create_default_context(cafile=str(cert))

    def https_status(port: int) -> int | None:
        conn = http.client.HTTPSConnection(GATEWAY_ADDRESS, port, timeout=10, context=context)
        try:
            api = port == PORT
            key = CLIENT_KEY if api else METRICS_KEY
            conn.request("GET", "/v1/models" if api else "/metrics", headers={"Authorization": f"Bearer {key}"})
            return conn.getresponse().status
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def plain_ok() -> bool:
        try:
            return _get(f"http://{GATEWAY_ADDRESS}:{PORT}/v1/models", CLIENT_KEY) == 200
        except (OSError, http.client.HTTPException):
            return False

    try:
        run = pyinfra(
            *data_args(keys),
            "--data",
            f"gateway_tls_cert_file={pem}",
            "inventories/sim.py",
            "deploys/gateway.py",
            "--limit",
            "gateway",
        )
        assert run.returncode == 0
        assert eventually(lambda: https_status(PORT) == 200)
        assert https_status(STATS_PORT) == 200
        assert fleet.run(GATEWAY_NAME, "stat -c '%a %U' /etc/haproxy/freetoken-gateway.pem").stdout.split() == [
            "600",
            "root",
        ]
        # Plain HTTP gets no answer from an HTTPS port.
        assert not plain_ok()
    finally:
        back = deploy_gateway(keys)
    assert back.returncode == 0
    assert eventually(plain_ok)
    assert fleet.run(GATEWAY_NAME, "test -e /etc/haproxy/freetoken-gateway.pem").returncode == 1


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
            client="openai",
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
    if result["failed_before_streaming"]:  # HAProxy's own account of each: its termination state
        print(fleet.run(GATEWAY_NAME, "journalctl -q --no-pager -t haproxy | grep -v ' 200 ' | tail -n 40").stdout)
    assert result["failed_before_streaming"] == []  # zero failed requests that had not started
    assert result["by_host"].get("ws1") and result["by_host"].get("ws2")
    # Drained before its engine was touched and put back after its gate; a reload drops nothing.
    for name in ("rollout", "reload"):
        assert in_phase(name), f"no request during the {name}"
        assert all(o.ok for o in in_phase(name)), [o.error for o in in_phase(name) if not o.ok]
