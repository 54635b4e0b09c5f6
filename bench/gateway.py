"""What the fleet's gateway (deploys/gateway.py, HAProxy) costs and how fast it reacts, on the
simulated fleet (tests/fleet): figures, not assertions.

    sudo .venv/bin/python bench/gateway.py [--requests 400] [--failovers 3] [--reuse] [--keep-up]

1. Added latency: the same small request (`GET /v1/models`, no generation) sent from the
   controller straight to ws1's engine and through the gateway to ws1 (ws2 drained meanwhile),
   interleaved, on kept-alive connections; p50 and p99 of each and of the difference (targets:
   p50 <= 1 ms, p99 <= 5 ms added).
2. Failover: ws1's engine killed (`kill -9` of its main process) and ws1 powered off, each
   --failovers times; the time until the gateway takes ws1 out of service, read from HAProxy's
   own state on the gateway host every 50 ms (target: <= 5 s), and the time back in service.

Brings the fleet up with its gateway host (harness.up(gateway=True)) under harness.exclusive(),
converges ws1 and ws2 behind it and the gateway, and takes it all down at the end (--keep-up
leaves it running; --reuse measures an already converged fleet with its gateway). Traffic goes
only to the simulated fleet's addresses.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken_infra.fleet import parse_stat, runtime_command  # noqa: E402
from tests.fleet import harness  # noqa: E402
from tests.fleet.gateway_load import (  # noqa: E402
    CLIENT_KEY,
    ENGINE_KEY,
    PORT,
    Watcher,
    converge_behind_gateway,
    write_keys,
)
from tests.fleet.profiles import BRIDGE_ADDRESS, GATEWAY_ADDRESS, GATEWAY_NAME, host_address  # noqa: E402

KILL_ENGINE = "kill -9 $(systemctl show -p MainPID --value freetoken.service)"


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def timed_get(conn: http.client.HTTPConnection, key: str) -> float:
    t = time.perf_counter()
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    resp.read()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status} from {conn.host}:{conn.port}")
    return (time.perf_counter() - t) * 1000


def added_latency(fleet: harness.Fleet, n: int) -> None:
    fleet.run(GATEWAY_NAME, runtime_command("set server freetoken/ws2 state drain"), check=True)
    try:
        direct = http.client.HTTPConnection(host_address("ws1"), 8000, timeout=30)
        via = http.client.HTTPConnection(GATEWAY_ADDRESS, PORT, timeout=30)
        for _ in range(20):  # warm both paths (connections, caches)
            timed_get(direct, ENGINE_KEY), timed_get(via, CLIENT_KEY)
        d, g = [], []
        for _ in range(n):
            d.append(timed_get(direct, ENGINE_KEY))
            g.append(timed_get(via, CLIENT_KEY))
        added = [b - a for a, b in zip(d, g, strict=False)]
        print(f"\n== added latency, {n} interleaved requests (GET /v1/models on ws1, ms) ==")
        print(f"{'path':<22}{'p50':>8}{'p99':>8}{'mean':>8}")
        for name, vals in (("direct to ws1", d), ("through the gateway", g)):
            print(f"{name:<22}{pct(vals, 50):>8.3f}{pct(vals, 99):>8.3f}{statistics.mean(vals):>8.3f}")
        print(f"{'added (pairs)':<22}{pct(added, 50):>8.3f}{pct(added, 99):>8.3f}{statistics.mean(added):>8.3f}")
        print(
            f"added at the percentiles: p50 {pct(g, 50) - pct(d, 50):.3f} ms, "
            f"p99 {pct(g, 99) - pct(d, 99):.3f} ms (targets: <= 1 ms, <= 5 ms)"
        )
    finally:
        fleet.run(GATEWAY_NAME, runtime_command("set server freetoken/ws2 state ready"), check=True)


def wait_in_service(fleet: harness.Fleet, host: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = fleet.run(GATEWAY_NAME, runtime_command("show stat")).stdout
        if any(s.host == host and s.state == "in service" for s in parse_stat(out)):
            return
        time.sleep(0.5)
    raise RuntimeError(f"{host} not back in service within {timeout:.0f} s")


def failover(fleet: harness.Fleet, rounds: int) -> None:
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    rows = []
    try:
        time.sleep(1)
        for kind in ("engine killed", "powered off"):
            for _ in range(rounds):
                wait_in_service(fleet, "ws1")
                t = time.time()
                if kind == "engine killed":
                    fleet.run("ws1", KILL_ENGINE, check=True)
                else:
                    fleet.power_off("ws1")
                out = watcher.wait_for("ws1", lambda s: not s.startswith("UP"), t, 60)
                if kind == "powered off":
                    fleet.power_on("ws1")
                back = watcher.wait_for("ws1", lambda s: s == "UP", t, 240)
                rows.append((kind, None if out is None else out - t, None if back is None else back - t))
    finally:
        watcher.close()
    print("\n== failover: ws1 out of the gateway's service, and back (s) ==")
    print(f"{'event':<16}{'out after':>10}{'back after':>12}")
    for kind, out, back in rows:
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{kind:<16}{fmt(out):>10}{fmt(back):>12}")
    outs = [o for _, o, _ in rows if o is not None]
    if outs:
        print(f"out of service: max {max(outs):.2f} s over {len(outs)} event(s) (target: <= 5 s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="measure the running, converged fleet and gateway")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running")
    args = ap.parse_args()
    with harness.exclusive():
        if args.reuse:
            fleet = harness.Fleet()
        else:
            fleet = harness.up(gateway=True)
        try:
            if not args.reuse:
                with tempfile.TemporaryDirectory() as d:
                    t = time.monotonic()
                    # The direct path is measured from this machine (the bridge): the engines'
                    # firewall admits it only when told (operations/firewall.py).
                    hosts, gateway = converge_behind_gateway(
                        write_keys(Path(d) / "keys"),
                        extra=["--data", f"firewall_engine_from={BRIDGE_ADDRESS}"],
                        shared=False,
                    )
                    if hosts.returncode or gateway.returncode:
                        print("converge failed", file=sys.stderr)
                        return 1
                    print(f"converged ws1, ws2 and the gateway in {time.monotonic() - t:.0f} s")
            wait_in_service(fleet, "ws1")
            wait_in_service(fleet, "ws2")
            added_latency(fleet, args.requests)
            failover(fleet, args.failovers)
        finally:
            if not args.keep_up:
                harness.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
