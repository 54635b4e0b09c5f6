#!/usr/bin/env python3
"""Make this WSL distro a host the fleet's controller can manage, in one command the PC's owner
runs inside the distro (as root, through sudo):

    sudo python3 enrol.py --key 'ssh-ed25519 AAAA... operator@controller' --allow 192.0.2.5 [--name ws7]

It opens only what the fleet needs: sshd's port, from the ``--allow`` addresses (the controller's,
and the gateway host's when it runs the deploy), on the Private and Domain networks, for one
dedicated account (``freetoken-deploy``) that logs in with the controller's key only. It
converges, and a second run changes nothing and says so:

1. ``/etc/wsl.conf`` ``[boot] systemd=true`` and ``%UserProfile%\\.wslconfig`` ``[wsl2]``
   ``networkingMode=mirrored`` (the distro answers on the PC's own LAN address), merged with the
   deploy's own reader (``freetoken_infra/core/wsl_ini.py``: your comments and keys stay);
   ``.wslconfig`` is read and written as the deploy does (``freetoken_infra/core/hostio.py``):
   no link followed, a FIFO, folder or file over 64 KiB refused, written by rename;
2. the deploy account ``freetoken-deploy`` (created without a password: it logs in with the
   key only), or the owner's own account when ``--user NAME`` asks for it;
3. sshd (Debian's ``openssh-server``) on ``--port`` (2222: Windows' own OpenSSH may hold 22),
   public-key authentication only, for that account only (``AllowUsers``), from a drop-in named
   to be read first (``00-freetoken.conf``: sshd keeps the first value it reads), checked with
   ``sshd -t`` and then by its effective values (``sshd -T``, also as a connection from each
   ``--allow`` address sees them): a file that wins over the drop-in is named;
4. the controller's key, with ``from=`` the ``--allow`` addresses, in the account's
   ``~/.ssh/authorized_keys`` (written by that user, never by root inside the user's home), and
   a sudoers drop-in without a password prompt for that user (as root only), checked with
   ``visudo -c`` before it is installed;
5. on Windows, through interop, in ONE elevated PowerShell (Windows asks once): the Hyper-V
   firewall rule that lets the port reach the distro from the ``--allow`` addresses on the
   Private and Domain profiles (never Public: a laptop on a café's Wi-Fi), and the logon task
   that starts the distro (the deploy's ``windows_autostart`` task, same name);
6. Wake-on-LAN readiness, as far as WSL can see it.

It ends with what the owner must still do (``wsl.exe --shutdown`` from Windows when a WSL file
changed or systemd is not running yet) and the inventory line with the SSH host key fingerprint,
for ``python -m freetoken_infra.fleet add``. Every input is checked before anything changes; a
bad one is refused in one line naming it.

Standard library only. From a copy of the repository it imports the core module it shares with
the deploy; ``python3 enrol.py --bundle > enrol-standalone.py`` writes one file with that module
inside, for the operator to hand out.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import glob
import hashlib
import importlib
import ipaddress
import json
import os
import pwd
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_MODULE = "freetoken_infra.core.wsl_ini"
HOSTIO_MODULE = "freetoken_infra.core.hostio"  # reads and writes below the drive root, no link followed
_BUNDLED_WSL_INI: str | None = None  # --bundle puts the core module's source here
_BUNDLED_HOSTIO: str | None = None  # --bundle puts hostio's source here


def _core(name: str, bundled: str | None):
    if bundled is not None:
        if name in sys.modules:
            return sys.modules[name]
        module = types.ModuleType(name)
        module.__dict__["__name__"] = name
        sys.modules[name] = module  # dataclasses look their module up by name
        exec(compile(bundled, name.rsplit(".", 1)[1] + ".py", "exec"), module.__dict__)
        return module
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository's root
    return importlib.import_module(name)


def _wsl_ini():
    return _core(CORE_MODULE, _BUNDLED_WSL_INI)


def _hostio():
    return _core(HOSTIO_MODULE, _BUNDLED_HOSTIO)


WSL_CONF = "/etc/wsl.conf"
SSHD_CONFIG = "/etc/ssh/sshd_config"
# Read first of the drop-ins (sshd keeps the first value it reads; Debian's sshd_config includes
# sshd_config.d/*.conf in name order at its top): a `50-cloud-init.conf` cannot override it.
SSHD_DROPIN = "/etc/ssh/sshd_config.d/00-freetoken.conf"
# Where earlier versions wrote it: sorted after every NN-*.conf, so those won. Removed when it is
# ours (it starts with DROPIN_HEADER).
OLD_SSHD_DROPIN = "/etc/ssh/sshd_config.d/freetoken.conf"
DROPIN_HEADER = "# Written by freetoken-infra's enrol.py"
SUDOERS_DROPIN = "/etc/sudoers.d/freetoken-deploy"
SHADOW = "/etc/shadow"
# The account the deploy logs in as unless the owner asks for their own (--user): created here,
# no password (key only), sudo as root without a prompt. freetoken_infra/enrolment.py DEPLOY_USER.
DEPLOY_USER = "freetoken-deploy"
DEPLOY_HOME = "/home/freetoken-deploy"
# The deploy's service and download users (settings service_user, fetch_user): never the login.
SERVICE_USERS = ("freetoken", "freetoken-fetch")
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key.pub"
TASK_NAME = "FreeToken-WSL"  # the deploy's windows_autostart task (deploys/freetoken.py)
FIREWALL_RULE = "FreeToken-WSL-sshd"
# The Hyper-V firewall's id for WSL's VM: the same on every machine (Microsoft's WSL docs,
# "Configure Hyper-V firewall").
WSL_VM_CREATOR_ID = "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}"
# The network profiles the rule applies on: a LAN at home or at work, never a Public network.
FIREWALL_PROFILES = ("Domain", "Private")
_PROFILE_BITS = {"Domain": 1, "Private": 2, "Public": 4}  # NetSecurity's Profile flags
RESTART = "from Windows, run `wsl.exe --shutdown`, open the distro again"

KEY_TYPES = (
    "ssh-ed25519",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
    "ssh-rsa",
    "sk-ssh-ed25519@openssh.com",
    "sk-ecdsa-sha2-nistp256@openssh.com",
)
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
DISTRO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_COMMENT = re.compile(r"[A-Za-z0-9@._+:=-]{1,100}")


class EnrolError(Exception):
    """One line: what is wrong, naming the field or the step, and that nothing else changed."""


# --------------------------------------------------------------------------- inputs, checked
def public_key(text: str) -> str:
    """The controller's public key as one authorized_keys line, or EnrolError naming why."""
    line = text.strip()
    if "\n" in line or "\r" in line:
        raise EnrolError("--key: more than one line; give exactly one public key")
    parts = line.split(" ")
    if len(parts) not in (2, 3) or parts[0] not in KEY_TYPES:
        raise EnrolError(
            f"--key: not an OpenSSH public key ('TYPE BASE64 [COMMENT]', TYPE one of {', '.join(KEY_TYPES)})"
        )
    try:
        blob = base64.b64decode(parts[1], validate=True)
        (length,) = struct.unpack(">I", blob[:4])
        inner = blob[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError, ValueError):
        raise EnrolError("--key: its base64 body does not decode to a key") from None
    if inner != parts[0] or len(blob) < 4 + length + 16:
        raise EnrolError(f"--key: its body is not a {parts[0]} key")
    if len(parts) == 3 and not _COMMENT.fullmatch(parts[2]):
        raise EnrolError("--key: its comment may hold letters, digits and @._+:=- only")
    return line


