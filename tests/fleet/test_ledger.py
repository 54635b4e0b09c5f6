"""The ledger and the dashboard on the simulated fleet: Debian's Prometheus on the gateway host
as the gateway deploy with `alerting_enabled` configures it (the shared gateway fleet), a known load goes
through the gateway, and `python -m freetoken_infra.ledger` counts its requests and tokens; every
panel of dashboards/freetoken.json is evaluated by that Prometheus."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from freetoken_infra import ledger
from tests.fleet.gateway_load import CLIENT_KEY, PORT, stream_chat
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME
from tests.fleet.test_gateway import eventually, gateway, keys, wait_in_service  # noqa: F401
from tests.unit.test_dashboard import DASHBOARD, substitute

pytestmark = pytest.mark.fleet

ENDPOINT = {"url": ""}  # the gateway's Prometheus as the controller reaches it (the fixture's tunnel)
SCRAPE_S = 2
REQUESTS, MAX_TOKENS = 20, 16  # the stand-in engine answers "hi" with max_tokens words
# May be empty on a fleet where no owner claimed a host.
MAY_BE_EMPTY = {"Hours yielded by reason (dashboard range)"}


def query(expr: str) -> list:
    answer = requests.get(ENDPOINT["url"] + "/api/v1/query", params={"query": expr}, timeout=30).json()
    assert answer["status"] == "success", f"{answer.get('error')} in {expr}"
    return answer["data"]["result"]


@pytest.fixture(scope="module")
def prometheus(gateway):
    """The gateway's Prometheus (its deploy's, `alerting_enabled`, on the shared gateway fleet),
    which listens on the gateway's loopback only: reached from the controller through an SSH
    tunnel, as an operator reads it from elsewhere."""
    fleet = gateway["fleet"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ssh = fleet.ssh_argv(GATEWAY_NAME)
    forward = ["-N", "-o", "ExitOnForwardFailure=yes", "-L", f"127.0.0.1:{port}:127.0.0.1:9090"]
    tunnel = subprocess.Popen([*ssh[:-1], *forward, ssh[-1]], stdin=subprocess.DEVNULL)
    ENDPOINT["url"] = f"http://127.0.0.1:{port}"
    try:

        def agents_scraped() -> bool:
            try:
                hosts = {s["metric"]["host"] for s in query("freetoken_engine_generated_tokens_total")}
            except requests.RequestException:
                return False
            return {"ws1", "ws2"} <= hosts

        assert eventually(agents_scraped, timeout=120), "no engine counters of ws1 and ws2 in Prometheus"
        yield ENDPOINT["url"]
    finally:
        tunnel.terminate()
        tunnel.wait(timeout=30)


def test_the_ledger_counts_the_requests_and_tokens_of_a_known_load(gateway, prometheus):
    wait_in_service(gateway["fleet"], ["ws1", "ws2"])
    time.sleep(4 * SCRAPE_S)  # flat counters before the load: nothing to extrapolate at the window's start
    start = time.time()
    outcomes = [stream_chat(GATEWAY_ADDRESS, PORT, CLIENT_KEY, max_tokens=MAX_TOKENS) for _ in range(REQUESTS)]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    time.sleep(10 * SCRAPE_S)  # the agents' next writes, scraped; flat again at the end
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = ledger.main(
            [
                "--prometheus",
                prometheus,
                "--since",
                f"{int(time.time() - start) + 2 * SCRAPE_S}s",
                "--step",
                "1s",
                "--json",
            ]
        )
    assert code == 0
    hosts = json.loads(out.getvalue())["hosts"]
    print(json.dumps(hosts, indent=1))
    served = sum(hosts[h]["tokens"] or 0 for h in ("ws1", "ws2"))
    asked = sum(hosts[h]["requests"] or 0 for h in ("ws1", "ws2"))
    assert served == pytest.approx(REQUESTS * MAX_TOKENS, rel=0.1), hosts
    assert asked == pytest.approx(REQUESTS, rel=0.1), hosts
    assert hosts["ws1"]["modes_h"]["serving"] > 0 and hosts["ws2"]["modes_h"]["serving"] > 0


def test_every_dashboard_panel_answers_from_the_fleet_s_prometheus(prometheus):
    panels = json.loads(Path(DASHBOARD).read_text())["panels"]
    for p in panels:
        for t in p["targets"]:
            result = query(substitute(t["expr"]))
            assert result or p["title"] in MAY_BE_EMPTY, f"{p['title']} {t['refId']}: no data"
