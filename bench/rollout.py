"""A rollout of the whole simulated fleet (tests/fleet) in batches, timed batch by batch.

    sudo .venv/bin/python bench/rollout.py [--hosts N] [--batches 1,25%,100%] [--keep-up]

Brings a fresh fleet of N hosts up (default FREETOKEN_SIM_HOSTS, else 3; hosts beyond ws3 repeat
the healthy profiles, tests/fleet/profiles.py) under harness.exclusive() and runs the rollout
exactly as a user does, `python -m freetoken_infra.rollout inventories/sim.py --batches ...
--data model_cache_host=ws1 --max-fail-pct 50`: the canary ws1 is the fleet's LAN model cache,
and ws3 (refused at preflight by design, one host of the 3 in the second batch of
`1,25%,100%` at 12 hosts) must not stop the rollout, hence the 50 %. Then the same rollout again,
which must change nothing. Prints, for both: the wall time, each batch's hosts and time (from
the rollout's `--> rollout batch N` line to the next one or the report), the fleet report's
count of results, and the bytes the hub stand-in sent over the model's size (target 1.0).
Figures, not assertions: tests/fleet/test_scale.py checks the outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet import harness  # noqa: E402

BATCH_LINE = re.compile(r"--> rollout batch (\d+): (.*)")
REPORT_LINE = "== fleet report =="
MAX_FAIL_PCT = "50"


def mark(line: str) -> str | None:
    """What a line of the rollout's output starts: a batch (its hosts, as the line lists them),
    the fleet report ("report"), or nothing (None)."""
    m = BATCH_LINE.search(line)
    if m:
        return m.group(2).strip()
    return "report" if REPORT_LINE in line else None


def batch_times(marks: list[tuple[str, float]], wall: float) -> list[tuple[str, float]]:
    """[(a batch's hosts, seconds from its line to the next mark or the end)] from the marks in
    the order seen, with the times they were seen at."""
    marks = [*marks, ("end", wall)]
    return [(hosts, marks[i + 1][1] - at) for i, (hosts, at) in enumerate(marks[:-1]) if hosts != "report"]


def rollout(batches: str) -> tuple[float, int, list[tuple[str, float]], dict]:
    """Run the rollout CLI; (wall s, exit status, [(batch hosts, seconds)], its JSON report)."""
    fd, report = tempfile.mkstemp(prefix="rollout-bench-", suffix=".json")
    os.close(fd)
    argv = [
        sys.executable,
        "-m",
        "freetoken_infra.rollout",
        "inventories/sim.py",
        "--batches",
        batches,
        "--data",
        "model_cache_host=ws1",
        "--max-fail-pct",
        MAX_FAIL_PCT,
        "--json",
        report,
    ]
    marks: list[tuple[str, float]] = []  # (what started, when)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        errors="replace",
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line])[-60:]
        what = mark(line)
        if what is not None:
            marks.append((what, time.monotonic() - t0))
    rc = proc.wait()
    wall = time.monotonic() - t0
    try:
        doc = json.loads(Path(report).read_text() or "{}")
    except ValueError:
        doc = {}
    finally:
        os.unlink(report)
    if not doc:
        print("".join(tail))
    return wall, rc, batch_times(marks, wall), doc


def upstream_ratio(fleet: harness.Fleet) -> float:
    from tests.fleet.client import hub
    from tests.fleet.standins import hub_repos

    size = sum(len(b) for b in hub_repos.repo_files(hub_repos.SUPPORTED_REPO).values())
    return sum(hub(fleet, "/_standin/stats")["by_file"].values()) / size


def results(doc: dict) -> tuple[Counter, int]:
    """The rollout's JSON report: how many hosts had each result, and how many of the ok ones
    changed nothing."""
    rows = doc.get("hosts", [])
    counts = Counter(str(row.get("result", "?")) for row in rows)
    unchanged = sum(1 for row in rows if row.get("result") == "ok" and row.get("reason") == "no change")
    return counts, unchanged


def show(label: str, result: tuple[float, int, list[tuple[str, float]], dict], ratio: float) -> None:
    wall, rc, batches, doc = result
    counts, unchanged = results(doc)
    print(
        f"\n{label}: {wall:.1f} s, exit status {rc}; results: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f" ({unchanged} of them with no change); upstream bytes / model size: {ratio:.3f}"
    )
    for i, (hosts, seconds) in enumerate(batches):
        n = len([h for h in hosts.split(",") if h.strip()])
        print(
            f"    {'canary ' if i == 0 else f'batch {i + 1}'}: {n:2d} host{'s' if n > 1 else ' '} "
            f"{seconds:7.1f} s  ({hosts})"
        )
    if doc.get("stopped"):
        print(f"    stopped: {doc['stopped']}")


def main() -> int:
    from bench.fleet_up import machine
    from tests.fleet.client import hub

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=None, help="hosts in the fleet (default: FREETOKEN_SIM_HOSTS, else 3)")
    ap.add_argument("--batches", default="1,25%,100%")
    ap.add_argument("--keep-up", action="store_true", help="leave the fleet running at the end")
    a = ap.parse_args()
    n = harness.host_count() if a.hosts is None else a.hosts
    with harness.exclusive():
        print(machine())
        harness.down(quiet=True)
        fleet = harness.up(n)
        try:
            first = rollout(a.batches)
            show(f"first rollout of {n} hosts, --batches {a.batches}", first, upstream_ratio(fleet))
            hub(fleet, "/_standin/reset", {})
            again = rollout(a.batches)
            show("the same rollout again (must change nothing)", again, upstream_ratio(fleet))
        finally:
            if not a.keep_up:
                harness.down(quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