def fingerprint(pub_line: str) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint of a public key line (``ssh-keygen -l``)."""
    blob = base64.b64decode(pub_line.split()[1])
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class Inputs:
    key: str
    name: str
    user: str
    port: int
    allow: tuple[str, ...]  # the addresses the controller (and the gateway host) connect from


def allowed(values: list[str] | None) -> tuple[str, ...]:
    """The ``--allow`` addresses, each one IP address in its normal form, in the order given.
    Required: enrol.py runs at the PC before the controller ever connected, so nothing here has
    seen the controller's address (a key's comment is text, not an address)."""
    if not values:
        raise EnrolError(
            "--allow: give the address the controller connects from (repeat it for the gateway host "
            "when it runs the deploy); only these reach sshd"
        )
    found: list[str] = []
    for value in values:
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            raise EnrolError(
                f"--allow {value!r}: not an IP address (one address each; no names, no networks)"
            ) from None
        if address.is_unspecified or address.is_multicast:
            raise EnrolError(f"--allow {value}: not the address of one machine")
        if str(address) not in found:
            found.append(str(address))
    return tuple(found)


def inputs(args: argparse.Namespace) -> Inputs:
    """The checked inputs. The deploy's account is its own (``DEPLOY_USER``), not whoever ran
    sudo: the owner's account only with ``--user``."""
    key = public_key(args.key if args.key is not None else _read_key_file(args.key_file))
    name = args.name or os.uname().nodename.split(".")[0]
    if not NAME.fullmatch(name):
        raise EnrolError(f"--name {name!r}: a host name is letters, digits and inner hyphens (at most 63)")
    user = args.user or DEPLOY_USER
    if not USER.fullmatch(user):
        raise EnrolError(f"--user {user!r}: not a user name")
    if user in SERVICE_USERS:
        raise EnrolError(f"--user {user}: the engine's or the download's own user; never the deploy's login")
    if user != DEPLOY_USER:  # the owner's own account: it must be there; DEPLOY_USER is made here
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise EnrolError(f"--user {user}: no such user in this distro") from None
    if not 1024 <= args.port <= 65535:
        raise EnrolError(f"--port {args.port}: use a port from 1024 to 65535 (Windows may hold 22)")
    return Inputs(key, name, user, args.port, allowed(args.allow))


def _read_key_file(path: str | None) -> str:
    if not path:
        raise EnrolError("--key or --key-file: the controller's public key is needed")
    try:
        with open(path, encoding="ascii") as f:
            return f.read(16384)
    except (OSError, UnicodeDecodeError) as exc:
        raise EnrolError(f"--key-file {path}: cannot read it ({exc.__class__.__name__})") from None


# --------------------------------------------------------------------------- what it writes
def sshd_dropin(port: int, user: str) -> str:
    return (
        f"{DROPIN_HEADER}: the fleet's controller logs in with its key only, as {user} only.\n"
        f"Port {port}\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "AuthenticationMethods publickey\n"
        f"PermitRootLogin {'prohibit-password' if user == 'root' else 'no'}\n"
        f"AllowUsers {user}\n"
    )


