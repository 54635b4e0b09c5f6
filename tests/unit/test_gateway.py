"""The gateway's pure parts: HAProxy's config from the settings, the key maps, the backends, the
scrape config, and the fleet CLI's reading of HAProxy's runtime answers."""

import json
import re

import pytest

from freetoken_infra import fleet
from freetoken_infra.core.layout import (
    GATEWAY_ENGINE_KEY_MAP,
    GATEWAY_KEYS_MAP,
    GATEWAY_METRICS_KEYS_MAP,
    SESSION_HEADER,
)
from freetoken_infra.core.records import HostRow
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations import gateway as gw
from operations.gateway import GatewayBackend, GatewayError
from tests.unit.fakehost import FakeHost

BACKENDS = [GatewayBackend("ws1", "10.0.0.11", 8000), GatewayBackend("ws2", "10.0.0.12", 8000)]
ENGINE_KEY = "engine-key-0123456789abcdef"


def config(**settings) -> str:
    return gw.haproxy_config(Settings(**settings), BACKENDS, engine_key=True)


def section(text: str, header: str) -> str:
    """One section of haproxy.cfg: from its header line to the next unindented line."""
    lines = text.splitlines()
    start = lines.index(header)
    body = []
    for line in lines[start + 1 :]:
        if line and not line.startswith(" "):
            break
        body.append(line.strip())
    return "\n".join(body)


def test_every_serving_host_is_one_server_with_its_engines_slots_and_weight():
    backends = [GatewayBackend("ws1", "10.0.0.11", 8000, 1, 24), GatewayBackend("ws2", "10.0.0.12", 8000, 2, 60)]
    text = gw.haproxy_config(Settings(), backends, engine_key=True)
    assert text.count("\nbackend ") == 1
    checked = section(text, "backend freetoken")
    assert "server ws1 10.0.0.11:8000 maxconn 1 weight 24" in checked
    assert "server ws2 10.0.0.12:8000 maxconn 2 weight 60" in checked
    assert "balance leastconn" in checked
    # a vanished host's connections are closed, not held for the 10 min server timeout
    assert {"option srvtcpka", "srvtcpka-idle 5s", "srvtcpka-intvl 2s", "srvtcpka-cnt 3"} <= set(checked.splitlines())
    front = section(text, "frontend freetoken_api")
    assert "default_backend freetoken" in front and "bind :8080" in front


def test_a_conversation_keeps_its_host_only_while_that_host_has_a_free_slot_and_serves():
    text = config()
    front = section(text, "frontend freetoken_api")
    session = SESSION_HEADER.lower()
    assert (
        f"http-request set-var(txn.bucket) req.hdr({session}),xxh32,mod({gw.AFFINITY_BUCKETS}) "
        f"if {{ req.hdr({session}) -m found }}"
    ) in front
    assert "req.body" not in front  # prefix affinity is opt-in
    rules = [line for line in section(text, "backend freetoken").splitlines() if line.startswith("use-server")]
    placed = gw.affinity_buckets(BACKENDS)
    for b in BACKENDS:
        mine = [rule for rule in rules if rule.startswith(f"use-server {b.name} if ")]
        got = [w for rule in mine for w in rule.split("-m int ", 1)[1].split(" }", 1)[0].split()]
        assert got == [str(n) for n in placed[b.name]], mine
    for rule, b in [(rule, b) for b in BACKENDS for rule in rules if rule.startswith(f"use-server {b.name} if ")]:
        # never onto a full, drained or failed host: then it is placed like any request
        for cond in (
            f"srv_conn_free(freetoken/{b.name}) gt 0",
            f"srv_weight(freetoken/{b.name}) gt 0",
            f"srv_is_up(freetoken/{b.name})",
        ):
            assert f"{{ {cond} }}" in rule, rule
    with_prefix = section(config(gateway_prefix_affinity_bytes=512), "frontend freetoken_api")
    assert "req.body,bytes(0,512),xxh32,mod(64) if !{ var(txn.bucket) -m found }" in with_prefix


def test_affinity_buckets_follow_the_weights_and_a_joining_host_moves_only_what_it_takes():
    two = [GatewayBackend("ws1", "a", 1, 1, 24), GatewayBackend("ws2", "b", 1, 2, 60)]
    placed = gw.affinity_buckets(two)
    assert sorted(placed["ws1"] + placed["ws2"]) == list(range(gw.AFFINITY_BUCKETS))
    assert len(placed["ws2"]) > len(placed["ws1"]) > 0  # the faster host keeps more conversations
    assert gw.affinity_buckets(list(reversed(two))) == placed  # order of the inventory does not matter
    three = gw.affinity_buckets([*two, GatewayBackend("ws3", "c", 1, 1, 24)])
    assert three["ws3"]
    for name in ("ws1", "ws2"):  # nobody else's conversation moves
        assert set(three[name]) <= set(placed[name])
        assert set(placed[name]) - set(three[name]) <= set(three["ws3"])
    assert gw.affinity_buckets(two[:1]) == {"ws1": list(range(gw.AFFINITY_BUCKETS))}


