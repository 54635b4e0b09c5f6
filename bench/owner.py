"""The owner's game against a steady load through the gateway, on the simulated fleet
(tests/fleet): how long the host agent takes to give the GPU back, whether any client sees an
error, and how long the host takes to come back after the game; figures, not assertions.

    sudo .venv/bin/python bench/owner.py [--rounds 3] [--quiet-s 5] [--reuse] [--keep-up]

The fleet: ws1 and ws2 behind the gateway (tests/fleet/gateway_load.py), the host agent on each
with `owner_quiet_s` = --quiet-s. Each round: 4 clients stream chat completions through the
gateway without pause; after 3 s "a game" takes all but 1 GiB of ws1's card (the nvidia-smi
stand-in's used memory, as tests/fleet/test_owner.py does); once the engine is stopped and 3 s
later the game ends. Per round: the time from the game's start to ws1 drained at the gateway
(HAProxy's view, read every 0.2 s) and to its engine stopped (its VRAM free; goal: at most 10 s),
the requests that failed before or while streaming (goal: none), and the time from the game's end
to ws1 back in service (goal: at most owner_quiet_s + 30 s). Then the medians.

The time from a queue building at the gateway to a sleeping host serving (Wake-on-LAN) is
measured by tests/fleet/test_wake.py, which prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet import harness  # noqa: E402
from tests.fleet.gateway_load import CLIENT_KEY, PORT, Load, Watcher, converge_behind_gateway, summary, write_keys  # noqa: E402
from tests.fleet.profiles import GATEWAY_ADDRESS, GATEWAY_NAME, PROFILES  # noqa: E402
from tests.fleet.test_owner import GAME, engine_active, in_service, wait_until  # noqa: E402


def one_round(fleet: harness.Fleet, quiet_s: float) -> dict:
    total = PROFILES["ws1"].gpu.memory_total_mib
    watcher = Watcher(fleet.ssh_argv(GATEWAY_NAME))
    try:
        wait_until("ws1 and ws2 in service", lambda: in_service(watcher, "ws1", "ws2"), 120)
        with Load(GATEWAY_ADDRESS, PORT, CLIENT_KEY, clients=4, max_tokens=12, max_seconds=240) as load:
            time.sleep(3)
            game = time.time()
            fleet.run("ws1", f"echo {total - 1024} > {GAME}", check=True)
            drained = watcher.wait_for("ws1", lambda s: s != "UP", game, 30)
            stopped = wait_until("ws1's engine stopped", lambda: not engine_active(fleet, "ws1"), 30)
            time.sleep(3)
            over = time.time()
            fleet.run("ws1", f"rm -f {GAME}", check=True)
            back = watcher.wait_for("ws1", lambda s: s == "UP", over, quiet_s + 90)
            time.sleep(3)
        result = summary(load.stop())
    finally:
        fleet.run("ws1", f"rm -f {GAME}")
        watcher.close()
    return {
        "drained": None if drained is None else drained - game,
        "stopped": stopped - game,
        "back": None if back is None else back - over,
        "requests": result["requests"],
        "failed": len(result["failed_before_streaming"]) + len(result["failed_while_streaming"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quiet-s", type=float, default=5, help="owner_quiet_s on the workstations")
    ap.add_argument("--reuse", action="store_true", help="measure the running fleet and gateway as converged")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running")
    args = ap.parse_args()
    with harness.exclusive():
        fleet = harness.Fleet() if args.reuse else harness.up(gateway=True)
        try:
            if not args.reuse:
                with tempfile.TemporaryDirectory() as d:
                    extra = ["--data", f"owner_quiet_s={args.quiet_s:g}"]
                    hosts, gateway = converge_behind_gateway(write_keys(Path(d) / "keys"), extra, shared=False)
                    if hosts.returncode or gateway.returncode:
                        print("converge failed", file=sys.stderr)
                        return 1
            print(f"ws1 and ws2 behind the gateway, 4 streaming clients, owner_quiet_s {args.quiet_s:g}")
            rounds = []
            for i in range(args.rounds):
                r = one_round(fleet, args.quiet_s)
                rounds.append(r)

                def s(v: float | None) -> str:
                    return "never" if v is None else f"{v:.2f} s"

                print(
                    f"round {i + 1}: drained {s(r['drained'])}, engine stopped (VRAM free) {s(r['stopped'])} "
                    f"after the game started; back in service {s(r['back'])} after it ended; "
                    f"{r['failed']} of {r['requests']} requests failed"
                )
            for key, goal in (
                ("drained", "-"),
                ("stopped", "goal <= 10 s"),
                ("back", f"goal <= {args.quiet_s + 30:g} s"),
            ):
                values = [r[key] for r in rounds if r[key] is not None]
                if values:
                    print(f"median {key}: {statistics.median(values):.2f} s (max {max(values):.2f}; {goal})")
            print(f"failed requests in all: {sum(r['failed'] for r in rounds)} of {sum(r['requests'] for r in rounds)}")
        finally:
            if not args.keep_up:
                harness.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