def sshd_wanted(i: Inputs) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What ``sshd -T`` must print for the drop-in to be in effect: its key in lower case ->
    (the key as the drop-in spells it, the values). ``Port`` and ``AllowUsers`` add up over every
    file (each line adds one), so their values are compared as a set; sshd keeps the first value
    it reads of each other key. ``sshd -T`` spells prohibit-password without-password."""
    return {
        "port": ("Port", (str(i.port),)),
        "pubkeyauthentication": ("PubkeyAuthentication", ("yes",)),
        "passwordauthentication": ("PasswordAuthentication", ("no",)),
        "kbdinteractiveauthentication": ("KbdInteractiveAuthentication", ("no",)),
        "authenticationmethods": ("AuthenticationMethods", ("publickey",)),
        "permitrootlogin": ("PermitRootLogin", ("without-password" if i.user == "root" else "no",)),
        "allowusers": ("AllowUsers", (i.user,)),
    }


ADDING_KEYS = ("port", "allowusers")  # each line adds a value; of the others the first line wins


def sudoers_dropin(user: str) -> str:
    """NOPASSWD: the deploy is pyinfra over SSH, in a batch that cannot answer a prompt. As root
    only (never another user, never a group), but every command: pyinfra runs each of its
    operations as ``sudo -H -n sh -c '...'`` (and ``fleet`` as ``sudo -n sh -c``), so a rule for
    ``sh`` would allow every command all the same. What keeps this account to the controller is
    SSH: the key only, ``from=`` and ``AllowUsers``, behind the firewall rule."""
    return (
        f"{DROPIN_HEADER}: the deploy (pyinfra over SSH, `sudo -n sh -c ...`) elevates without a prompt, to root only.\n"
        f"{user} ALL=(root) NOPASSWD: ALL\n"
    )


def authorized_key_line(key: str, allow: tuple[str, ...]) -> str:
    """The controller's key as the account's authorized_keys holds it: usable only from the
    ``--allow`` addresses (sshd(8), AUTHORIZED_KEYS FILE FORMAT, ``from="pattern-list"``)."""
    return f'from="{",".join(allow)}" {key}'


@dataclass(frozen=True)
class RuleSeen:
    """The Hyper-V firewall rule as Windows has it: its local ports, remote addresses (None:
    ``Any``) and network profiles."""

    ports: frozenset[str]
    addresses: frozenset[str] | None
    profiles: frozenset[str]

    def is_as(self, port: int, allow: tuple[str, ...]) -> bool:
        return (self.ports, self.addresses, self.profiles) == (
            frozenset({str(port)}),
            frozenset(allow),
            frozenset(FIREWALL_PROFILES),
        )


# One line per rule: LocalPorts|RemoteAddresses|Profiles (the profiles as Windows writes the flags
# enum, "Domain, Private", or its number; "Any" for any address or profile).
RULE_QUERY = (
    f"Get-NetFirewallHyperVRule -Name '{FIREWALL_RULE}' | ForEach-Object "
    "{ ($_.LocalPorts -join ',') + '|' + ($_.RemoteAddresses -join ',') + '|' + $_.Profiles }"
)


def _profiles(text: str) -> frozenset[str]:
    text = text.strip()
    if text.isdigit():
        bits = int(text)
        if bits == 0:  # Any
            return frozenset(_PROFILE_BITS)
        return frozenset(name for name, bit in _PROFILE_BITS.items() if bits & bit)
    names = {part for part in re.split(r"[,\s]+", text) if part}
    return frozenset(_PROFILE_BITS) if "Any" in names else frozenset(names)


def _address(text: str) -> str:
    """One address in its normal form; a one-address subnet (``/32``, ``/255.255.255.255``,
    ``/128``), should Windows write one so, as that address."""
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError:
        return text  # a range or a keyword: never equal to an --allow address
    return str(network.network_address) if network.num_addresses == 1 else str(network)


def parse_rule(output: str) -> RuleSeen | None:
    """The rule from ``RULE_QUERY``'s output; None when there is none (no such line)."""
    for line in output.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        ports, addresses, profiles = parts
        remote = (
            None if addresses.strip() in ("", "Any") else frozenset(_address(a.strip()) for a in addresses.split(","))
        )
        return RuleSeen(frozenset(p.strip() for p in ports.split(",") if p.strip()), remote, _profiles(profiles))
    return None


def firewall_rule_lines(port: int, allow: tuple[str, ...], replace: bool) -> list[str]:
    """The Hyper-V rule: TCP ``port`` into WSL's VM from ``allow`` only, on the Domain and Private
    profiles (New-NetFirewallHyperVRule's ``-RemoteAddresses``, ``-Profiles``). A rule that is
    there but admits something else is removed first (Set-NetFirewallHyperVRule cannot change
    its profiles)."""
    lines = [f"Remove-NetFirewallHyperVRule -Name '{FIREWALL_RULE}'"] if replace else []
    addresses = ",".join(f"'{a}'" for a in allow)
    lines.append(
        f"New-NetFirewallHyperVRule -Name '{FIREWALL_RULE}' -DisplayName 'FreeToken WSL sshd' "
        f"-Direction Inbound -VMCreatorId '{WSL_VM_CREATOR_ID}' -Protocol TCP -LocalPorts {port} "
        f"-RemoteAddresses {addresses} -Profiles {','.join(FIREWALL_PROFILES)}"
    )
    return lines


def powershell_script(
    port: int, distro: str, rule: bool, task: bool, allow: tuple[str, ...] = (), replace: bool = False
) -> str:
    """The one elevated script: the firewall rule (``replace``: the one there first removed) and
    the logon task, each only when not as wanted."""
    lines = ["$ErrorActionPreference = 'Stop'"]
    if rule:
        if not allow:
            raise ValueError("the firewall rule needs the addresses it admits")
        lines += firewall_rule_lines(port, allow, replace)
    if task:
        lines.append(
            f"schtasks.exe /Create /F /SC ONLOGON /TN '{TASK_NAME}' /TR 'wsl.exe -d {distro} --exec /bin/true'"
        )
    return "\r\n".join(lines) + "\r\n"