def test_a_full_queue_answers_503_with_retry_after_at_once_and_a_wait_is_bounded():
    text = config(gateway_queue_max=7, gateway_queue_timeout_s=45)
    front = section(text, "frontend freetoken_api")
    full = [line for line in front.splitlines() if "queue(freetoken) ge 7" in line]
    assert len(full) == 1 and full[0].startswith(
        f"http-request return status 503 content-type application/json hdr Retry-After {gw.RETRY_AFTER_S} string '"
    )
    # after the key check: a client without a key learns nothing of the fleet's load
    assert front.index("unless key_ok") < front.index("queue(freetoken)")
    defaults = section(text, "defaults")
    assert "timeout queue 45s" in defaults
    error = re.search(
        r"http-error status 503 content-type application/json hdr Retry-After (\d+) string '(.*)'", defaults
    )
    assert error and int(error.group(1)) == gw.RETRY_AFTER_S and "error" in json.loads(error.group(2))
    with pytest.raises(SettingsError, match="gateway_queue_max"):
        build_settings("gw", {"gateway_queue_max": 0})


@pytest.mark.parametrize(
    ("data", "measured", "expected"),
    [
        ({"hardware_profile": "rtx5060ti_16gb", "decode_floor_tps": 18.0}, None, (1, 18)),
        ({"hardware_profile": "rtx5090_32gb", "decode_floor_tps": 40.0}, 59.6, (2, 60)),
        ({"hardware_profile": "rtx5090_32gb", "launch_max_running_requests": 3}, None, (3, gw.UNKNOWN_WEIGHT)),
        ({}, None, (1, gw.UNKNOWN_WEIGHT)),  # auto: the controller cannot know the card
        # a host that forged its speed weighs at most 256, its slots stay its plan's
        ({"hardware_profile": "rtx5060ti_16gb"}, 1e9, (1, 256)),
        ({"hardware_profile": "rtx5060ti_16gb"}, 0.01, (1, 1)),
        ({"hardware_profile": "rtx5060ti_16gb", "decode_floor_tps": 18.0}, float("nan"), (1, 18)),
    ],
)
def test_backend_capacity_slots_from_the_launch_plan_weight_from_the_measured_speed(data, measured, expected):
    assert gw.backend_capacity(build_settings("ws1", data), measured) == expected


def test_health_check_reads_the_json_status_not_the_http_code():
    checked = section(config(), "backend freetoken")
    expect = re.search(r"http-check expect rstring '(.*)'", checked)
    assert expect, checked
    pattern = re.compile(expect.group(1))
    # FreeToken answers 200 while loading and on error: only "ok" may pass, compact or spaced.
    assert pattern.search('{"status":"ok","uptime_s":3}')
    assert pattern.search(json.dumps({"status": "ok", "model": "m"}))
    for body in ({"status": "loading", "phase": "weights"}, {"status": "error", "message": "ok"}):
        assert not pattern.search(json.dumps(body)), body
    assert "http-check send meth GET uri /health" in checked


def test_out_within_seconds_and_rejoin_after_several_good_checks():
    checked = section(config(), "backend freetoken")
    server_defaults = next(line for line in checked.splitlines() if line.startswith("default-server"))
    words = server_defaults.split()
    value = lambda key: words[words.index(key) + 1]  # noqa: E731
    assert value("inter") == "1s" and int(value("fall")) * 1 <= 5  # out within 5 s
    assert int(value("rise")) >= 3  # a few intervals in a row
    assert "observe layer4" in server_defaults and "on-error mark-down" in server_defaults


def test_retries_only_what_no_host_answered():
    text = config()
    body = section(text, "backend freetoken")
    retry = next(line for line in body.splitlines() if line.startswith("retry-on"))
    assert set(retry.split()[1:]) == {"conn-failure", "empty-response", "junk-response", "response-timeout", "503"}
    assert "option redispatch 1" in body
    # only a request HAProxy holds whole can be retried: it waits for the body first
    assert "option http-buffer-request" in section(text, "frontend freetoken_api").splitlines()
    assert f"tune.bufsize {gw.BUFSIZE}" in text


