"""Loopback helpers for tests that start servers on this machine."""

from __future__ import annotations

import socket


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
