"""From a pyinfra inventory to testinfra hosts, so the verify suite checks exactly the hosts (and
settings) the deploy converged.

- The inventory file is read by pyinfra itself (``pyinfra_cli.inventory.make_inventory``, with
  the project root as the working directory, as ``pyinfra INVENTORY deploys/freetoken.py`` run
  from there does), so its groups and ``group_data/`` apply exactly as in the deploy. That
  happens in a child python (``python -m tests.verify.bridge INVENTORY`` prints the hosts as
  JSON): importing ``pyinfra_cli`` monkey-patches the whole interpreter for gevent, which a
  pytest process must not suffer.
- Each host's expected values are the deploy's own ``Settings`` (``build_settings`` over the
  host's data, which is what ``settings_for`` does in the deploy), validated the same way.
- ``@local`` becomes ``local://``; an SSH host becomes ``ssh://[user@]host[:port]``, with
  pyinfra's ``ssh_key``, ``ssh_config_file``, ``ssh_known_hosts_file`` and
  ``ssh_strict_host_key_checking`` (pyinfra's default ``accept-new`` when unset) handed to the
  ``ssh`` client. testinfra's paramiko backend is not used: it neither reads a known_hosts file
  nor checks host keys (it only warns), and the deploy's inventory may demand both.
- Like the deploy (``deploys/freetoken.py`` decides ``_sudo`` from ``id -u``), a connection whose
  user is not root runs every command through ``sudo`` (which must not ask for a password over
  SSH; on ``@local`` run ``sudo -v`` first).

Other connectors (``@docker``, ``@chroot``, ...) are refused with a message naming the host.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# The SSH connector data the bridge hands on (pyinfra's names).
SSH_KEYS = (
    "ssh_hostname",
    "ssh_port",
    "ssh_user",
    "ssh_key",
    "ssh_config_file",
    "ssh_known_hosts_file",
    "ssh_strict_host_key_checking",
)


class BridgeError(Exception):
    """The inventory cannot be turned into testinfra hosts; the message says why."""


@dataclass(frozen=True)
class Target:
    """One inventory host: its name, groups, settings, and how testinfra reaches it."""

    name: str
    groups: tuple[str, ...]
    settings: Any  # freetoken_infra.core.settings.Settings
    hostspec: str
    backend_kwargs: dict[str, Any] = field(default_factory=dict)

    def testinfra_host(self, sudo: bool | None = None):
        """A testinfra Host; ``sudo=None`` decides it from ``id -u`` on the target."""
        import testinfra

        if sudo is None:
            plain = testinfra.get_host(self.hostspec, **self.backend_kwargs)
            try:
                uid = plain.run("id -u")
            except RuntimeError as exc:  # the ssh backend raises on exit 255 (no connection)
                raise BridgeError(f"host {self.name}: cannot connect ({self.hostspec}): {exc}") from None
            if uid.rc != 0:
                raise BridgeError(
                    f"host {self.name}: `id -u` failed ({self.hostspec}): {(uid.stderr or uid.stdout).strip()[:300]}"
                )
            sudo = uid.stdout.strip() != "0"
            if not sudo:
                return plain
        return testinfra.get_host(self.hostspec, sudo=sudo, **self.backend_kwargs)


# --------------------------------------------------------------------------- reading the inventory


def dump_inventory(path: str, cwd: str) -> list[dict[str, Any]]:
    """In THIS process: the inventory's hosts as plain data (imports pyinfra_cli: gevent)."""
    from pyinfra.api import State
    from pyinfra.connectors.base import host_to_connector_data
    from pyinfra.connectors.ssh import SSHConnector
    from pyinfra.context import ctx_state
    from pyinfra_cli.inventory import make_inventory

    if cwd not in sys.path:  # as pyinfra's CLI does: inventory and group data may import from here
        sys.path.append(cwd)
    state = State()
    state.cwd = cwd
    with ctx_state.use(state):
        inventory = make_inventory(path, cwd=cwd)
    hosts = []
    for host in inventory:
        connector = host.connector_cls
        record = {
            "name": host.name,
            "groups": list(dict.fromkeys(host.groups)),
            "connector": getattr(connector, "__name__", str(connector)),
            "data": host.data.dict(),
        }
        if connector is SSHConnector:
            ssh = host_to_connector_data(SSHConnector.data_cls, SSHConnector.data_meta, host.data)
            record["ssh"] = {k: ssh.get(k) for k in SSH_KEYS}
        hosts.append(record)
    return hosts