def test_keys_are_checked_at_the_gateway_and_replaced_by_the_engine_key():
    front = section(config(), "frontend freetoken_api")
    assert f"map_str({GATEWAY_KEYS_MAP}) -m found" in front
    assert "http-request return status 401" in front and "unless key_ok" in front
    assert "http-request del-header x-api-key" in front
    assert f'set-header Authorization "Bearer %[str(engine),map_str({GATEWAY_ENGINE_KEY_MAP})]"' in front
    assert ENGINE_KEY not in config()  # the key lives in its 0600 map only
    without = gw.haproxy_config(Settings(), BACKENDS, engine_key=False)
    assert "http-request del-header Authorization" in section(without, "frontend freetoken_api")


def test_stats_and_metrics_need_a_key_and_the_runtime_api_is_root_only():
    text = config(gateway_stats_port=9404)
    stats = section(text, "frontend freetoken_stats")
    assert "bind :9404" in stats
    lines = stats.splitlines()
    refuse = next(i for i, line in enumerate(lines) if "return status 401" in line)
    served = [i for i, line in enumerate(lines) if "prometheus-exporter" in line or line == "stats enable"]
    assert served and all(refuse < i for i in served)
    assert f"map_str({GATEWAY_METRICS_KEYS_MAP}) -m found" in stats
    assert "stats admin" not in text
    assert re.search(r"stats socket \S+ mode 600 level admin", section(text, "global"))
    assert "server-state-file" in section(text, "global")
    assert "load-server-state-from-file global" in section(text, "defaults")


def key_maps(frontend: str) -> set[str]:
    """Every key map a frontend's rules read."""
    return set(re.findall(r"map_str\(([^)]+)\)", frontend))


def test_an_inference_key_opens_no_metrics_and_a_metrics_key_no_api():
    """Both frontends read one key map, so Prometheus' scrape credential (a file
    on the Prometheus host) was a full inference key. Each frontend now checks its own map only:
    the clients' on /v1, the metrics keys on /metrics and /stats; every request of the stats
    frontend whose key is not in its map gets the 401 before anything is served."""
    text = config()
    api, stats = section(text, "frontend freetoken_api"), section(text, "frontend freetoken_stats")
    assert key_maps(api) == {GATEWAY_KEYS_MAP, GATEWAY_ENGINE_KEY_MAP}  # the engine map is sent, not checked
    assert [line for line in api.splitlines() if line.startswith("acl key_ok")] == [
        f"acl key_ok var(txn.api_key),map_str({GATEWAY_KEYS_MAP}) -m found"
    ]
    assert key_maps(stats) == {GATEWAY_METRICS_KEYS_MAP}
    assert [line for line in stats.splitlines() if line.startswith("acl key_ok")] == [
        f"acl key_ok var(txn.api_key),map_str({GATEWAY_METRICS_KEYS_MAP}) -m found"
    ]
    assert GATEWAY_METRICS_KEYS_MAP != GATEWAY_KEYS_MAP
    clients = gw.keys_map("alice-key-0123456789 alice\n")
    metrics = gw.metrics_keys_map("scrape-key-0123456789 prometheus\n", clients)
    assert gw.map_keys(clients) == {"alice-key-0123456789"} and gw.map_keys(metrics) == {"scrape-key-0123456789"}
    assert metrics.splitlines()[1:] == ["scrape-key-0123456789 prometheus"]


def test_a_metrics_key_that_is_also_a_client_key_is_refused_and_unset_opens_no_metrics():
    clients = gw.keys_map("alice-key-0123456789 alice\nbob-key-0123456789abc bob\n")
    with pytest.raises(
        GatewayError, match=r"^gateway_metrics_keys_source, line 2: this key is also a client key"
    ) as err:
        gw.metrics_keys_map("scrape-key-0123456789\nbob-key-0123456789abc prometheus\n", clients)
    assert "bob-key" not in str(err.value)
    with pytest.raises(GatewayError, match="^gateway_metrics_keys_source, line 1: expected") as err:
        gw.metrics_keys_map("short\n", clients)
    assert "short" not in str(err.value)
    with pytest.raises(GatewayError, match="^gateway_metrics_keys_source: no key"):
        gw.metrics_keys_map("# none yet\n", clients)
    # Unset: the map holds no key at all (comments only), so /metrics and /stats answer 401.
    closed = gw.metrics_keys_map(None, clients)
    assert gw.map_keys(closed) == set() and all(line.startswith("#") for line in closed.splitlines())
    assert gw.masked_map(closed, 0) == closed.splitlines(keepends=True)


def test_the_metrics_keys_source_is_validated_like_the_clients():
    s = build_settings("gw", {"gateway_metrics_keys_source": "env:GW_METRICS"})
    assert s.gateway_metrics_keys_source == "env:GW_METRICS"
    assert Settings().gateway_metrics_keys_source is None
    for bad in ("generate", "none", "env:GW_METRICS\n", "file:/keys\n", "file:relative"):
        with pytest.raises(SettingsError, match="host gw: setting 'gateway_metrics_keys_source'"):
            build_settings("gw", {"gateway_metrics_keys_source": bad})


