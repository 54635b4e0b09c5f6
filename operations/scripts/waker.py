#!/usr/bin/python3
"""FreeToken waker (``freetoken-waker.service`` on the gateway host, as its own user): when
the gateway's queue has built, wake one sleeping workstation with a magic packet.

Once a second it reads HAProxy's ``show stat`` through a read-only stats socket (``level user``,
owned by this service's user) and lets ``wol.step`` decide (``freetoken_infra/core/wol.py``,
uploaded beside this script): which parked host, if any, to wake now. It then sends the magic
packet for that host's MAC as a UDP broadcast to port 9 and writes one journal line saying why.

Least privilege: a UDP socket with SO_BROADCAST needs no capability, so the service runs as its
own system user with no capabilities, reads only its config (root's, 0644: hosts, MACs,
timings) and the stats socket, and writes nothing. The magic packet is built here (a few lines
of the standard library) rather than with Debian's ``wakeonlan`` (a Perl script): nothing more
to install on the gateway, and the same function the unit tests check.

    python3 waker.py --config /etc/freetoken/waker.json

Runs on the gateway with the system python3: the standard library, and ``wol.py`` and ``owner.py``
uploaded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/owner.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import owner
    from freetoken_infra.core import wol as waker
else:
    import owner
    import wol as waker

PREFIX = "freetoken-waker:"
READ_LIMIT = 1 << 20  # show stat of a fleet is a few KB


def send_magic_packet(mac: str, broadcast: str, port: int = waker.WOL_PORT) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        sock.sendto(waker.magic_packet(mac), (broadcast, port))


def show_stat(path: str, timeout: float = 2.0) -> str:
    """HAProxy's ``show stat`` (servers and backends) over its stats socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(b"show stat -1 6 -1\n")
        chunks: list[bytes] = []
        size = 0
        while size < READ_LIMIT:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def load_config(path: str) -> dict:
    """The waker's config, written by the gateway's deploy; every MAC validated again here."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    targets = tuple(waker.Target(str(t["name"]), waker.parse_mac(str(t["mac"]))) for t in config["targets"])
    # Each host's serve_hours, parsed again here (owner.parse_hours: a bad one stops the waker).
    hours = {
        str(t["name"]): owner.parse_hours(str(t["serve_hours"])) for t in config["targets"] if t.get("serve_hours")
    }
    policy = waker.Policy(
        float(config.get("queue_built_s", waker.QUEUE_BUILT_S)),
        float(config.get("cooldown_s", waker.COOLDOWN_S)),
        float(config.get("boot_s", waker.BOOT_S)),
    )
    return {
        "socket": str(config["socket"]),
        "backend": str(config["backend"]),
        "broadcast": str(config.get("broadcast", "255.255.255.255")),
        "port": int(config.get("port", waker.WOL_PORT)),
        "targets": targets,
        "hours": hours,
        "policy": policy,
    }


def in_their_hours(targets: tuple, hours: dict, now: time.struct_time) -> tuple:
    """The targets with ``within_serve_hours`` read at ``now`` (the gateway's local time; a host
    without serve_hours serves at any hour)."""
    minute = now.tm_hour * 60 + now.tm_min
    return tuple(
        replace(t, within_serve_hours=t.name not in hours or owner.in_hours(hours[t.name], now.tm_wday, minute))
        for t in targets
    )


def _gist(why: str) -> str:
    """A journal line without its counts: the same reason is journaled once."""
    return re.sub(r"queue \d+( for [\d.]+ s)?", "queue", why)


def serve(config: dict, interval: float = 1.0) -> None:
    memory = waker.Memory()
    last_why = ""
    names = ", ".join(f"{t.name} ({t.mac})" for t in config["targets"]) or "none"
    print(f"{PREFIX} watching {config['backend']}'s queue; hosts it may wake: {names}", flush=True)
    while True:
        try:
            reading = waker.read_stat(show_stat(config["socket"]), config["backend"])
        except OSError as exc:
            why = f"cannot read HAProxy's stats socket {config['socket']}: {exc}"
            if why != last_why:
                print(f"{PREFIX} {why}", file=sys.stderr, flush=True)
                last_why = why
            time.sleep(interval)
            continue
        targets = in_their_hours(config["targets"], config.get("hours", {}), time.localtime())
        memory, chosen, why = waker.step(memory, reading, targets, time.monotonic(), config["policy"])
        if chosen is not None:
            try:
                send_magic_packet(chosen.mac, config["broadcast"], config["port"])
                print(f"{PREFIX} {why}: magic packet sent to {config['broadcast']}:{config['port']}", flush=True)
            except OSError as exc:
                print(f"{PREFIX} {why}: the magic packet could not be sent: {exc}", file=sys.stderr, flush=True)
            last_why = why
        elif ("no host" in why or "waiting" in why) and _gist(why) != _gist(last_why):
            print(f"{PREFIX} {why}", flush=True)  # what it would not do, once per change of reason
            last_why = why
        elif why == "no queue":
            last_why = why
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    try:
        config = load_config(args.config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{PREFIX} cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    serve(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
