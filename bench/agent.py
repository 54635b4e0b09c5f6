"""What the host agent costs its owner on the simulated fleet (tests/fleet): CPU seconds per
second and resident memory of `freetoken-agent.service` on each workstation, while it serves
and while it has yielded to a game; figures, not assertions (targets: at most
0.005 CPU-s per second, 0.5 % of a core, and 40 MiB).

    sudo .venv/bin/python bench/agent.py [--seconds 60] [--reuse] [--keep-up]

The fleet: ws1 and ws2 converged behind the gateway (tests/fleet/gateway_load.py), the agent
reading the card through the NVML stand-in (tests/fleet/standins/libnvidia-ml.c). The agent's
CPU is read as bench/converge.py reads a host's resident services: from a cpuacct cgroup (v1)
the bench puts its processes in (nanoseconds, the programs it starts counted too), else from
utime+stime+cutime+cstime of its process (10 ms clock ticks), over --seconds. Its memory:
VmRSS of its process (/proc/PID/status). Serving: the engines up, nobody's game. Yielded: a game
holds all but 1 GiB of each card (the stand-ins' /.sim/gpu-memory-used-mib, as
tests/fleet/test_owner.py sets it), measured once each engine is stopped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOSTS = ("ws1", "ws2")
GOAL_CPU = 0.005  # CPU-s per second
GOAL_RSS_MIB = 40


def rss_kib(status: str) -> int | None:
    """VmRSS of a /proc/PID/status text, in KiB (``VmRSS:\\t   12345 kB``), or None."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name == "VmRSS":
            parts = value.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1] == "kB":
                return int(parts[0])
            return None
    return None


def rate(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """CPU-s per second of each host in both readings."""
    return {h: (after[h] - before[h]) / seconds for h in after if h in before and seconds > 0}


def agent_pids() -> dict[str, list[str]]:
    from bench import converge
    from tests.fleet import harness

    out: dict[str, list[str]] = {}
    for name, h in (harness.load_state() or {"hosts": {}})["hosts"].items():
        out[name] = [pid for pid in converge._netns_pids(h["netns"]) if converge._is_resident(pid)]
    return out


def agent_rss_mib() -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pids in agent_pids().items():
        total = 0
        for pid in pids:
            try:
                total += rss_kib(Path(f"/proc/{pid}/status").read_text()) or 0
            except OSError:
                pass
        out[name] = total / 1024
    return out


def measure(seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    from bench import converge

    converge.place_hosts()  # the agent (a resident service) into its host's resident cgroup
    before, t0 = converge.host_cpu_seconds(resident=True), time.monotonic()
    time.sleep(seconds)
    after, t1 = converge.host_cpu_seconds(resident=True), time.monotonic()
    return rate(before, after, t1 - t0), agent_rss_mib()


def show(phase: str, cpu: dict[str, float], rss: dict[str, float]) -> None:
    for host in HOSTS:
        c, r = cpu.get(host), rss.get(host)
        cpu_text = "-" if c is None else f"{c:.4f} CPU-s/s ({100 * c:.2f} % of a core; goal <= {GOAL_CPU})"
        rss_text = "-" if r is None else f"{r:.1f} MiB (goal <= {GOAL_RSS_MIB})"
        print(f"{phase:8} {host}: {cpu_text}, RSS {rss_text}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--reuse", action="store_true", help="measure the running fleet as converged")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running")
    args = ap.parse_args()
    from bench import converge
    from tests.fleet import harness
    from tests.fleet.gateway_load import converge_behind_gateway, write_keys
    from tests.fleet.profiles import PROFILES
    from tests.fleet.test_owner import GAME, engine_active, wait_until

    with harness.exclusive():
        fleet = harness.Fleet() if args.reuse else harness.up(gateway=True)
        try:
            if not args.reuse:
                with tempfile.TemporaryDirectory() as d:
                    hosts, gateway = converge_behind_gateway(write_keys(Path(d) / "keys"), shared=False)
                    if hosts.returncode or gateway.returncode:
                        print("converge failed", file=sys.stderr)
                        return 1
            for host in HOSTS:
                wait_until(f"{host}'s engine up", lambda h=host: engine_active(fleet, h), 120)
            time.sleep(5)
            show("serving", *measure(args.seconds))
            try:
                for host in HOSTS:
                    fleet.run(host, f"echo {PROFILES[host].gpu.memory_total_mib - 1024} > {GAME}", check=True)
                for host in HOSTS:
                    wait_until(f"{host}'s engine stopped", lambda h=host: not engine_active(fleet, h), 60)
                time.sleep(5)
                show("yielded", *measure(args.seconds))
            finally:
                for host in HOSTS:
                    fleet.run(host, f"rm -f {GAME}")
        finally:
            converge.remove_cgroups()
            if not args.keep_up:
                harness.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