def test_the_log_names_the_client_by_label_never_the_key():
    front = section(config(), "frontend freetoken_api")
    assert "http-request capture var(txn.client) len 64" in front
    assert "capture var(txn.api_key)" not in front and "req.hdr(authorization) len" not in front


def test_keys_map_lines_labels_and_errors_that_never_show_the_key():
    text = gw.keys_map("# comment\nalice-key-0123456789 alice\n\nbob-key-0123456789abc  # no label\n")
    assert text.splitlines()[1:] == ["alice-key-0123456789 alice", "bob-key-0123456789abc client4"]
    with pytest.raises(GatewayError, match="line 2: this key is listed twice") as err:
        gw.keys_map("same-key-0123456789\nsame-key-0123456789\n")
    assert "same-key" not in str(err.value)
    with pytest.raises(GatewayError, match="line 1") as err:
        gw.keys_map("short\n")
    assert "short" not in str(err.value)
    with pytest.raises(GatewayError, match="no key"):
        gw.keys_map("# nothing\n")


def test_backends_skip_gateway_only_hosts_and_need_a_reachable_engine():
    hosts = {
        "ws10": (Settings(listen_host="0.0.0.0"), "192.0.2.20"),
        "ws2": (Settings(listen_host="192.0.2.12", listen_port=8100), "ws2.lan"),
        "gw": (Settings(runs_engine=False), "192.0.2.5"),
    }
    assert gw.backends_for("gw", hosts) == [
        GatewayBackend("ws2", "192.0.2.12", 8100, agent_port=8010),
        GatewayBackend("ws10", "192.0.2.20", 8000, agent_port=8010),
    ]
    measured = gw.backends_for("gw", hosts, {"ws10": 61.2, "ws9": 99.0})
    assert [(b.name, b.weight) for b in measured] == [("ws2", gw.UNKNOWN_WEIGHT), ("ws10", 61)]
    with pytest.raises(GatewayError, match="host ws1: its engine listens on 127.0.0.1 only.*listen_host"):
        gw.backends_for("gw", {"ws1": (Settings(), "192.0.2.11")})
    # the gateway on the serving host itself may reach it on loopback
    assert gw.backends_for("ws1", {"ws1": (Settings(), None)}) == [
        GatewayBackend("ws1", "127.0.0.1", 8000, agent_port=8010)
    ]
    # no host agent: no agent-check
    alone = gw.backends_for("ws1", {"ws1": (Settings(agent_enabled=False), None)})
    assert alone == [GatewayBackend("ws1", "127.0.0.1", 8000)]
    with pytest.raises(GatewayError, match="no host of the inventory runs an engine"):
        gw.backends_for("gw", {"gw": (Settings(runs_engine=False), None)})


def test_one_engine_key_for_the_fleet(tmp_path, monkeypatch):
    key_file = tmp_path / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")
    monkeypatch.setenv("FT_ENGINE_KEY", ENGINE_KEY)
    same = {"ws1": Settings(api_key_source=f"file:{key_file}"), "ws2": Settings(api_key_source="env:FT_ENGINE_KEY")}
    assert gw.fleet_engine_key(BACKENDS, same) == ENGINE_KEY
    with pytest.raises(GatewayError, match=r"ws2: api_key_source 'generate'.*same 'file:\.\.\.'"):
        gw.fleet_engine_key(BACKENDS, {"ws1": same["ws1"], "ws2": Settings()})
    monkeypatch.setenv("FT_ENGINE_KEY", ENGINE_KEY + "x")
    with pytest.raises(GatewayError, match="different keys") as err:
        gw.fleet_engine_key(BACKENDS, same)
    assert ENGINE_KEY not in str(err.value)
    none = {"ws1": Settings(api_key_source="none"), "ws2": Settings(api_key_source="none")}
    assert gw.fleet_engine_key(BACKENDS, none) is None


def test_gateway_settings_are_validated():
    assert build_settings("gw", {"gateway_keys_source": "env:GW_KEYS"}).gateway_keys_source == "env:GW_KEYS"
    with pytest.raises(SettingsError, match="gateway_keys_source.*file:/path/on/controller"):
        build_settings("gw", {"gateway_keys_source": "generate"})
    with pytest.raises(SettingsError, match="gateway_port"):
        build_settings("gw", {"gateway_port": 0})


