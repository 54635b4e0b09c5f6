"""The controller's half of enrolment: `python -m freetoken_infra.fleet add` and `remove`.

`add NAME ADDRESS --host-key SHA256:...` connects over SSH with the host key the PC printed
(operations/scripts/enrol.py) pinned: another key is refused before any login. It then runs the
doctor (deploys/doctor.py) on the host, through a copy of the inventory with the host added, and
only when the doctor finds no blocker puts the host in the inventory file. `remove NAME` drains
the host at the gateway (when the inventory has one), waits for its streams, and takes it out.

The inventory is a Python file (inventories/fleet.py): the edit is narrow and leaves every other
byte alone. It inserts or deletes one line of a module-level list (a hardware class, or `hosts`),
found with the standard library's parser; the result is compiled before it replaces the file,
atomically. (A general source rewriter such as libcst would also keep the formatting, but this
one-line edit needs no new dependency.)
"""

from __future__ import annotations

import ast
import base64
import hashlib
import ipaddress
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
GROUP = re.compile(r"[a-z_][a-z0-9_]{0,63}")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9+/]{43}")
DEFAULT_GROUP = "hosts"
# The account enrol.py makes for the deploy to log in as (operations/scripts/enrol.py DEPLOY_USER):
# `add`'s default user.
DEPLOY_USER = "freetoken-deploy"
REPO = Path(__file__).resolve().parent.parent


class EnrolError(Exception):
    """One line: what is wrong, naming the host or field; the inventory is unchanged."""


# --------------------------------------------------------------------------- inputs
def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise EnrolError(f"NAME {name!r}: a host name is letters, digits and inner hyphens (at most 63)")
    return name


