"""Loopback helpers for tests that start servers on this machine."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port(with_next: bool = False) -> int:
    """A free TCP port on 127.0.0.1; with_next: port+1 is free too (FreeToken binds both)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_next:
            return port
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path | None = None, timeout: float = 15) -> None:
    """Wait until `proc` (a server started on 127.0.0.1:`port`) accepts connections; raise
    RuntimeError with its log's tail when it exits or the time is up."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not listening after {timeout:.0f} s"
    raise RuntimeError(f"{what} {state}\n{tail}")