def elevated_command(script: str) -> list[str]:
    """``powershell.exe`` that starts an elevated PowerShell for ``script`` (Windows' own UAC
    prompt, once) and waits for it; the script travels encoded, as PowerShell reads it."""
    encoded = base64.b64encode(script.encode("utf-16-le")).decode()
    inner = f"Start-Process powershell.exe -Verb RunAs -Wait -ArgumentList '-NoProfile','-EncodedCommand','{encoded}'"
    return ["powershell.exe", "-NoProfile", "-NonInteractive", "-Command", inner]


def admits(i: Inputs) -> str:
    """The line that says who can log in, for the owner and the operator."""
    return f"{i.user}, with the controller's key, from {', '.join(i.allow)} (Domain and Private networks)"


def inventory_line(i: Inputs, address: str, host_key: str | None) -> str:
    data = {"ssh_hostname": address, "ssh_port": i.port, "ssh_user": i.user}
    pin = f"  # host key {host_key}" if host_key else ""
    return f'("{i.name}", {json.dumps(data)}),{pin}'


def add_command(i: Inputs, address: str, host_key: str | None) -> str:
    argv = ["python", "-m", "freetoken_infra.fleet", "add", i.name, address, "--port", str(i.port), "--user", i.user]
    if host_key:
        argv += ["--host-key", host_key]
    return " ".join(shlex.quote(a) for a in argv)


# --------------------------------------------------------------------------- doing it
@dataclass
class Run:
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    todo: list[str] = field(default_factory=list)
    restart: bool = False
    apt_updated: bool = False

    def step(self, what: str, changed: bool) -> None:
        (self.changed if changed else self.unchanged).append(what)
        print(f"  {'changed' if changed else 'ok':8} {what}", flush=True)


# Where Windows keeps the interop tools, below the drive root (sudo's secure_path drops the
# Windows folders WSL appends to PATH, so they are looked for there too).
SYSTEM32 = {
    "cmd.exe": "c/Windows/System32/cmd.exe",
    "schtasks.exe": "c/Windows/System32/schtasks.exe",
    "powershell.exe": "c/Windows/System32/WindowsPowerShell/v1.0/powershell.exe",
}
_DRIVE_ROOT = ["/mnt/"]  # wsl.conf's [automount] root, read by enrol()


def _exe(name: str) -> str:
    if name not in SYSTEM32:
        return name
    found = shutil.which(name)
    if found:
        return found
    path = _DRIVE_ROOT[0] + SYSTEM32[name]
    return path if os.path.exists(path) else name


def _run(argv: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    argv = [_exe(argv[0]), *argv[1:]]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    except FileNotFoundError:
        raise EnrolError(f"{what}: {argv[0]} not found") from None
    except subprocess.TimeoutExpired:
        raise EnrolError(f"{what}: {argv[0]} did not finish in 10 minutes") from None
    return result


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_atomic(path: str, data: bytes, mode: int) -> bool:
    """Replace ``path`` by ``data`` (a temporary file in the same root-owned folder, renamed);
    False when it already holds exactly that."""
    if _read(path) == data and (os.stat(path).st_mode & 0o777) == mode:
        return False
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".enrol-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def merge_ini(
    wsl_ini, path: str, dialect: str, section: str, values: dict[str, str], label: str, run: Run, hostio=None
) -> None:
    """Merge ``values`` into ``path``; with ``hostio`` (``.wslconfig``, below the drive root where
    every Linux account can plant a link, a FIFO or a huge file) read and written without
    following a link (``hostio.read_at``, ``hostio.write_below``)."""
    original = _read(path) if hostio is None else read_below(hostio, path, label)
    result = wsl_ini.merge(original, dialect, section, values)
    if result.problem is not None:
        raise EnrolError(f"{label}: cannot be changed safely ({result.problem}); fix that line, then run this again")
    if hostio is None:
        changed = result.writes and write_atomic(path, result.data, 0o644)
    else:
        changed = bool(result.writes) and result.data != original
        if changed:
            try:
                hostio.write_below(path, result.data)
            except (hostio.Refused, OSError) as exc:
                raise EnrolError(f"{label}: {_why(exc, path)}; nothing written") from None
    run.step(f"{label} [{section}] {', '.join(f'{k}={v}' for k, v in values.items())}", changed)
    run.restart = run.restart or changed


def _why(exc: Exception, path: str) -> str:
    return str(exc) if not isinstance(exc, OSError) else f"{path}: {exc.strerror}"


def read_below(hostio, path: str, label: str) -> bytes | None:
    """The bytes of ``path`` (None: there is none), or an ``EnrolError`` naming it when a folder
    on the way or the file is a link, or the file is no regular file of at most 64 KiB."""
    folder, name = os.path.split(path)
    refused = "root does not follow or replace it: remove it, then run this again"
    try:
        fd = hostio.open_folder(folder)
    except FileNotFoundError:
        return None
    except (hostio.Refused, OSError) as exc:
        raise EnrolError(f"{label}: {_why(exc, folder)}; {refused}") from None
    try:
        return hostio.read_at(fd, name, path)
    except (hostio.Refused, OSError) as exc:
        raise EnrolError(f"{label}: {_why(exc, path)}; {refused}") from None
    finally:
        os.close(fd)