def test_scrape_config_lists_the_gateway_and_every_serving_host():
    import yaml

    text = gw.scrape_config(
        "192.0.2.5",
        Settings(gateway_stats_port=9404),
        {"ws1": ("192.0.2.11", Settings()), "ws2": ("192.0.2.12", Settings())},
    )
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    gateway = jobs["freetoken-gateway"]
    assert gateway["static_configs"] == [{"targets": ["192.0.2.5:9404"]}]
    assert gateway["authorization"]["type"] == "Bearer" and gateway["metrics_path"] == "/metrics"
    guard = jobs["freetoken-guard"]["static_configs"]
    assert [c["targets"] for c in guard] == [["192.0.2.11:9100"], ["192.0.2.12:9100"]]
    assert guard[0]["labels"] == {"host": "ws1", "textfile_dir": "/var/lib/freetoken-deploy/metrics"}


# ------------------------------------------------------------------ the fleet CLI's side
# `show stat` as HAProxy 2.6 answers it (header trimmed to the columns that matter here).
SHOW_STAT = """# pxname,svname,qcur,qmax,scur,smax,status,check_status,check_code,check_duration,last_chk
freetoken_api,FRONTEND,,,3,9,OPEN,,,,
freetoken,ws1,1,2,2,4,UP,L7OK,200,1,
freetoken,ws2,0,0,0,1,DOWN,L4CON,,0,Connection refused
freetoken,ws3,0,0,0,0,DOWN,L7RSP,,2,TCPCHK did not match content 'rstring' at step 2
freetoken,ws4,0,0,1,1,DRAIN,L7OK,200,1,
freetoken,ws5,0,0,0,0,MAINT,L4TOUT,,2001,
freetoken,BACKEND,4,6,3,9,UP,,,,
"""


def test_status_words_from_haproxy_states():
    got = {s.host: (s.state, s.active) for s in fleet.parse_stat(SHOW_STAT)}
    assert got == {
        "ws1": ("in service", 3),
        "ws2": ("parked", 0),
        "ws3": ("failed", 0),
        "ws4": ("draining", 1),
        "ws5": ("maintenance", 0),
    }
    assert fleet.classify("UP 1/2", "L4CON") == "in service"  # going down, still serving
    assert fleet.classify("DOWN 1/3", "L7OK") == "parked"  # back, rising: not in service yet
    assert fleet.classify("DOWN", "L7STS") == "failed"  # answers, but not ok
    with pytest.raises(fleet.FleetError, match="unexpected answer"):
        fleet.parse_stat("Unknown command\n")


def test_status_table_has_one_row_per_host():
    table = fleet.format_status(fleet.parse_stat(SHOW_STAT), {"ws1": 23.5, "ws2": None})
    lines = table.splitlines()
    assert lines[1].split()[:3] == ["host", "state", "active"]
    row = next(line for line in lines if line.startswith("ws1"))
    assert "in service" in row and "23.5" in row and "L7OK/200" in row
    assert "Connection refused" in next(line for line in lines if line.startswith("ws2"))
    assert lines[-1] == "5 host(s): 1 in service, 1 parked, 1 draining, 1 failed"


def test_runtime_commands_are_quoted_for_the_shell():
    assert fleet.runtime_command("set server freetoken/ws1 state drain") == (
        "echo 'set server freetoken/ws1 state drain' | socat stdio /run/haproxy/admin.sock"
    )


def test_remote_from_inventory_data():
    r = fleet.remote_for(
        "ws1",
        {
            "ssh_hostname": "10.0.0.1",
            "ssh_user": "deploy",
            "ssh_port": 2222,
            "ssh_key": "/k",
            "ssh_strict_host_key_checking": "yes",
        },
    )
    assert r.sudo and r.ssh_argv[-1] == "deploy@10.0.0.1"
    assert ["-p", "2222"] == r.ssh_argv[r.ssh_argv.index("-p") : r.ssh_argv.index("-p") + 2]
    assert "StrictHostKeyChecking=yes" in r.ssh_argv
    assert fleet.remote_for("@local", {}).ssh_argv is None


class RecordRemote:
    """A host whose last gate record file holds `text` (a FleetError: it cannot be reached)."""

    def __init__(self, text):
        self.text, self.commands = text, []

    def run(self, command, timeout=20):
        self.commands.append(command)
        if isinstance(self.text, Exception):
            raise self.text
        return self.text


