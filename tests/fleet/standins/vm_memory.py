"""STAND-IN for the WSL2 VM kernel's memory accounting, as a host's /proc/meminfo shows it.

Each simulated host's /proc/meminfo is a read-only bind of its /.sim/meminfo (tests/fleet/
harness.py), so `free`, the guard and anything else on the host read that file. What makes a real
host's swap use grow is a process whose memory no longer fits in RAM; the engine stand-in's
`swap` fault plays that process. It cannot write the file itself (the engine runs as its own user
under ProtectSystem=strict, and the file lies outside its container's reach as a real kernel's
would), so it asks this server on the bridge:

    POST /swap/grow  {"mib_per_s": 256}

The calling host, known by the connection's source address (looked up in the fleet's
state.json), gets its swap use grown at that pace, from what it was up to its SwapTotal, for as
long as the caller holds the connection open; the answer streams one line per step with the swap
bytes in use. When the connection closes - the engine stopped, was killed or crashed - its
swapped-out memory is freed as a real process's would be: swap use returns to what it was before.
Any other address gets 403.

Usage: python3 -m tests.fleet.standins.vm_memory --bind ADDR --port 8084 --state STATE_JSON
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.fleet.standins import send_text

STEP_S = 0.2
MiB = 1024**2


def swap_used(meminfo: str) -> int:
    """SwapTotal - SwapFree in bytes."""
    kb = {k: int(v) for k, v in re.findall(r"^(SwapTotal|SwapFree):\s+(\d+) kB$", meminfo, re.M)}
    return (kb["SwapTotal"] - kb["SwapFree"]) * 1024


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the answer ends when the connection does
    state_path = Path("state.json")

    def log_message(self, fmt, *args):
        sys.stderr.write("vm-memory: " + (fmt % args) + "\n")

    def _error(self, code: int, text: str) -> None:
        send_text(self, code, text)

    def do_POST(self):
        from tests.fleet import harness

        if self.path != "/swap/grow":
            return self._error(404, f"vm-memory: no such endpoint {self.path}")
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            rate = float(body.get("mib_per_s", 256)) * MiB
        except (ValueError, TypeError, AttributeError):
            return self._error(400, 'vm-memory: body must be JSON {"mib_per_s": number}')
        if rate <= 0:
            return self._error(400, "vm-memory: mib_per_s must be > 0")
        state = json.loads(self.state_path.read_text())
        host = next((h for h in state["hosts"].values() if h["address"] == self.client_address[0]), None)
        if host is None:
            return self._error(403, f"vm-memory: {self.client_address[0]} is no host of the fleet")
        meminfo = Path(host["root"]) / ".sim" / "meminfo"
        before = swap_used(meminfo.read_text())
        total = int(host["profile"]["swap_total_bytes"])
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.log_message("%s: swap grows from %d at %d B/s", host["name"], before, rate)
        t0 = time.monotonic()
        try:
            while True:
                used = min(total, int(before + rate * (time.monotonic() - t0)))
                harness.write_meminfo(meminfo, host["profile"], used)
                self.wfile.write(f"{used}\n".encode())
                self.wfile.flush()
                time.sleep(STEP_S)
        except OSError:  # the caller is gone: its memory is freed
            harness.write_meminfo(meminfo, host["profile"], before)
            self.log_message("%s: caller gone, swap back to %d", host["name"], before)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bind", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--state", required=True, type=Path)
    a = ap.parse_args(argv)
    handler = type("H", (Handler,), {"state_path": a.state})
    server = ThreadingHTTPServer((a.bind, a.port), handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
