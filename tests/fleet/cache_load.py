"""Slow and idle clients against the LAN model cache, run from a fleet host at the cache host's
fleet address (never anywhere else): shared by tests/fleet/test_model.py and bench/model_cache.py.

``SLOW_CLIENTS`` runs on the host with its system python3 (stdlib only): it keeps ``clients``
connections open to the cache for ``hold_s`` seconds (bounded: it stops by itself), half of them
idle, half sending a request one byte a second that never ends (slowloris: the request line,
then header after header); a connection the server closes is opened again at once, so the
server always has ``clients`` of them. Meanwhile, every ``every_s`` seconds, a real client asks
for ``/health`` and for 1 KiB of a verified file (``Range``), each on a fresh connection with a
timeout of ``timeout_s``. It prints one JSON line: the latencies (``null``: no answer in time),
the answers, how many slow connections the server closed and how many were open at the end.
"""

from __future__ import annotations

import json

SLOW_CLIENTS = r"""
import json, selectors, socket, sys, time
address, port, clients, hold_s, every_s, timeout_s, file_path = sys.argv[1:8]
port, clients, hold_s, every_s, timeout_s = int(port), int(clients), float(hold_s), float(every_s), float(timeout_s)
TRICKLE = b"GET /health HTTP/1.1\r\nHost: cache\r\n" + b"".join(b"X-Slow-%d: %d\r\n" % (i, i) for i in range(10000))

def connect():
    s = socket.create_connection((address, port), timeout=10)
    s.setblocking(False)
    return s

conns = [[connect(), 0] for _ in range(clients)]  # socket, bytes of TRICKLE sent (odd slots only)
closed_by_server = 0

def ask(path, headers=""):
    t = time.monotonic()
    try:
        with socket.create_connection((address, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: cache\r\nConnection: close\r\n{headers}\r\n".encode())
            data = b""
            while time.monotonic() - t < timeout_s:
                block = s.recv(65536)
                if not block:
                    break
                data += block
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None
        return status, len(body), round((time.monotonic() - t) * 1000, 1)
    except OSError:
        return None, 0, None

health, ranged = [], []
start = time.monotonic()
next_ask = start + 2.0  # the slow clients are in place first
next_byte = start
while time.monotonic() - start < hold_s:
    now = time.monotonic()
    if now >= next_byte:
        next_byte = now + 1.0
        for i, slot in enumerate(conns):
            s, sent = slot
            try:
                if s.recv(1024) == b"":  # the server closed it (timed out): a new one at once
                    raise ConnectionResetError
            except BlockingIOError:
                pass
            except OSError:
                closed_by_server += 1
                s.close()
                slot[0], slot[1] = connect(), 0
                continue
            if i % 2:  # every second client trickles, one byte a second; the others stay idle
                try:
                    s.send(TRICKLE[sent:sent + 1])
                    slot[1] = sent + 1
                except BlockingIOError:
                    pass
                except OSError:
                    closed_by_server += 1
                    s.close()
                    slot[0], slot[1] = connect(), 0
    if now >= next_ask:
        next_ask = now + every_s
        health.append(ask("/health"))
        ranged.append(ask(file_path, "Range: bytes=0-1023\r\n"))
    time.sleep(0.05)
open_at_end = 0
for s, _ in conns:
    try:
        open_at_end += s.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        open_at_end += 1
    except OSError:
        pass
    s.close()
print(json.dumps({"clients": clients, "hold_s": hold_s, "closed_by_server": closed_by_server,
                  "open_at_end": open_at_end, "health": health, "range": ranged}))
"""


def slow_clients(
    fleet,
    from_host: str,
    address: str,
    port: int,
    file_path: str,
    clients: int = 500,
    hold_s: float = 30.0,
    every_s: float = 2.0,
    timeout_s: float = 20.0,
) -> dict:
    """Run ``SLOW_CLIENTS`` on ``from_host`` against ``address:port`` (the cache host's fleet
    address); its JSON report."""
    argv = " ".join(str(a) for a in (address, port, clients, hold_s, every_s, timeout_s, file_path))
    run = fleet.run(
        from_host,
        f"ulimit -n 4096; python3 -c '{SLOW_CLIENTS}' {argv}",
        check=True,
        timeout=int(hold_s + 4 * timeout_s + 60),
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def latencies(answers: list) -> str:
    """p50 / max of the answered requests' latencies (ms), and how many got no answer."""
    ms = sorted(a[2] for a in answers if a[0] is not None and a[2] is not None)
    missed = len(answers) - len(ms)
    if not ms:
        return f"no answer to any of {len(answers)}"
    return f"p50 {ms[len(ms) // 2]:.1f} ms, max {ms[-1]:.1f} ms over {len(ms)} answered, {missed} unanswered"