def test_status_reads_each_hosts_last_gate_as_a_gate_record():
    """The tok/s of `fleet status` is the decode_tps of the host's gate record, read as the typed
    GateResult: a record that is not one (forged, torn, not JSON) or a host that does not answer
    shows "-", never a value the schema refuses."""
    from freetoken_infra.core.gate_record import GateResult

    texts = {
        "ws1": GateResult(ok=True, phase="done", decode_tps=23.5).to_json(),
        "ws2": GateResult(ok=True, phase="done", decode_tps=24).to_json(),  # an int in the JSON
        "ws3": GateResult(ok=False, phase="chat", error="HTTP 401").to_json(),  # measured nothing
        "ws4": json.dumps({"ok": True, "decode_tps": "fast"}),
        "ws5": json.dumps({"decode_tps": 99.0}),  # no ok: not a gate record
        "ws6": '{"ok": true, "decode_tps": 2',
        "ws7": json.dumps({"ok": True, "decode_tps": True}),
        "ws8": fleet.FleetError("ws8: no answer within 8 s"),
    }
    remotes = {name: RecordRemote(text) for name, text in texts.items()}
    hosts = {name: (Settings(), remote) for name, remote in remotes.items()}
    tps = fleet.Fleet(RecordRemote(""), hosts).gate_tps()
    assert tps == {"ws1": 23.5, "ws2": 24.0, "ws3": None} | {f"ws{i}": None for i in range(4, 9)}
    assert isinstance(tps["ws2"], float)
    assert "head -c 65536" in remotes["ws1"].commands[0] and "runuser -u" in remotes["ws1"].commands[0]


# ------------------------------------------------------------------ rollouts behind the gateway
class FakeGateway:
    """Records what a rollout asks of the gateway, in order, with the hosts' streams."""

    def __init__(self, backends, log):
        self.backends, self.log, self.active = backends, log, {h: 1 for h in backends}

    def servers(self):
        return [fleet.ServerStatus(h, "in service", self.active[h], "L7OK", "UP") for h in self.backends]

    def drain(self, hosts):
        self.log.append(("drain", list(hosts)))

    def wait_idle(self, hosts, timeout, say=None, poll=1.0):
        self.log.append(("wait_idle", list(hosts)))
        return []

    def ready(self, hosts):
        self.log.append(("ready", list(hosts)))


def test_a_rollout_drains_each_batch_before_its_deploy_and_readies_only_what_passed(monkeypatch):
    from freetoken_infra import rollout
    from freetoken_infra.report import RESULT_FAILED, RESULT_OK

    log: list = []
    outcome = {"ws1": RESULT_OK, "ws2": RESULT_OK, "ws3": RESULT_FAILED}

    def run_batch(index, hosts, inventory, deploy, data, out=None):
        log.append(("deploy", list(hosts)))
        return rollout.BatchRun(hosts, 0, [HostRow(host=h, result=outcome[h]) for h in hosts])

    monkeypatch.setattr(rollout, "run_batch", run_batch)
    gateway = FakeGateway(["ws1", "ws2", "ws3"], log)
    rows, stopped = rollout.rollout("inv.py", [["ws1"], ["ws2", "ws3"]], gateway=gateway, max_fail_pct=100)
    assert stopped is None
    assert log == [
        ("drain", ["ws1"]),
        ("wait_idle", ["ws1"]),
        ("deploy", ["ws1"]),
        ("ready", ["ws1"]),
        ("drain", ["ws2", "ws3"]),
        ("wait_idle", ["ws2", "ws3"]),
        ("deploy", ["ws2", "ws3"]),
        ("ready", ["ws2"]),
    ]  # ws3 failed its gate: it stays drained


def test_a_host_not_behind_the_gateway_is_rolled_out_without_drain(monkeypatch):
    import io

    from freetoken_infra import rollout
    from freetoken_infra.report import RESULT_OK

    log: list = []
    monkeypatch.setattr(
        rollout,
        "run_batch",
        lambda i, hosts, *a, **k: rollout.BatchRun(hosts, 0, [HostRow(host=h, result=RESULT_OK) for h in hosts]),
    )
    out = io.StringIO()
    rollout.rollout("inv.py", [["ws1", "ws9"]], gateway=FakeGateway(["ws1"], log), out=out)
    assert log == [("drain", ["ws1"]), ("wait_idle", ["ws1"]), ("ready", ["ws1"])]
    assert "ws9 not behind the gateway" in out.getvalue()


def test_wait_idle_waits_for_running_streams():
    class Busy(fleet.Fleet):
        def __init__(self):
            self.polls = 0

        def servers(self):
            self.polls += 1
            return [fleet.ServerStatus("ws1", "draining", 2 if self.polls < 3 else 0, "L7OK", "DRAIN")]

    busy = Busy()
    assert busy.wait_idle(["ws1"], timeout=60, poll=0) == [] and busy.polls == 3
    assert Busy().wait_idle(["ws1"], timeout=0, poll=0) == ["ws1"]


# ------------------------------------------------------------------ hostile host text, keys on the LAN
HOSTILE = "10.0.0.1\n    server evil 1.2.3.4:80"


