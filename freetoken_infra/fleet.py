"""The fleet behind its gateway, through HAProxy's runtime API on the gateway host:

    python -m freetoken_infra.fleet [-i INVENTORY] drain HOST [HOST ...]   # for play or maintenance
    python -m freetoken_infra.fleet [-i INVENTORY] ready HOST [HOST ...]   # back in service
    python -m freetoken_infra.fleet [-i INVENTORY] status
    python -m freetoken_infra.fleet [-i INVENTORY] add NAME ADDRESS --host-key SHA256:... [--class CLASS]
    python -m freetoken_infra.fleet [-i INVENTORY] remove NAME

`drain` lets the host's running streams finish and sends every new request elsewhere (follow-up
turns of its sessions too); `ready` puts it back (it serves again once its health checks pass).
`status` prints one table: host, in service / parked / draining / failed, active requests, the
last health check, and the decode tok/s of the host's last health gate. A host its agent gave
to its owner says why instead of parked or draining: `yielded (game)`, `yielded (app NAME)`,
`yielded (full-screen)`, `snoozed`, `reboot pending`, `off schedule` (the agent's answer after
`#`, which HAProxy keeps in `show stat`'s `last_agt`; only these words are shown,
``owner.word_from_last_agt``). `add` and `remove`
enrol a PC that ran operations/scripts/enrol.py and take one out (freetoken_infra/enrolment.py).

The gateway is the inventory's `gateway` group (deploys/gateway.py); the commands reach it over
SSH with the inventory's connection settings (``@local``: on this machine), through `sudo -n`
when the user is not root, and speak to HAProxy's root-only socket with socat.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from freetoken_infra.core import owner
from freetoken_infra.core.gate_record import GateRecordError, GateResult
from freetoken_infra.core.layout import (
    GATEWAY_BACKEND,
    GATEWAY_GROUP,
    GATEWAY_RUNTIME_SOCKET,
    HostLayout,
)
from freetoken_infra.core.settings import InventoryError, Settings, load_inventory_settings
from freetoken_infra.core.text import printable

DEFAULT_INVENTORY = "inventories/fleet.py"
IN_SERVICE, PARKED, DRAINING, FAILED = "in service", "parked", "draining", "failed"
MAINTENANCE = "maintenance"
# A check that got no answer at all: the PC is off, asleep, rebooting or has no engine running.
# Parked, not failed: it rejoins by itself once it passes its checks again.
NO_ANSWER = ("L4CON", "L4TOUT", "L6TOUT", "L6RSP", "L7TOUT", "SOCKERR", "L4OK")


class FleetError(Exception):
    """What went wrong, on which host, and what to do."""


@dataclass(frozen=True)
class Remote:
    """How to run a command on one inventory host: ssh with its inventory data, or locally."""

    name: str
    ssh_argv: list[str] | None  # None: @local
    sudo: bool

    def run(self, command: str, timeout: float = 20) -> str:
        wrapped = f"sudo -n sh -c {shlex.quote(command)}" if self.sudo else command
        argv = (self.ssh_argv + [wrapped]) if self.ssh_argv is not None else ["sh", "-c", wrapped]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise FleetError(f"{self.name}: no answer within {timeout:g} s") from None
        if r.returncode != 0:
            raise FleetError(
                f"{self.name}: {command.split('|')[0].strip()!r} failed ({r.returncode}): "
                f"{printable((r.stderr or r.stdout).strip()[-300:])}"
            )
        return r.stdout


def remote_for(name: str, data: dict[str, Any]) -> Remote:
    """A Remote from a host's inventory data (pyinfra's ssh_* keys)."""
    if name.startswith("@local"):
        return Remote(name, None, os.geteuid() != 0)
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR"]
    if data.get("ssh_port"):
        argv += ["-p", str(data["ssh_port"])]
    if data.get("ssh_key"):
        argv += ["-i", str(data["ssh_key"])]
    if data.get("ssh_known_hosts_file"):
        argv += ["-o", f"UserKnownHostsFile={data['ssh_known_hosts_file']}"]
    if data.get("ssh_config_file"):
        argv += ["-F", str(data["ssh_config_file"])]
    strict = data.get("ssh_strict_host_key_checking", "accept-new")
    argv += ["-o", f"StrictHostKeyChecking={strict}"]
    user = data.get("ssh_user")
    target = str(data.get("ssh_hostname") or name)
    argv.append(f"{user}@{target}" if user else target)
    return Remote(name, argv, bool(user) and user != "root")


# --------------------------------------------------------------------------- HAProxy's answers
def runtime_command(command: str) -> str:
    """The shell command that sends one runtime API command to HAProxy on the gateway host."""
    return f"echo {shlex.quote(command)} | socat stdio {GATEWAY_RUNTIME_SOCKET}"


@dataclass(frozen=True)
class ServerStatus:
    host: str
    state: str  # IN_SERVICE, PARKED, DRAINING, FAILED, MAINTENANCE or the owner's word (owner.fleet_word)
    active: int  # requests in flight on this host (both backends)
    health: str  # the last check: e.g. "L7OK/200 in 2ms", "L4CON Connection refused"
    haproxy_status: str  # HAProxy's own word: UP, DOWN, DRAIN, MAINT, "UP 1/2", ...
    signals: str = ""  # the agent's owner signals when one is off (owner.signals_line), else ""


def classify(status: str, check_status: str) -> str:
    """HAProxy's server status and last check as the fleet's words."""
    status = status.upper()
    if "MAINT" in status:
        return MAINTENANCE
    if "DRAIN" in status or "NOLB" in status:
        return DRAINING
    if status.startswith("UP") or status == "NO CHECK":
        return IN_SERVICE
    # No answer: off, asleep, rebooting. Its last check passed: back, rising to rejoin.
    if check_status.upper().lstrip("*") in NO_ANSWER + ("L7OK",):
        return PARKED
    return FAILED


def parse_stat(text: str) -> list[ServerStatus]:
    """`show stat` (CSV) -> one ServerStatus per server of the gateway's backend."""
    lines = text.lstrip().splitlines()
    if not lines or not lines[0].startswith("# pxname"):
        raise FleetError(f"unexpected answer to 'show stat': {text[:200]!r}")
    rows = list(csv.DictReader(io.StringIO(lines[0][2:] + "\n" + "\n".join(lines[1:]))))
    out = []
    for row in rows:
        if row["pxname"] != GATEWAY_BACKEND or row["svname"] in ("BACKEND", "FRONTEND"):
            continue
        check = (row.get("check_status") or "").lstrip("*")
        code = row.get("check_code") or ""
        took = row.get("check_duration") or ""
        detail = (row.get("last_chk") or "").strip()
        health = check + (f"/{code}" if code else "") + (f" in {took}ms" if took else "")
        if detail and check not in ("L7OK",):
            health += f" {detail}"
        state = classify(row["status"], check)
        # The host's agent says why it left (an operator's maintenance comes first); a host
        # serving again says nothing after `#`.
        word, signals = owner.note_from_last_agt(row.get("last_agt") or "")
        if word is not None and state != MAINTENANCE:
            state = word
        out.append(
            ServerStatus(
                row["svname"],
                state,
                # streams it serves and requests waiting for its slots (a session's)
                int(row.get("scur") or 0) + int(row.get("qcur") or 0),
                health.strip() or "-",
                row["status"],
                signals or "",
            )
        )
    return out