def load_inventory(path: str | os.PathLike, cwd: str | os.PathLike = ROOT) -> list[dict[str, Any]]:
    """The inventory's hosts (``name``, ``groups``, ``connector``, ``data``, ``ssh``), read by
    pyinfra in a child python. BridgeError when the file is missing or its code stops
    (``inventories/sim.py`` exits when the simulated fleet is not running)."""
    file = Path(path)
    if not file.is_absolute():
        file = Path.cwd() / file
    if not file.is_file():
        raise BridgeError(f"no inventory file {path}")
    run = subprocess.run(
        [sys.executable, "-m", "tests.verify.bridge", str(file), str(cwd)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    if run.returncode != 0:
        why = (run.stderr.strip() or run.stdout.strip()).splitlines()
        raise BridgeError(f"inventory {path}: {why[-1] if why else f'exit {run.returncode}'}")
    return json.loads(run.stdout)


def select(hosts: list[dict[str, Any]], limit: Iterable[str] = (), exclude: Iterable[str] = ()) -> list[dict]:
    """The hosts, in inventory order, narrowed like pyinfra's ``--limit`` / ``--exclude``: each
    pattern is a group name, else a glob over host names (comma-separated lists are split). A
    pattern that matches no host is an error, so a typo does not verify nothing silently."""

    def matches(patterns: Iterable[str], option: str) -> set[str]:
        chosen: set[str] = set()
        for pattern in (p.strip() for ps in patterns for p in ps.split(",")):
            if not pattern:
                continue
            names = {h["name"] for h in hosts if pattern in h["groups"]} or {
                h["name"] for h in hosts if fnmatch.fnmatchcase(h["name"], pattern)
            }
            if not names:
                known = ", ".join(h["name"] for h in hosts)
                raise BridgeError(f"{option} {pattern}: no such host or group (hosts: {known})")
            chosen |= names
        return chosen

    limit, exclude = list(limit or ()), list(exclude or ())
    if limit:
        wanted = matches(limit, "--limit")
        hosts = [h for h in hosts if h["name"] in wanted]
    if exclude:
        unwanted = matches(exclude, "--exclude")
        hosts = [h for h in hosts if h["name"] not in unwanted]
    return hosts


# --------------------------------------------------------------------------- testinfra's side


def _control_path(spec: str) -> str:
    # One multiplexed SSH connection per target for the whole run (testinfra runs many short
    # commands). Short and free of '%': a socket path is limited to ~100 bytes.
    digest = hashlib.sha1(f"{os.getuid()}:{spec}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"ftverify-{digest}")


def hostspec_for(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """testinfra's hostspec and backend keyword arguments for one inventory host."""
    connector = record.get("connector")
    if connector == "LocalConnector":
        return "local://", {}
    if connector != "SSHConnector":
        raise BridgeError(
            f"host {record['name']}: connector {connector} is not supported by the "
            "verify suite (only @local and SSH hosts)"
        )
    ssh = record.get("ssh") or {}
    hostname = ssh.get("ssh_hostname") or record["name"].removeprefix("@ssh/")
    netloc = f"[{hostname}]" if ":" in hostname else hostname
    if ssh.get("ssh_user"):
        netloc = f"{ssh['ssh_user']}@{netloc}"
    if ssh.get("ssh_port"):
        netloc = f"{netloc}:{int(ssh['ssh_port'])}"
    spec = f"ssh://{netloc}"
    kwargs: dict[str, Any] = {"controlpersist": 15}
    if ssh.get("ssh_key"):
        kwargs["ssh_identity_file"] = os.path.expanduser(str(ssh["ssh_key"]))
    if ssh.get("ssh_config_file"):
        kwargs["ssh_config"] = os.path.expanduser(str(ssh["ssh_config_file"]))
    options = ["-o BatchMode=yes"]
    if ssh.get("ssh_known_hosts_file"):
        options.append(f"-o UserKnownHostsFile={os.path.expanduser(str(ssh['ssh_known_hosts_file']))}")
    if ssh.get("ssh_strict_host_key_checking"):
        options.append(f"-o StrictHostKeyChecking={ssh['ssh_strict_host_key_checking']}")
    options.append(f"-o ControlPath={_control_path(spec)}")
    kwargs["ssh_extra_args"] = " ".join(options)
    return spec, kwargs


def target_for(record: dict[str, Any]) -> Target:
    """An inventory host as a verify target; its settings validated like the deploy's."""
    from freetoken_infra.core.settings import build_settings

    spec, kwargs = hostspec_for(record)
    groups = tuple(g for g in record["groups"] if not g.startswith("@"))
    return Target(record["name"], groups, build_settings(record["name"], record["data"]), spec, kwargs)


def targets(
    inventory_path: str | os.PathLike,
    limit: Iterable[str] = (),
    exclude: Iterable[str] = (),
    cwd: str | os.PathLike = ROOT,
) -> list[Target]:
    """Every selected host of an inventory file as a Target; BridgeError (or the deploy's own
    SettingsError) when the inventory or a host's settings are wrong."""
    chosen = select(load_inventory(inventory_path, cwd), limit, exclude)
    if not chosen:
        raise BridgeError(f"inventory {inventory_path}: no host left to verify")
    return [target_for(h) for h in chosen]


def main(argv: list[str]) -> int:
    path, cwd = argv[0], argv[1] if len(argv) > 1 else str(ROOT)
    try:
        hosts = dump_inventory(path, cwd)
    except SystemExit as exc:  # an inventory may stop itself (inventories/sim.py)
        print(exc, file=sys.stderr)
        return 1
    json.dump(hosts, sys.stdout, default=repr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