def test_a_hostile_ssh_hostname_never_reaches_haproxy_cfg():
    """An inventory address with a newline would add a server line to haproxy.cfg."""
    with pytest.raises(GatewayError, match=r"^host ws1: ssh_hostname '10\.0\.0\.1\\n    server evil") as err:
        gw.backends_for("gw", {"ws1": (Settings(listen_host="0.0.0.0"), HOSTILE)})
    assert "\n" not in str(err.value)
    for bad in ("10.0.0.1\n", "ws1.lan # x", "@local"):
        with pytest.raises(GatewayError, match="host ws1: ssh_hostname"):
            gw.backends_for("gw", {"ws1": (Settings(listen_host="0.0.0.0"), bad)})
    # A host name or an IP literal passes as it is.
    assert gw.backends_for("gw", {"ws1": (Settings(listen_host="0.0.0.0"), "ws1.lab.example")})[0].address == (
        "ws1.lab.example"
    )


def test_names_and_key_sources_with_a_trailing_newline_are_refused():
    """Python's `$` matches before a final newline; every pattern is a full match."""
    with pytest.raises(GatewayError, match="a gateway backend's name"):
        gw.backends_for("gw", {"ws1\n": (Settings(listen_host="192.0.2.11"), None)})
    with pytest.raises(SettingsError, match="host gw: setting 'gateway_keys_source'"):
        build_settings("gw", {"gateway_keys_source": "env:GW_KEYS\n"})
    with pytest.raises(SettingsError, match="gateway_keys_source"):
        build_settings("gw", {"gateway_keys_source": "file:/keys\n"})


def test_the_scrape_yaml_is_written_by_the_yaml_library():
    import yaml

    text = gw.scrape_config("fd00::5", Settings(), {"ws1": ("ws1.lab.example", Settings(listen_host="0.0.0.0"))})
    jobs = {job["job_name"]: job for job in yaml.safe_load(text)["scrape_configs"]}
    assert jobs["freetoken-gateway"]["static_configs"] == [{"targets": ["[fd00::5]:8404"]}]
    assert "scheme" not in jobs["freetoken-gateway"]
    assert jobs["freetoken-guard"]["static_configs"][0]["targets"] == ["ws1.lab.example:9100"]
    tls = yaml.safe_load(gw.scrape_config("192.0.2.5", Settings(), {}, tls=True))["scrape_configs"][0]
    assert tls["scheme"] == "https"


def test_a_keyless_engine_on_a_lan_address_is_refused_behind_the_gateway():
    """`api_key_source = "none"` on 0.0.0.0 would let anyone on the LAN bypass the keys."""
    keyless = {"ws1": Settings(api_key_source="none", listen_host="0.0.0.0"), "ws2": Settings(api_key_source="none")}
    with pytest.raises(GatewayError, match=r"^host ws1: api_key_source 'none' with listen_host 0\.0\.0\.0") as err:
        gw.fleet_engine_key(BACKENDS, keyless)
    assert "ws2" not in str(err.value)  # on loopback: only the gateway on that host reaches it
    loopback = {"ws1": Settings(api_key_source="none")}
    assert gw.fleet_engine_key([GatewayBackend("ws1", "127.0.0.1", 8000)], loopback) is None


def test_tls_on_both_client_facing_ports():
    text = gw.haproxy_config(Settings(), BACKENDS, engine_key=True, tls=True)
    assert "bind :8080 ssl crt /etc/haproxy/freetoken-gateway.pem" in section(text, "frontend freetoken_api")
    assert "bind :8404 ssl crt /etc/haproxy/freetoken-gateway.pem" in section(text, "frontend freetoken_stats")
    assert "ssl" not in section(config(), "frontend freetoken_api")


