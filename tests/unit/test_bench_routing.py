"""bench/routing.py's rewrite of the deployed haproxy.cfg into least connections without slots,
and its figures, against what today's gateway code writes (the bench itself needs the simulated
fleet)."""

from __future__ import annotations

import re

import pytest

from bench import routing as bench
from freetoken_infra.core.layout import GATEWAY_BACKEND, SESSION_HEADER
from freetoken_infra.core.settings import Settings
from operations import gateway as gw
from operations.gateway import GatewayBackend

BACKENDS = [
    GatewayBackend("ws1", "10.213.0.11", 8000, slots=1, weight=24, agent_port=9105),
    GatewayBackend("ws2", "10.213.0.12", 8000, slots=2, weight=60, agent_port=9105),
    GatewayBackend("ws10", "10.213.0.20", 8001, slots=2, weight=60),
]


def backend(text: str, name: str) -> str:
    return text.split(f"\nbackend {name}\n", 1)[1].split("\n\n", 1)[0]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"tls": True, "waker": True},
        {"settings": {"gateway_prefix_affinity_bytes": 0}},
    ],
    ids=["deployed", "tls and waker", "no prefix affinity"],
)
def test_the_rewrite_of_todays_config_drops_slots_weights_and_buckets_and_keeps_the_rest(options):
    settings = Settings(**options.get("settings", {}))
    deployed = gw.haproxy_config(
        settings, BACKENDS, engine_key=True, tls=options.get("tls", False), waker=options.get("waker", False)
    )
    before = bench.leastconn_without_slots(deployed)
    main = backend(before, GATEWAY_BACKEND)
    # every host, with no limit or weight, its own options (the agent check) kept
    assert "    server ws1 10.213.0.11:8000 agent-check agent-port 9105 agent-inter" in main
    assert "    server ws2 10.213.0.12:8000 agent-check agent-port 9105 agent-inter" in main
    assert "\n    server ws10 10.213.0.20:8001\n" in main + "\n"
    assert not re.search(r"maxconn|weight|use-server", main)
    assert "txn.bucket" not in before and "use-server" not in before
    assert "    balance leastconn\n" in main
    # conversations on a consistently hashed backend whose servers follow the first's
    sessions = backend(before, bench.SESSIONS_BACKEND)
    session = SESSION_HEADER.lower()
    assert f"    balance hdr({session})\n    hash-type consistent\n" in sessions
    assert [line for line in sessions.splitlines() if line.startswith("    server ")] == [
        f"    server {b.name} {b.address}:{b.port} track {GATEWAY_BACKEND}/{b.name}" for b in BACKENDS
    ]
    assert re.search(r"^    retry-on .*\n    retries 3\n    option redispatch 1$", sessions, re.M)
    assert (
        f"    use_backend {bench.SESSIONS_BACKEND} if {{ req.hdr({session}) -m found }}\n"
        f"    default_backend {GATEWAY_BACKEND}\n" in before
    )
    # everything else as deployed: what it removes is the slots, weights and buckets; what it
    # adds is the use_backend line and the second backend
    old, new = set(deployed.splitlines()), set(before.splitlines())
    assert {line for line in old - new if not line.startswith("    server ")} == {
        line for line in old if line.startswith(("    use-server ", "    http-request set-var(txn.bucket)"))
    }
    agent = f" agent-check agent-port 9105 agent-inter {gw.AGENT_INTER}"
    assert new - old == {
        f"    use_backend {bench.SESSIONS_BACKEND} if {{ req.hdr({session}) -m found }}",
        *(f"    server {b.name} {b.address}:{b.port}" + (agent if b.agent_port else "") for b in BACKENDS),
        f"backend {bench.SESSIONS_BACKEND}",
        *sessions.splitlines(),
    } - old - {""}


def test_a_config_it_does_not_know_is_named_not_rewritten():
    deployed = gw.haproxy_config(Settings(), BACKENDS, engine_key=True)
    with pytest.raises(bench.UnexpectedConfig, match="maxconn N weight W"):
        bench.leastconn_without_slots(re.sub(r" maxconn \d+ weight \d+", "", deployed))
    with pytest.raises(bench.UnexpectedConfig, match="after its address"):
        bench.leastconn_without_slots(deployed.replace("maxconn 1 weight 24", "weight 24 maxconn 1"))
    with pytest.raises(bench.UnexpectedConfig, match="default_backend"):
        bench.leastconn_without_slots(deployed.replace(f"default_backend {GATEWAY_BACKEND}", "default_backend x"))
    with pytest.raises(bench.UnexpectedConfig, match="retry-on"):
        bench.leastconn_without_slots(re.sub(r"\n    retries 3", "", deployed))


def test_the_figures_of_a_load():
    turns = [
        bench.Turn(0.0, 200, "ws1", 0.5, 10, "a"),
        bench.Turn(0.0, 200, "ws1", 1.5, 10, "a"),
        bench.Turn(0.0, 200, "ws2", 1.0, 10, "a"),
        bench.Turn(0.0, 200, "ws2", 0.2, 20, None),
        bench.Turn(0.0, 503, None, None, 0, "b"),
        bench.Turn(0.0, -1, None, None, 0, None),
    ]
    f = bench.figures(turns, seconds=10.0, capacity=10.0)
    assert f["requests"] == 6 and f["tok/s"] == 5.0 and f["of capacity"] == 0.5
    assert (f["5xx"], f["other failures"]) == (1, 1)
    assert f["session kept"] == pytest.approx(2 / 3)  # a: 2 of its 3 turns on ws1
    assert f["by host"] == {"ws1": 2, "ws2": 2}
    assert (f["ttft p50 s"], f["ttft p99 s"]) == (1.0, 1.5)
    assert bench.pct([], 50) != bench.pct([], 50)  # nan: no figure, not 0
