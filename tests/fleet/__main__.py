"""python -m tests.fleet up [--hosts N] [--gateway] | down | status   (as root; see tests/fleet/harness.py)

`up` and `down` take the fleet lock (harness.exclusive()) like the pytest fixture and the
benchmark: while another session holds the fleet they say so and wait for it."""

import argparse
import json
import sys

from tests.fleet import harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.fleet", description="the simulated FreeToken fleet (nspawn hosts)"
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring the fleet up (cleans leftovers first)")
    p_up.add_argument(
        "--hosts", type=int, default=None, help="number of hosts (default: FREETOKEN_SIM_HOSTS, else one per profile)"
    )
    p_up.add_argument(
        "--gateway", action="store_true", help="also boot the gateway host (plain Debian, for deploys/gateway.py)"
    )
    sub.add_parser("down", help="stop everything and remove host copies")
    sub.add_parser("status", help="print what runs, as JSON")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            with harness.exclusive():
                fleet = harness.up(a.hosts, gateway=a.gateway)
                addresses = {n: h.address for n, h in fleet.hosts.items()}
                if fleet.gateway:
                    addresses[fleet.gateway["name"]] = fleet.gateway["address"]
                print(json.dumps(addresses, indent=1))
                print(f"state: {fleet.state_path}")
        elif a.cmd == "down":
            with harness.exclusive():
                harness.down()
        else:
            print(json.dumps(harness.status(), indent=1))
    except harness.FleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
