"""How fast the host agent answers HAProxy's agent check (its port, operations/scripts/
owner_agent.py) when idle, under a flood of connections and half-open ones, and after it:
figures, not assertions (the unit test tests/unit/test_owner_windows.py checks that it keeps
answering only its words and keeps its state; how fast is this bench's). Target: every answer
well within HAProxy's `timeout check` (1.5 s, operations/gateway.py), p99 at most 100 ms.

    .venv/bin/python bench/agent_check.py [--asks 200] [--flooders 8] [--half-open 64]

No fleet: the agent runs here as a process on the stand-ins of the unit test
(tests.unit.test_owner_windows.agent_on_standins: nvidia-smi, systemctl, a Windows System32 of
scripts), its agent-check port on loopback. Idle: --asks sequential asks. Flood: --flooders
threads asking without pause, --half-open connections opened and never read, while --asks
sequential asks are timed. After: --asks again once the flood is over.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.unit.test_owner_windows import _ask, _wait, agent_on_standins  # noqa: E402


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def timed_asks(port: int, n: int) -> tuple[list[float], int]:
    """Milliseconds of each of n asks answered `up`, and how many were not."""
    times, wrong = [], 0
    for _ in range(n):
        t = time.perf_counter()
        answer = _ask(port, timeout=30)
        if answer == b"up\n":
            times.append((time.perf_counter() - t) * 1000)
        else:
            wrong += 1
    return times, wrong


def line(phase: str, times: list[float], wrong: int) -> str:
    if not times:
        return f"{phase:<14} no answer ({wrong} asks)"
    return (
        f"{phase:<14} p50 {pct(times, 50):7.2f} ms  p99 {pct(times, 99):7.2f} ms  max {max(times):7.2f} ms"
        f"  ({len(times)} answered, {wrong} not)"
    )


def measure(asks: int, flooders: int, half_open: int) -> dict[str, tuple[list[float], int]]:
    with tempfile.TemporaryDirectory(prefix="bench-agent-check-") as tmp, agent_on_standins(Path(tmp)) as running:
        proc, port = running[0], running[1]
        if not _wait(lambda: _ask(port) == b"up\n", timeout=60):
            raise SystemExit("the agent did not answer `up` within 60 s")
        out = {"idle": timed_asks(port, asks)}
        stop = threading.Event()

        def flood() -> None:
            while not stop.is_set():
                _ask(port, b"ready 100%\n")

        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(half_open)]
        threads = [threading.Thread(target=flood, daemon=True) for _ in range(flooders)]
        for t in threads:
            t.start()
        try:
            out["under flood"] = timed_asks(port, asks)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
            for c in idle:
                c.close()
        out["after"] = timed_asks(port, asks)
        if proc.poll() is not None:
            raise SystemExit(f"the agent exited ({proc.returncode})")
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--asks", type=int, default=200)
    ap.add_argument("--flooders", type=int, default=8)
    ap.add_argument("--half-open", type=int, default=64)
    args = ap.parse_args(argv)
    results = measure(args.asks, args.flooders, args.half_open)
    print(f"agent check, {args.flooders} flooding threads and {args.half_open} half-open connections in the flood:")
    for phase, (times, wrong) in results.items():
        print(line(phase, times, wrong))
    print("target: p99 at most 100 ms, every answer within HAProxy's timeout check (1.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
