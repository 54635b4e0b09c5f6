"""The LAN model cache under slow and idle clients, on the simulated fleet: figures, not assertions.

    sudo .venv/bin/python bench/model_cache.py [--clients 500] [--hold-s 40] [--reuse] [--keep-up]

The cache is Debian's nginx as ``freetoken-model-cache.service`` on ws1 (``model_cache_host=ws1``). From ws2, at ws1's fleet address only, ``--clients`` connections are held for
``--hold-s`` seconds (bounded: the load stops by itself), half idle and half sending a request a
byte a second that never ends (each one the server closes is opened again at once:
tests/fleet/cache_load.py). Meanwhile a real client asks every 2 s for ``/health`` and for 1 KiB
of a verified shard (``Range``), each on a fresh connection with a 20 s timeout. Printed: the
latencies of both (p50, max, unanswered), and how many slow connections the server closed.
The same figures with no load come first, for comparison.

Brings the fleet up under harness.exclusive() and converges ws1 as the cache host (the model
from the hub stand-in), and takes it all down at the end (--keep-up leaves it running; --reuse
measures an already converged fleet whose ws1 is the cache host).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freetoken_infra.core.settings import Settings  # noqa: E402
from tests.fleet import harness  # noqa: E402
from tests.fleet.cache_load import latencies, slow_clients  # noqa: E402
from tests.fleet.client import deploy  # noqa: E402
from tests.fleet.standins import hub_repos  # noqa: E402

REPO = hub_repos.SUPPORTED_REPO
SHARD = "model-00001-of-00003.safetensors"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--hold-s", type=float, default=40.0)
    ap.add_argument("--reuse", action="store_true", help="measure the running fleet (ws1 already the cache host)")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running")
    args = ap.parse_args()
    with harness.exclusive():
        fleet = harness.Fleet() if args.reuse else harness.up()
        try:
            if not args.reuse:
                t = time.monotonic()
                run = deploy("--data", "model_cache_host=ws1", "--limit", "ws1")
                if run.returncode:
                    print("converge of ws1 failed", file=sys.stderr)
                    return 1
                print(f"converged ws1 as the LAN model cache in {time.monotonic() - t:.0f} s")
            address, port = fleet.hosts["ws1"].address, Settings().model_cache_port
            path = f"/{REPO}/resolve/{hub_repos.REPOS[REPO]['sha']}/{SHARD}"
            version = fleet.run("ws1", "/usr/sbin/nginx -v 2>&1", check=True).stdout.strip()
            print(f"cache: {version} on ws1 {address}:{port}; load from ws2")
            for clients, hold_s in ((0, 10.0), (args.clients, args.hold_s)):
                r = slow_clients(fleet, "ws2", address, port, path, clients=clients, hold_s=hold_s)
                print(
                    f"{clients} slow/idle clients for {hold_s:.0f} s: /health {latencies(r['health'])}; "
                    f"Range 1 KiB {latencies(r['range'])}; closed by the server {r['closed_by_server']}, "
                    f"open at the end {r['open_at_end']}"
                )
        finally:
            if not args.keep_up:
                harness.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