def format_status(servers: Sequence[ServerStatus], gate_tps: dict[str, float | None]) -> str:
    header = ("host", "state", "active", "last health", "tok/s (last gate)")
    rows = [
        (
            s.host,
            s.state,
            str(s.active),
            printable(s.health)[:60],  # HAProxy's last check: what the engine answered
            f"{gate_tps[s.host]:.1f}" if gate_tps.get(s.host) is not None else "-",
        )
        for s in servers
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()  # noqa: E731
    counts = {st: sum(1 for s in servers if s.state == st) for st in (IN_SERVICE, PARKED, DRAINING, FAILED)}
    owners = sum(1 for s in servers if owner.fleet_word(s.state) is not None)
    summary = ", ".join(f"{n} {st}" for st, n in counts.items()) + (f", {owners} with their owner" if owners else "")
    return "\n".join(
        [
            "== fleet status (gateway) ==",
            fmt(header),
            "-" * len(fmt(header)),
            *(fmt(r) for r in rows),
            f"{len(servers)} host(s): {summary}",
            # an agent that cannot read its owner's Windows says so (owner.degraded): one line each
            *(f"{s.host}: owner signals: {s.signals}" for s in servers if owner.degraded(s.signals)),
        ]
    )


# --------------------------------------------------------------------------- the fleet
class Fleet:
    """An inventory's gateway and serving hosts."""

    def __init__(self, gateway: Remote, hosts: dict[str, tuple[Settings, Remote]]):
        self.gateway = gateway
        self.hosts = hosts  # serving hosts: name -> (settings, how to reach it)

    @classmethod
    def from_inventory(cls, inventory: str, data: dict | None = None) -> Fleet:
        try:
            inv, settings = load_inventory_settings(inventory, data)
        except InventoryError as exc:
            raise FleetError(str(exc)) from None
        gateways = [h for h in inv if GATEWAY_GROUP in h.groups]
        if not gateways:
            raise FleetError(
                f"{inventory}: no host in the group '{GATEWAY_GROUP}': deploy a gateway first (docs/gateway.md)"
            )
        gw = gateways[0]
        hosts = {
            h.name: (settings[h.name], remote_for(h.name, h.data.dict())) for h in inv if settings[h.name].runs_engine
        }
        return cls(remote_for(gw.name, gw.data.dict()), hosts)

    def runtime(self, command: str) -> str:
        return self.gateway.run(runtime_command(command))

    def servers(self) -> list[ServerStatus]:
        return parse_stat(self.runtime("show stat"))

    def _set_state(self, hosts: Sequence[str], state: str) -> None:
        known = {s.host for s in self.servers()}
        unknown = [h for h in hosts if h not in known]
        if unknown:
            raise FleetError(
                f"{', '.join(unknown)}: not a backend of the gateway on {self.gateway.name} "
                f"(backends: {', '.join(sorted(known))}); re-run deploys/gateway.py after "
                "adding hosts to the inventory"
            )
        # Drained: weight 0 as well, which the conversations' use-server rules read
        # (operations/gateway.py); ready: the weight the deploy configured.
        weight = "0" if state == "drain" else "100%"
        for h in hosts:
            for command in (
                f"set server {GATEWAY_BACKEND}/{h} state {state}",
                f"set weight {GATEWAY_BACKEND}/{h} {weight}",
            ):
                answer = self.runtime(command).strip()
                if answer:
                    raise FleetError(f"{self.gateway.name}: {command}: {answer}")

    def drain(self, hosts: Sequence[str]) -> None:
        self._set_state(hosts, "drain")

    def ready(self, hosts: Sequence[str]) -> None:
        self._set_state(hosts, "ready")

    def wait_idle(
        self, hosts: Sequence[str], timeout: float, say: Callable[[str], None] = lambda m: None, poll: float = 1.0
    ) -> list[str]:
        """Wait until `hosts` have no request in flight (their streams finished); the hosts still
        busy when `timeout` ran out."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [s.host for s in self.servers() if s.host in hosts and s.active > 0]
            if not busy or time.monotonic() >= deadline:
                return busy
            say(f"waiting for {', '.join(busy)} to finish their streams")
            time.sleep(poll)

    def gate_tps(self) -> dict[str, float | None]:
        """Each serving host's decode tok/s from its last health gate (None: unknown/unreachable)."""

        def one(item: tuple[str, tuple[Settings, Remote]]) -> tuple[str, float | None]:
            name, (settings, remote) = item
            # Read as the service user, who owns the file (root never reads a path it can write).
            path = shlex.quote(HostLayout.of(settings).last_gate_file)
            try:
                text = remote.run(f"runuser -u {shlex.quote(settings.service_user)} -- head -c 65536 {path}", timeout=8)
                tps = GateResult.from_json(text, f"{name}: gate record").decode_tps
            except (FleetError, GateRecordError):
                return name, None
            return name, float(tps) if tps is not None else None

        with ThreadPoolExecutor(max_workers=8) as pool:
            return dict(pool.map(one, self.hosts.items()))

    def status(self) -> str:
        return format_status(self.servers(), self.gate_tps())


PROG = "python -m freetoken_infra.fleet"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line of ``main``; ``freetoken fleet`` (freetoken_infra/cli.py) shows the same."""
    ap = argparse.ArgumentParser(
        prog=prog, description="Drain, ready, list, add and remove the fleet's hosts (at its gateway)."
    )
    ap.add_argument(
        "-i",
        "--inventory",
        default=os.environ.get("FREETOKEN_INVENTORY", DEFAULT_INVENTORY),
        help=f"pyinfra inventory with a '{GATEWAY_GROUP}' group (default: $FREETOKEN_INVENTORY or {DEFAULT_INVENTORY})",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_drain = sub.add_parser("drain", help="finish running streams, send new requests elsewhere")
    p_drain.add_argument("hosts", nargs="+")
    p_drain.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="S",
        help="wait up to S seconds for the hosts' running requests to finish",
    )
    p_ready = sub.add_parser("ready", help="back in service once its health checks pass")
    p_ready.add_argument("hosts", nargs="+")
    sub.add_parser("status", help="one table: state, active requests, last health, last gate tok/s")
    p_add = sub.add_parser("add", help="pin a new PC's host key, run the doctor on it, add it to the inventory")
    p_add.add_argument("name")
    p_add.add_argument("address")
    p_add.add_argument("--host-key", help="the fingerprint enrol.py printed (SHA256:...)")
    p_add.add_argument("--class", dest="group", help="its hardware class: a group of the inventory (default: hosts)")
    p_add.add_argument("--port", type=int, default=2222, help="its sshd's port (default 2222, as enrol.py sets)")
    p_add.add_argument("--user", help="the user the deploy logs in as (default: enrol.py's own, freetoken-deploy)")
    p_add.add_argument("--ssh-key", help="the controller's private key file (default: ssh's own choice)")
    p_add.add_argument("--known-hosts", help="the known-hosts file to pin the key in (default ~/.ssh/known_hosts)")
    p_add.add_argument("--skip-doctor", action="store_true", help="add it without running the doctor first")
    p_remove = sub.add_parser("remove", help="drain a host at the gateway, then take it out of the inventory")
    p_remove.add_argument("name")
    p_remove.add_argument("--wait", type=float, default=60, metavar="S", help="wait up to S s for its streams")
    p_remove.add_argument("--no-gateway", action="store_true", help="the inventory has no gateway: do not drain")
    return ap


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.cmd in ("add", "remove"):
        return _enrolment(args)
    try:
        fleet = Fleet.from_inventory(args.inventory)
        if args.cmd == "drain":
            fleet.drain(args.hosts)
            busy = fleet.wait_idle(args.hosts, args.wait, say=print) if args.wait else []
            still = f" (still busy: {', '.join(busy)})" if busy else ""
            print(f"draining: {', '.join(args.hosts)}{still}")
        elif args.cmd == "ready":
            fleet.ready(args.hosts)
            print(f"ready: {', '.join(args.hosts)} (in service once their health checks pass)")
        else:
            print(fleet.status())
    except FleetError as exc:
        print(f"fleet: {exc}", file=sys.stderr)
        return 1
    return 0


def _enrolment(args: argparse.Namespace) -> int:
    from freetoken_infra import enrolment

    try:
        if args.cmd == "add":
            host = enrolment.new_host(
                args.name,
                args.address,
                port=args.port,
                user=args.user or enrolment.DEPLOY_USER,
                host_key=args.host_key,
                group=args.group,
                ssh_key=args.ssh_key,
                known_hosts=args.known_hosts,
            )
            enrolment.add(args.inventory, host, doctor=not args.skip_doctor)
        else:

            def drain(name: str) -> list[str]:
                fleet = Fleet.from_inventory(args.inventory)
                fleet.drain([name])
                print(f"--> {name}: draining at the gateway {fleet.gateway.name}")
                return fleet.wait_idle([name], args.wait, say=print)

            enrolment.remove(args.inventory, args.name, drain=None if args.no_gateway else drain)
    except (enrolment.EnrolError, FleetError) as exc:
        print(f"fleet {args.cmd}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