def check_address(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    if len(address) <= 253 and all(NAME.fullmatch(part) for part in address.split(".")):
        return address
    raise EnrolError(f"ADDRESS {address!r}: not an IP address or a host name")


def key_fingerprint(key_blob: bytes) -> str:
    """OpenSSH's ``SHA256:...`` form of a host key (what enrol.py printed, `ssh-keygen -l`)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key_blob).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class NewHost:
    name: str
    address: str
    port: int
    user: str
    host_key: str
    group: str
    ssh_key: str | None = None
    known_hosts: str | None = None

    def data(self) -> dict[str, object]:
        data: dict[str, object] = {"ssh_hostname": self.address, "ssh_port": self.port, "ssh_user": self.user}
        if self.ssh_key:
            data["ssh_key"] = self.ssh_key
        if self.known_hosts:
            data["ssh_known_hosts_file"] = self.known_hosts
        data["ssh_strict_host_key_checking"] = "yes"  # the pinned key only, from now on
        return data


def new_host(
    name: str,
    address: str,
    *,
    port: int,
    user: str,
    host_key: str | None,
    group: str | None,
    ssh_key: str | None = None,
    known_hosts: str | None = None,
) -> NewHost:
    if not host_key:
        raise EnrolError(
            "--host-key: give the fingerprint enrol.py printed (SHA256:...), so that no other host is trusted"
        )
    if not FINGERPRINT.fullmatch(host_key):
        raise EnrolError(f"--host-key {host_key!r}: expected SHA256: and 43 base64 characters")
    if not 1 <= port <= 65535:
        raise EnrolError(f"--port {port}: not a port")
    if not USER.fullmatch(user):
        raise EnrolError(f"--user {user!r}: not a user name")
    group = group or DEFAULT_GROUP
    if not GROUP.fullmatch(group):
        raise EnrolError(f"--class {group!r}: a group is a Python name in lower case (e.g. rtx5090_32gb)")
    return NewHost(check_name(name), check_address(address), port, user, host_key, group, ssh_key, known_hosts)


# --------------------------------------------------------------------------- the inventory file
def _list_assignments(tree: ast.Module) -> dict[str, ast.List]:
    lists: dict[str, ast.List] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.List):
                lists[node.targets[0].id] = node.value
    return lists


def _element_name(elt: ast.expr) -> str | None:
    if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
        return elt.value
    if isinstance(elt, ast.Tuple) and elt.elts and isinstance(elt.elts[0], ast.Constant):
        value = elt.elts[0].value
        return value if isinstance(value, str) else None
    return None


def hosts_in(source: str) -> dict[str, str]:
    """Host name -> the module-level list that names it."""
    found: dict[str, str] = {}
    for group, node in _list_assignments(ast.parse(source)).items():
        for elt in node.elts:
            name = _element_name(elt)
            if name is not None:
                found[name] = group
    return found


def with_host(source: str, host: NewHost) -> str:
    """The inventory's text with ``host`` added as the last line of its group's list (a new
    list at the end when there is none). EnrolError when the name is taken."""
    taken = hosts_in(source)
    if host.name in taken:
        raise EnrolError(f"{host.name}: already in the inventory (in {taken[host.name]}); `remove` it first")
    entry = f"({json.dumps(host.name)}, {json.dumps(host.data())}),"
    lists = _list_assignments(ast.parse(source))
    lines = source.splitlines(keepends=True)
    node = lists.get(host.group)
    if node is None:
        tail = "" if not source or source.endswith("\n") else "\n"
        return f"{source}{tail}\n{host.group} = [\n    {entry}\n]\n"
    if node.lineno == node.end_lineno:
        raise EnrolError(f"{host.group}: its list is on one line; write it one host per line, then add again")
    close = (node.end_lineno or node.lineno) - 1  # 0-based line of the closing bracket
    indent = "    "
    if node.elts:
        first = lines[node.elts[-1].lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        last_end = (node.elts[-1].end_lineno or node.elts[-1].lineno) - 1
        if not lines[last_end].rstrip().endswith(","):  # the last element needs its comma first
            text = lines[last_end].rstrip("\r\n")
            code, sep, comment = text.partition("  #")
            lines[last_end] = code.rstrip() + "," + (sep + comment if sep else "") + "\n"
    newline = "\r\n" if lines[close].endswith("\r\n") else "\n"
    lines.insert(close, f"{indent}{entry}{newline}")
    return "".join(lines)


def without_host(source: str, name: str) -> str:
    """The inventory's text without the list element that names ``name`` (its own lines)."""
    lines = source.splitlines(keepends=True)
    for group, node in _list_assignments(ast.parse(source)).items():
        for elt in node.elts:
            if _element_name(elt) != name:
                continue
            start, end = elt.lineno - 1, elt.end_lineno - 1  # type: ignore[operator]
            own = lines[start][: elt.col_offset].strip() == "" and re.fullmatch(
                r"\s*,?\s*(#.*)?", lines[end][elt.end_col_offset :].rstrip("\r\n")
            )
            if not own or start == node.lineno - 1 or end == node.end_lineno - 1:  # type: ignore[operator]
                raise EnrolError(f"{name}: shares its lines in {group}; take it out by hand")
            del lines[start : end + 1]
            return "".join(lines)
    raise EnrolError(f"{name}: not in the inventory")


def replace_file(path: Path, text: str) -> None:
    """Compile, then replace atomically (same folder, same mode)."""
    compile(text, str(path), "exec")
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- the host
def check_reachable(host: NewHost, timeout: float = 10.0) -> None:
    """Log in over SSH with the host key pinned; EnrolError naming what failed. Records the key
    in the known-hosts file pyinfra will read."""
    import paramiko

    class Pinned(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            seen = key_fingerprint(key.asbytes())
            if seen != host.host_key:
                raise EnrolError(
                    f"{host.name}: {host.address}:{host.port} offers host key {seen}, not the pinned "
                    f"{host.host_key}; not trusted, nothing changed"
                )
            client.get_host_keys().add(_known_name(host), key.get_name(), key)

    client = paramiko.SSHClient()
    known = os.path.expanduser(host.known_hosts or "~/.ssh/known_hosts")
    if os.path.exists(known):
        client.load_host_keys(known)
    client.set_missing_host_key_policy(Pinned())
    try:
        client.connect(
            host.address,
            port=host.port,
            username=host.user,
            key_filename=host.ssh_key,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
            look_for_keys=host.ssh_key is None,
            allow_agent=host.ssh_key is None,
        )
        # A key already in known_hosts skipped the policy: check it against the pin too.
        transport = client.get_transport()
        seen = key_fingerprint(transport.get_remote_server_key().asbytes()) if transport else ""
        if seen != host.host_key:
            raise EnrolError(f"{host.name}: the host key is {seen}, not the pinned {host.host_key}; not trusted")
        _, out, _ = client.exec_command("true", timeout=timeout)
        if out.channel.recv_exit_status() != 0:
            raise EnrolError(f"{host.name}: logged in, but `true` failed")
    except EnrolError:
        raise
    except (OSError, paramiko.SSHException) as exc:
        raise EnrolError(f"{host.name}: cannot log in at {host.user}@{host.address}:{host.port}: {exc}") from None
    finally:
        client.close()
    os.makedirs(os.path.dirname(known) or ".", mode=0o700, exist_ok=True)
    client.save_host_keys(known)


def _known_name(host: NewHost) -> str:
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


def run_doctor(inventory: Path, source: str, name: str, say: Callable[[str], None] = print) -> int:
    """The doctor on ``name`` through a copy of the inventory that holds it (beside the real one,
    so relative paths and group_data resolve the same); its exit status."""
    fd, tmp = tempfile.mkstemp(dir=inventory.parent, prefix=f".{name}-add-", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(source)
        argv = [sys.executable, "-m", "pyinfra", "-y", tmp, "deploys/doctor.py", "--limit", name]
        say(f"--> the doctor on {name}: {' '.join(argv[2:])}")
        return subprocess.run(argv, cwd=REPO, timeout=900).returncode
    finally:
        Path(tmp).unlink(missing_ok=True)


def add(inventory: str, host: NewHost, *, doctor: bool = True, say: Callable[[str], None] = print) -> None:
    path = Path(inventory)
    if not path.is_file():
        raise EnrolError(f"{inventory}: no such inventory file")
    source = path.read_text(encoding="utf-8")
    edited = with_host(source, host)  # refuses a taken name before any connection
    check_reachable(host)
    say(f"--> {host.name}: reachable at {host.user}@{host.address}:{host.port}, host key {host.host_key} pinned")
    if doctor and run_doctor(path, edited, host.name, say) != 0:
        raise EnrolError(f"{host.name}: the doctor found a blocker (above); not added. Fix it, then run add again")
    replace_file(path, edited)
    say(f"--> {host.name}: added to {inventory} ({host.group})")


def remove(
    inventory: str, name: str, *, drain: Callable[[str], list[str]] | None, say: Callable[[str], None] = print
) -> None:
    path = Path(inventory)
    if not path.is_file():
        raise EnrolError(f"{inventory}: no such inventory file")
    source = path.read_text(encoding="utf-8")
    edited = without_host(source, check_name(name))
    if drain is not None:
        busy = drain(name)
        if busy:
            say(f"--> {name}: still busy after the wait ({', '.join(busy)}); its running streams end with the host")
    replace_file(path, edited)
    say(f"--> {name}: taken out of {inventory}; re-run deploys/gateway.py to drop it from the gateway's config")
