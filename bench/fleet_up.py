"""Time to bring up the simulated fleet (tests/fleet) with the root fs cache cold and warm, and the
memory each simulated host costs.

    sudo .venv/bin/python bench/fleet_up.py [--hosts N] [--warm-runs 3] [--skip-cold]

Cold: a fresh, empty cache dir (debootstrap + .deb cache from scratch), removed afterwards.
Warm: the normal cache (FREETOKEN_SIM_CACHE or /var/cache/freetoken-sim), already built.
Each run is `up` then `down`; prints the machine it ran on and the median per mode.

Memory per host, after each warm bring-up (hosts booted, nothing deployed yet; bench/converge.py
prints the same after a converge, engines serving): the containers have no cgroup of their own
here (nspawn runs with --keep-unit under a host without systemd), so a host's cost is the sum of
the proportional set size (PSS, /proc/PID/smaps_rollup) of its nspawn process and of every
process in its network namespace (the container's systemd, journald, sshd, ...: all of them
share it). Beside it, the drop of the machine's MemAvailable from before `up` to after, per host
(includes the kernel's share and page cache; noisy on a shared machine), and the disk each
host's root fs copy takes.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fleet import harness


def machine() -> str:
    mem_kb = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal:")))
    return (
        f"{subprocess.run(['uname', '-a'], capture_output=True, text=True).stdout.strip()}\n"
        f"nproc={os.cpu_count()} memory={mem_kb / 1024**2:.1f} GiB "
        f"python={platform.python_version()}"
    )


def mem_available() -> int:
    """The machine's MemAvailable, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
    except OSError:  # gone in the meantime
        return 0


def host_memory() -> dict[str, tuple[int, int]]:
    """Per running simulated host: (PSS bytes, processes) of its nspawn and every process in its
    network namespace."""
    state = harness.load_state() or {"hosts": {}}
    out = {}
    for name, h in state["hosts"].items():
        r = subprocess.run(["ip", "netns", "pids", h["netns"]], capture_output=True, text=True)
        pids = [int(p) for p in r.stdout.split()] + ([h["pid"]] if h.get("pid") else [])
        out[name] = (sum(_pss(pid) for pid in pids), len(pids))
    return out


def disk_bytes(path: str) -> int:
    r = subprocess.run(["du", "-sb", path], capture_output=True, text=True)
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout else 0


def format_memory(label: str, per_host: dict[str, tuple[int, int]], available_drop: int | None) -> str:
    """One figure block: PSS per host (median, min, max, sum) and the MemAvailable drop per host."""
    if not per_host:
        return f"memory per host, {label}: no host running"
    mib = [pss / 2**20 for pss, _ in per_host.values()]
    procs = statistics.median(n for _, n in per_host.values())
    line = (
        f"memory per host, {label}: PSS median {statistics.median(mib):.0f} MiB (min {min(mib):.0f}, "
        f"max {max(mib):.0f}; {procs:.0f} processes), {sum(mib):.0f} MiB for {len(mib)} hosts"
    )
    if available_drop is not None:
        line += (
            f"; MemAvailable dropped {available_drop / 2**20 / len(mib):.0f} MiB per host "
            f"({available_drop / 2**30:.2f} GiB in all)"
        )
    return line


def timed_up(n: int, memory: list[str] | None = None, run: int = 1) -> float:
    """Seconds to bring `n` hosts up; with `memory`, its per-host figures appended to it."""
    before = mem_available()
    t0 = time.monotonic()
    harness.up(n)
    elapsed = time.monotonic() - t0
    if memory is not None:
        time.sleep(5)  # let the hosts' boot settle (journald, sshd's first connections)
        per_host = host_memory()
        memory.append(format_memory(f"booted, idle (run {run})", per_host, before - mem_available()))
        state = harness.load_state() or {"hosts": {}}
        disks = [disk_bytes(h["root"]) / 2**20 for h in state["hosts"].values()]
        if disks and run == 1:
            memory.append(
                f"disk per host (root fs copy): median {statistics.median(disks):.0f} MiB, "
                f"{sum(disks) / 1024:.1f} GiB for {len(disks)} hosts"
            )
    harness.down(quiet=True)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=None, help="default: FREETOKEN_SIM_HOSTS, else one host per profile")
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--skip-cold", action="store_true")
    a = ap.parse_args()
    a.hosts = harness.host_count() if a.hosts is None else a.hosts
    with harness.exclusive():
        return _bench(a)


def _bench(a: argparse.Namespace) -> int:
    print(machine())
    results = {}
    harness.down(quiet=True)
    if not a.skip_cold:
        saved = os.environ.get("FREETOKEN_SIM_CACHE")
        cold = tempfile.mkdtemp(prefix="freetoken-sim-cold-", dir="/var/tmp")
        os.environ["FREETOKEN_SIM_CACHE"] = cold
        try:
            results["cold (debootstrap + up)"] = [timed_up(a.hosts)]
        finally:
            harness.down(quiet=True)
            shutil.rmtree(cold, ignore_errors=True)
            if saved is None:
                os.environ.pop("FREETOKEN_SIM_CACHE")
            else:
                os.environ["FREETOKEN_SIM_CACHE"] = saved
    harness.ensure_base_rootfs()
    memory: list[str] = []
    results["warm (cached root fs)"] = [timed_up(a.hosts, memory, i + 1) for i in range(a.warm_runs)]
    for mode, times in results.items():
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(f"{a.hosts} hosts, {mode}: median {statistics.median(times):.1f} s  (runs: {runs})")
    print("\n".join(memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
