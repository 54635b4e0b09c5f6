"""python -m tests.fleet up [--hosts N] | down | status   (as root; see tests/fleet/harness.py)

`up` and `down` take the fleet lock (harness.exclusive()) like the pytest fixture and the
benchmark: while another session holds the fleet they say so and wait for it."""
import argparse
import json
import sys

from tests.fleet import harness


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fleet",
                                 description="the simulated FreeToken fleet (nspawn hosts)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring the fleet up (cleans leftovers first)")
    p_up.add_argument("--hosts", type=int, default=None,
                      help="number of hosts (default: FREETOKEN_SIM_HOSTS, else one per profile)")
    sub.add_parser("down", help="stop everything and remove host copies")
    sub.add_parser("status", help="print what runs, as JSON")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            with harness.exclusive():
                fleet = harness.up(a.hosts)
                print(json.dumps({n: h.address for n, h in fleet.hosts.items()}, indent=1))
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