def windows_profile() -> str | None:
    """The Windows user's profile folder as a WSL path (``cmd.exe`` and ``wslpath``), or None."""
    echo = _run(["cmd.exe", "/c", "echo %USERPROFILE%"], "Windows profile", cwd="/")
    text = echo.stdout.strip().splitlines()[-1].strip() if echo.returncode == 0 and echo.stdout.strip() else ""
    if not re.fullmatch(r"[A-Za-z]:\\[^%<>|\"*?\r\n]*", text):
        return None
    path = _run(["wslpath", "-u", text], "Windows profile")
    folder = path.stdout.strip()
    return folder if path.returncode == 0 and os.path.isdir(folder) else None


def systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


def pid1_started(proc: str = "/proc") -> float | None:
    """When this distro's PID 1 started, in seconds since the epoch: the kernel's boot time
    (``btime`` in ``/proc/stat``) plus PID 1's start in clock ticks (field 22 of
    ``/proc/1/stat``); None when either cannot be read. ``wsl.exe --shutdown`` and opening the
    distro again start a new PID 1."""
    try:
        with open(f"{proc}/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        with open(f"{proc}/1/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 is the 20th after it
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def restart_pending(paths: list[str], proc: str = "/proc") -> bool:
    """Whether one of ``paths`` (the WSL settings files) changed after PID 1 started, so the
    distro has not read it yet: an earlier run that changed it and stopped before its end (a
    declined Windows prompt) still owes the owner the restart. When PID 1's start cannot be read,
    a restart is asked for."""
    started = pid1_started(proc)
    for path in paths:
        try:
            mtime = os.stat(path).st_mtime
        except FileNotFoundError:
            continue
        if started is None or mtime > started:
            return True
    return False


def ensure_package(package: str, run: Run) -> None:
    """Debian's ``package``, installed when it is not."""
    if _run(["dpkg-query", "-W", "-f=${Status}", package], package).stdout.strip() == "install ok installed":
        return
    print(f"  ...      installing {package} (Debian's package)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = [["apt-get", "install", "-y", "-qq", package]]
    if not run.apt_updated:
        steps.insert(0, ["apt-get", "update", "-qq"])
    for argv in steps:
        result = _run(argv, package, env=env)
        if result.returncode != 0:
            raise EnrolError(f"{package}: {' '.join(argv)} failed: {(result.stderr or result.stdout).strip()[-300:]}")
    run.apt_updated = True
    run.step(f"{package} installed", True)


def ensure_account(i: Inputs, run: Run) -> None:
    """``DEPLOY_USER``: a system account with a home for its ``~/.ssh`` and a shell for pyinfra,
    and no password (``*``: nothing to guess, and not sshd's ``!`` that a server without PAM
    reads as a locked account refusing keys too). The owner's own account (``--user``) is left
    as it is."""
    if i.user != DEPLOY_USER:
        run.step(f"the deploy logs in as your account {i.user} (--user)", False)
        return
    created = not _account_exists(DEPLOY_USER)
    if created:
        argv = ["useradd", "--system", "--user-group", "--create-home", "--home-dir", DEPLOY_HOME]
        argv += ["--shell", "/bin/bash", "--password", "*", "--comment", "freetoken-infra deploy", DEPLOY_USER]
        result = _run(argv, "account")
        if result.returncode != 0:
            raise EnrolError(
                f"account {DEPLOY_USER}: useradd failed: {(result.stderr or result.stdout).strip()[-300:]}"
            )
    unlocked = password_field(DEPLOY_USER) != "*"
    if unlocked:  # a password someone set since: the account logs in with the key only
        result = _run(["usermod", "--password", "*", DEPLOY_USER], "account")
        if result.returncode != 0:
            raise EnrolError(
                f"account {DEPLOY_USER}: usermod failed: {(result.stderr or result.stdout).strip()[-300:]}"
            )
    run.step(f"deploy account {DEPLOY_USER}: no password, the controller's key only", created or unlocked)


def _account_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def password_field(user: str, shadow: str | None = None) -> str | None:
    """The password field of ``user`` in ``/etc/shadow`` (None: no line)."""
    try:
        with open(shadow or SHADOW, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(":")
                if fields[0] == user and len(fields) > 1:
                    return fields[1]
    except FileNotFoundError:
        return None
    return None


@dataclass(frozen=True)
class SshdLine:
    """One setting as sshd reads it: where, the key in lower case, its value, and the Match
    line above it in its file (None: it applies to every connection)."""

    file: str
    line: int
    key: str
    value: str
    match: str | None


def sshd_lines(
    path: str = SSHD_CONFIG, _depth: int = 0, _match: str | None = None, _base: str | None = None
) -> list[SshdLine]:
    """Every setting of sshd's configuration in the order sshd reads it: ``path``, each
    ``Include`` (globs, in name order; relative to the first file's folder) read where it stands."""
    found: list[SshdLine] = []
    base = _base or os.path.dirname(path)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return found
    match = _match
    for number, raw in enumerate(text.splitlines(), 1):
        parsed = re.match(r"\s*([A-Za-z]+)(?:\s*=\s*|\s+)(.*?)\s*$", raw)
        if not parsed or raw.lstrip().startswith("#"):
            continue
        key, value = parsed.group(1).lower(), parsed.group(2)
        if key == "match":
            match = f"{path}:{number}"
            continue
        if key == "include" and _depth < 16:
            for pattern in shlex.split(value):
                pattern = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
                for name in sorted(glob.glob(pattern)):
                    found += sshd_lines(name, _depth + 1, match, base)
            continue
        found.append(SshdLine(path, number, key, value, match))
    return found


def _sshd_effective(output: str) -> dict[str, list[str]]:
    effective: dict[str, list[str]] = {}
    for line in output.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            effective.setdefault(key.lower(), []).append(value.strip())
    return effective


def _winner(key: str, name: str, lines: list[SshdLine], dropin: str) -> str:
    """Which file's line makes ``key`` what it is, in words."""
    if key in ADDING_KEYS:
        others = [f"{s.file}:{s.line} adds {name} {s.value}" for s in lines if s.key == key and s.file != dropin]
        return "; ".join(others) if others else f"no file sets {name} but {dropin}"
    first = next((s for s in lines if s.key == key and s.match is None), None)
    if first is not None and first.file != dropin:
        return (
            f"{first.file}:{first.line} ({name} {first.value}) is read before {dropin} and wins "
            "(sshd keeps the first value it reads)"
        )
    matched = next((s for s in lines if s.key == key and s.match is not None), None)
    if matched is not None:
        return f"{matched.file}:{matched.line} ({name} {matched.value}) in the Match block at {matched.match} wins"
    return f"no file sets it (sshd's default); {dropin} is not read"


def sshd_mismatch(i: Inputs, run=None, config: str = SSHD_CONFIG, dropin: str = SSHD_DROPIN) -> str | None:
    """None when sshd's effective settings (``sshd -T``, and as a connection from each
    ``--allow`` address to the port as the account sees them, ``-C``) are the drop-in's; else
    one line naming the key, what is in effect and the file that won."""
    run = run or _run
    lines = sshd_lines(config)
    contexts: list[tuple[list[str], str]] = [([], "sshd -T")]
    for address in i.allow:
        spec = f"user={i.user},host={address},addr={address},lport={i.port}"
        contexts.append((["-C", spec], f"sshd -T -C {spec}"))
    for extra, said in contexts:
        result = run(["/usr/sbin/sshd", "-T", *extra], "sshd")
        if result.returncode != 0:
            return f"`{said}` failed: {(result.stderr or result.stdout).strip()[-300:]}"
        effective = _sshd_effective(result.stdout)
        for key, (name, want) in sshd_wanted(i).items():
            got = effective.get(key, [])
            if (set(got) == set(want)) if key in ADDING_KEYS else (got == list(want)):
                continue
            shown = " ".join(got) if got else "unset"
            return f"{name} is {shown} in effect (`{said}`), not {' '.join(want)}: {_winner(key, name, lines, dropin)}"
    return None


def ensure_sshd(i: Inputs, run: Run) -> None:
    ensure_package("openssh-server", run)
    previous = _read(SSHD_DROPIN)
    old = _read(OLD_SSHD_DROPIN)
    old_ours = old is not None and old.startswith(DROPIN_HEADER.encode())
    os.makedirs(os.path.dirname(SSHD_DROPIN), exist_ok=True)
    changed = write_atomic(SSHD_DROPIN, sshd_dropin(i.port, i.user).encode(), 0o644)
    if old_ours:
        os.unlink(OLD_SSHD_DROPIN)  # its name sorted last: any NN-*.conf won over it
        changed = True

    def put_back() -> None:
        if previous is None:
            os.unlink(SSHD_DROPIN)
        else:
            write_atomic(SSHD_DROPIN, previous, 0o644)
        if old_ours and old is not None:
            write_atomic(OLD_SSHD_DROPIN, old, 0o644)

    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd -t wants its privilege separation folder
    check = _run(["/usr/sbin/sshd", "-t"], "sshd")
    if check.returncode != 0:
        put_back()
        raise EnrolError(
            f"sshd: its configuration does not pass `sshd -t`: {check.stderr.strip()[-300:]}; drop-in put back"
        )
    problem = sshd_mismatch(i)
    if problem is not None:
        put_back()
        raise EnrolError(f"sshd: {problem}; change that, then run this again; drop-in put back")
    run.step(f"sshd: port {i.port}, public keys only, {i.user} only ({SSHD_DROPIN}, in effect)", changed)
    if not systemd_running():
        run.todo.append("sshd starts with systemd: " + RESTART + " and run this again")
        return
    enabled = _run(["systemctl", "is-enabled", "ssh"], "sshd").stdout.strip() == "enabled"
    active = _run(["systemctl", "is-active", "ssh"], "sshd").stdout.strip() == "active"
    if not enabled or not active:
        result = _run(["systemctl", "enable", "--now", "ssh"], "sshd")
        if result.returncode != 0:
            raise EnrolError(f"sshd: systemctl enable --now ssh failed: {result.stderr.strip()[-300:]}")
    elif changed:
        _run(["systemctl", "reload-or-restart", "ssh"], "sshd")
    run.step("sshd enabled and running", not enabled or not active)


def with_authorized_key(have: str, key: str, allow: tuple[str, ...]) -> str | None:
    """``have`` (an authorized_keys file's text) with the controller's key as
    ``authorized_key_line`` (every other line as it was; the key's earlier line, with other
    options or none, replaced where it stood); None when it is already so."""
    want = authorized_key_line(key, allow)
    kind, body = key.split()[:2]
    ours = re.compile(rf"(?:^|\s){re.escape(kind)}\s+{re.escape(body)}(?:\s|$)")
    lines = have.splitlines()
    found = [n for n, line in enumerate(lines) if ours.search(line)]
    if [lines[n] for n in found] == [want]:
        return None
    if found:
        lines[found[0]] = want
        lines = [line for n, line in enumerate(lines) if n not in found[1:]]
    else:
        lines.append(want)
    return "\n".join(lines) + "\n"


def ensure_authorized_key(i: Inputs, run: Run) -> None:
    """The key written by the user itself (a child process with the user's ids): root never
    opens a path inside the user's home, which the user could point anywhere. A new file in
    ``~/.ssh``, renamed over the old: the user's other keys are never half written."""
    account = pwd.getpwnam(i.user)
    read_w, write_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the deploy user, nothing of root's left
        os.close(read_w)
        status = 1
        try:
            os.setgroups([])
            os.setgid(account.pw_gid)
            os.setuid(account.pw_uid)
            ssh = os.path.join(account.pw_dir, ".ssh")
            os.makedirs(ssh, mode=0o700, exist_ok=True)
            os.chmod(ssh, 0o700)
            keys = os.path.join(ssh, "authorized_keys")
            try:
                fd = os.open(keys, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "r", encoding="utf-8", errors="surrogateescape") as f:
                    have = f.read()
            except FileNotFoundError:
                have = ""
            text = with_authorized_key(have, i.key, i.allow)
            if text is not None:
                fd, tmp = tempfile.mkstemp(dir=ssh, prefix=".authorized_keys.")
                try:
                    os.fchmod(fd, 0o600)
                    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
                        f.write(text)
                    os.replace(tmp, keys)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            os.write(write_w, b"present" if text is None else b"written")
            status = 0
        except BaseException as exc:
            os.write(write_w, f"error {exc.__class__.__name__}: {exc}".encode()[:300])
        finally:
            os._exit(status)
    os.close(write_w)
    with os.fdopen(read_w, "rb") as f:
        said = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    if said not in ("written", "present"):
        raise EnrolError(f"authorized_keys of {i.user}: {said or 'the writer died'}")
    run.step(
        f"the controller's key in ~{i.user}/.ssh/authorized_keys, from {', '.join(i.allow)} only", said == "written"
    )


def ensure_sudoers(i: Inputs, run: Run) -> None:
    if i.user == "root":
        run.step("sudo: the deploy logs in as root, no drop-in needed", False)
        return
    if not os.path.isdir("/etc/sudoers.d") or not shutil.which("visudo", path="/usr/sbin:/usr/bin:/sbin:/bin"):
        ensure_package("sudo", run)  # the deploy elevates with it
    if not os.path.isdir("/etc/sudoers.d"):
        raise EnrolError("sudo: /etc/sudoers.d is missing after installing sudo; create it, then run this again")
    text = sudoers_dropin(i.user).encode()
    if _read(SUDOERS_DROPIN) == text:
        run.step(f"sudo as root without a prompt for {i.user} ({SUDOERS_DROPIN})", False)
        return
    fd, tmp = tempfile.mkstemp(dir="/etc/sudoers.d", prefix=".enrol-")  # sudo skips names with a dot
    try:
        os.fchmod(fd, 0o440)
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        check = _run(["visudo", "-c", "-q", "-f", tmp], "sudo")
        if check.returncode != 0:
            raise EnrolError(
                f"sudo: the drop-in does not pass `visudo -c`: {(check.stderr or check.stdout).strip()[-300:]}"
            )
        os.replace(tmp, SUDOERS_DROPIN)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    run.step(f"sudo as root without a prompt for {i.user} ({SUDOERS_DROPIN})", True)


def _powershell(command: str) -> subprocess.CompletedProcess:
    return _run(["powershell.exe", "-NoProfile", "-NonInteractive", "-Command", command], "Windows", cwd="/")


def distro_name() -> str:
    """``$WSL_DISTRO_NAME`` (sudo drops it), else the name in ``wslpath -w /``
    (``\\\\wsl.localhost\\NAME\\``), as the deploy reads it (facts/windows_tasks.py)."""
    name = os.environ.get("WSL_DISTRO_NAME", "")
    if name:
        return name
    root = _run(["wslpath", "-w", "/"], "Windows").stdout.strip()
    match = re.fullmatch(r"\\\\[^\\]+\\([^\\]+)\\?", root)
    return match.group(1) if match else ""


def firewall_rule() -> RuleSeen | None:
    """The Hyper-V firewall rule as Windows has it (None: there is none)."""
    result = _powershell(RULE_QUERY)
    return parse_rule(result.stdout) if result.returncode == 0 else None


def ensure_windows(i: Inputs, run: Run) -> None:
    distro = distro_name()
    if not DISTRO.fullmatch(distro):
        raise EnrolError(
            f"Windows: the distro's name ({distro!r}, $WSL_DISTRO_NAME or `wslpath -w /`) is not a WSL distribution name"
        )
    seen = firewall_rule()
    rule = seen is None or not seen.is_as(i.port, i.allow)
    task = _run(["schtasks.exe", "/Query", "/TN", TASK_NAME], "Windows", cwd="/").returncode != 0
    if rule or task:
        print("  ...      Windows asks once for administrator rights (the firewall rule, the logon task)", flush=True)
        script = powershell_script(i.port, distro, rule, task, i.allow, replace=seen is not None)
        result = _run(elevated_command(script), "Windows", cwd="/")
        if result.returncode != 0:
            raise EnrolError(f"Windows: the elevated PowerShell failed or was declined: {result.stderr.strip()[-300:]}")
        now = firewall_rule() if rule else None
        if rule and (now is None or not now.is_as(i.port, i.allow)):
            raise EnrolError(
                "Windows: the Hyper-V firewall rule is still missing or not as set (was the prompt declined?)"
            )
        if task and _run(["schtasks.exe", "/Query", "/TN", TASK_NAME], "Windows", cwd="/").returncode != 0:
            raise EnrolError("Windows: the logon task is still missing (was the prompt declined?)")
    run.step(
        f"Windows: Hyper-V firewall rule {FIREWALL_RULE} (TCP {i.port} into WSL from {', '.join(i.allow)}; "
        f"{' and '.join(FIREWALL_PROFILES)} networks only)",
        rule,
    )
    run.step(f"Windows: logon task {TASK_NAME} starts the distro {distro}", task)


def wake_on_lan(run: Run) -> None:
    result = _powershell("Get-NetAdapterPowerManagement | ForEach-Object { $_.Name + '|' + $_.WakeOnMagicPacket }")
    rows = [line.split("|", 1) for line in result.stdout.splitlines() if "|" in line] if result.returncode == 0 else []
    ready = [name.strip() for name, state in rows if state.strip().lower() == "enabled"]
    if ready:
        print(f"  ok       Wake-on-LAN: magic packet enabled on {', '.join(ready)}", flush=True)
    else:
        print("  todo     Wake-on-LAN: cannot see it enabled from here", flush=True)
        run.todo.append(
            "for Wake-on-LAN: in Device Manager, your network adapter's Power Management, allow "
            "'Wake on Magic Packet'; enable Wake-on-LAN in the PC's firmware; turn off Fast Startup"
        )


def host_address() -> str:
    result = _run(["hostname", "-I"], "address")
    addresses = [
        a for a in result.stdout.split() if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127.")
    ]
    return addresses[0] if addresses else "ADDRESS"


def enrol(i: Inputs) -> Run:
    wsl_ini = _wsl_ini()
    run = Run()
    print(f"--> enrolling {i.name} (deploy user {i.user}, sshd port {i.port}, from {', '.join(i.allow)})", flush=True)
    merge_ini(wsl_ini, WSL_CONF, wsl_ini.WSLCONF, "boot", {"systemd": "true"}, WSL_CONF, run)
    conf = _read(WSL_CONF)
    _DRIVE_ROOT[0] = wsl_ini.drive_root(wsl_ini.parse(conf, wsl_ini.WSLCONF)) if conf is not None else "/mnt/"
    profile = windows_profile()
    if profile is None:
        raise EnrolError("Windows: cannot find your Windows profile (cmd.exe and wslpath); is WSL interop on?")
    wslconfig = f"{profile}/.wslconfig"
    merge_ini(
        wsl_ini, wslconfig, wsl_ini.WSLCONFIG, "wsl2", {"networkingMode": "mirrored"}, ".wslconfig", run, _hostio()
    )
    ensure_account(i, run)
    ensure_sshd(i, run)
    ensure_authorized_key(i, run)
    ensure_sudoers(i, run)
    ensure_windows(i, run)
    wake_on_lan(run)
    if run.restart or not systemd_running() or restart_pending([WSL_CONF, wslconfig]):
        run.todo.insert(0, RESTART + " (a WSL setting changed or systemd is not running yet)")
    return run


def bundle() -> str:
    """This script with the core modules inside: one file to hand out."""
    root = os.path.dirname(os.path.dirname(HERE))
    with open(__file__, encoding="utf-8") as f:
        me = f.read()
    for name, marker in ((CORE_MODULE, "_BUNDLED_WSL_INI"), (HOSTIO_MODULE, "_BUNDLED_HOSTIO")):
        with open(os.path.join(root, *name.split(".")) + ".py", encoding="utf-8") as f:
            source = f.read()
        marker += ": str | None = None"
        assert me.count(marker) == 1, "the bundle marker must stand once, outside this function"
        head, tail = me.split(marker + "  #", 1)
        me = head + marker.replace("None = None", f"None = {source!r}") + "  #" + tail
    return me


def build_parser(prog: str = "enrol.py") -> argparse.ArgumentParser:
    """The command line of ``main``; the controller's ``freetoken enrol`` shows the same."""
    ap = argparse.ArgumentParser(prog=prog, description="Make this WSL distro manageable by the fleet's controller.")
    ap.add_argument("--key", help="the controller's public key (one line: TYPE BASE64 [COMMENT])")
    ap.add_argument("--key-file", help="or a file holding it")
    ap.add_argument("--name", help="the host's name in the inventory (default: this distro's host name)")
    ap.add_argument(
        "--user",
        help=f"your own account for the deploy to log in as (default: its own account {DEPLOY_USER}, made here)",
    )
    ap.add_argument(
        "--allow",
        action="append",
        metavar="ADDR",
        help="an address the controller connects from (repeat it for the gateway host when it runs the deploy); "
        "only these reach sshd. Required",
    )
    ap.add_argument("--port", type=int, default=2222, help="sshd's port (default 2222)")
    ap.add_argument("--bundle", action="store_true", help="print a single-file copy of this script and exit")
    return ap


def main(argv: list[str] | None = None, *, prog: str = "enrol.py") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.bundle:
        sys.stdout.write(bundle())
        return 0
    try:
        if os.geteuid() != 0:
            raise EnrolError("run it as root: sudo python3 enrol.py --key '...'")
        given = inputs(args)
        run = enrol(given)
    except EnrolError as exc:
        print(f"enrol: {exc}", file=sys.stderr)
        return 2
    host_key = None
    pub = _read(HOST_KEY)
    if pub:
        host_key = fingerprint(pub.decode())
    address = host_address()
    print("--> " + ("nothing changed" if not run.changed else f"{len(run.changed)} change(s)"))
    for item in run.todo:
        print(f"    still to do: {item}")
    print(f"    sshd admits: {admits(given)}")
    print(f"    inventory line: {inventory_line(given, address, host_key)}")
    print(f"    on the controller: {add_command(given, address, host_key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
