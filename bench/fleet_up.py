"""Time to bring up the simulated fleet (tests/fleet) with the root fs cache cold and warm.

    sudo .venv/bin/python bench/fleet_up.py [--hosts N] [--warm-runs 3] [--skip-cold]

Cold: a fresh, empty cache dir (debootstrap + .deb cache from scratch), removed afterwards.
Warm: the normal cache (FREETOKEN_SIM_CACHE or /var/cache/freetoken-sim), already built.
Each run is `up` then `down`; prints the machine it ran on and the median per mode.
"""
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
from tests.fleet import harness  # noqa: E402


def machine() -> str:
    mem_kb = int(next(line.split()[1] for line in open("/proc/meminfo")
                      if line.startswith("MemTotal:")))
    return (f"{subprocess.run(['uname', '-a'], capture_output=True, text=True).stdout.strip()}\n"
            f"nproc={os.cpu_count()} memory={mem_kb / 1024 ** 2:.1f} GiB "
            f"python={platform.python_version()}")


def timed_up(n: int) -> float:
    t0 = time.monotonic()
    harness.up(n)
    elapsed = time.monotonic() - t0
    harness.down(quiet=True)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", type=int, default=None,
                    help="default: FREETOKEN_SIM_HOSTS, else one host per profile")
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--skip-cold", action="store_true")
    a = ap.parse_args()
    a.hosts = harness.host_count() if a.hosts is None else a.hosts
    with harness.exclusive():
        return _bench(a)


def _bench(a) -> int:
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
    results["warm (cached root fs)"] = [timed_up(a.hosts) for _ in range(a.warm_runs)]
    for mode, times in results.items():
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(f"{a.hosts} hosts, {mode}: median {statistics.median(times):.1f} s  (runs: {runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