@pytest.fixture(scope="module")
def pems(tmp_path_factory):
    """A self-signed certificate and key made by openssl: as one PEM, encrypted, and alone."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.fail("these tests make a certificate with the openssl command")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        f"openssl req -x509 -newkey rsa:2048 -nodes -keyout {d}/k -out {d}/c -days 2 -subj /CN=gw 2>/dev/null"
        f" && openssl rsa -in {d}/k -aes256 -passout pass:x -out {d}/ek 2>/dev/null"
        f" && cat {d}/c {d}/k > {d}/ok.pem && cat {d}/c {d}/ek > {d}/encrypted.pem && cp {d}/c {d}/cert-only.pem",
        shell=True,
        check=True,
    )
    return d


def test_the_tls_pem_is_checked_on_the_controller(pems):
    text = gw.tls_pem("gw1", str(pems / "ok.pem"))
    assert "BEGIN CERTIFICATE" in text and "PRIVATE KEY" in text
    for name in ("encrypted.pem", "cert-only.pem", "missing.pem"):
        with pytest.raises(GatewayError, match=f"^host gw1: gateway_tls_cert_file {pems}/{name}: ") as err:
            gw.tls_pem("gw1", str(pems / name))
        assert "PRIVATE KEY" not in str(err.value)
    assert build_settings("gw", {"gateway_tls_cert_file": "/etc/ssl/gw.pem"}).gateway_tls_cert_file == "/etc/ssl/gw.pem"
    with pytest.raises(SettingsError, match="gateway_tls_cert_file"):
        build_settings("gw", {"gateway_tls_cert_file": "gw.pem\n"})


def test_masked_key_maps_say_what_changes_never_the_key():
    old = gw.keys_map("alice-key-0123456789 alice\nbob-key-0123456789abc bob\n")
    new = gw.keys_map("alice-key-9876543210 alice\nbob-key-0123456789abc bob\ncarol-key-0123456789 carol\n")
    assert gw.masked_map(new, 0, old)[1:] == ["******** alice (changed)\n", "******** bob\n", "******** carol (new)\n"]
    engine = gw.masked_map(gw.engine_key_map(ENGINE_KEY), 1, gw.engine_key_map("other-engine-key-0123456"))
    assert engine[1:] == ["engine ******** (changed)\n"]
    # A line of another shape (hand-edited on the host) is masked whole.
    assert gw.masked_map("k1 k2 k3\n", 0) == ["********\n"]


def test_dry_diff_of_the_gateway_shows_the_key_maps_masked(caplog):
    """`--dry --diff` printed the clients' keys and the engine key, old and new."""
    old_client, new_client = "alice-key-0123456789", "alice-key-9876543210"
    old_engine, new_engine = "old-engine-key-0123456789", ENGINE_KEY
    old_scrape, new_scrape = "scrape-key-0123456789", "scrape-key-9876543210"
    host = FakeHost(
        files={
            GATEWAY_KEYS_MAP: (gw.keys_map(f"{old_client} alice\n"), 600),
            GATEWAY_ENGINE_KEY_MAP: (gw.engine_key_map(old_engine), 600),
            GATEWAY_METRICS_KEYS_MAP: (gw.keys_map(f"{old_scrape} prometheus\n"), 600),
        },
        running={"haproxy"},
        enabled={"haproxy"},
        diff=True,
    )
    caplog.set_level("INFO")
    host.commands(
        gw.gateway,
        config="global\n",
        client_keys=gw.keys_map(f"{new_client} alice\n"),
        engine_keys=gw.engine_key_map(new_engine),
        metrics_keys=gw.keys_map(f"{new_scrape} prometheus\n"),
        scrape="scrape_configs: []\n",
    )
    out = caplog.text
    assert f"Will modify {GATEWAY_KEYS_MAP}" in out and f"Will modify {GATEWAY_ENGINE_KEY_MAP}" in out
    assert f"Will modify {GATEWAY_METRICS_KEYS_MAP}" in out
    assert "******** alice (changed)" in out and "engine ******** (changed)" in out
    assert "******** prometheus (changed)" in out
    for key in (old_client, new_client, old_engine, new_engine, old_scrape, new_scrape):
        assert key not in out
    assert host.state is not None and host.state.config.DIFF  # pyinfra's own diff held off only while our puts ran


def test_each_server_with_a_host_agent_is_read_by_agent_check():
    """HAProxy reads each host's agent every 2 s (drain 0% / ready 100% / up);
    a host without an agent gets no agent-check."""
    backends = [GatewayBackend("ws1", "10.0.0.11", 8000, agent_port=8010), GatewayBackend("ws2", "10.0.0.12", 8000)]
    text = gw.haproxy_config(Settings(), backends, engine_key=True)
    assert "    server ws1 10.0.0.11:8000 maxconn 1 weight 24 agent-check agent-port 8010 agent-inter 2s\n" in text
    assert "    server ws2 10.0.0.12:8000 maxconn 1 weight 24\n" in text


@pytest.mark.parametrize("weights", [[24], [24, 256], [24, 60, 24]])
def test_no_line_of_haproxy_cfg_passes_haproxy_s_64_words(weights):
    """HAProxy 2.6 truncates a line after its 64th word ("too many words, truncating after word
    64", and `haproxy -c` fails): with one host its affinity rule held all 64 buckets in one
    `use-server` line, 85 words, and the gateway deploy failed. A host's buckets now take as many
    lines as they need, and every bucket is still placed exactly once."""
    backends = [GatewayBackend(f"ws{i}", f"10.0.0.{10 + i}", 8000, 1, w) for i, w in enumerate(weights, 1)]
    text = gw.haproxy_config(Settings(), backends, engine_key=True)
    too_long = [line for line in text.splitlines() if len(line.split()) > 64]
    assert too_long == []
    placed = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["use-server"] and "var(txn.bucket)" in line:
            placed += [int(w) for w in words[words.index("int") + 1 : words.index("}")]]
    assert sorted(placed) == list(range(gw.AFFINITY_BUCKETS))
