#!/usr/bin/env python3
"""Make this WSL distro a host the fleet's controller can manage, in one command the PC's owner
runs inside the distro (as root, through sudo):

    sudo python3 enrol.py --key 'ssh-ed25519 AAAA... operator@controller' [--name ws7]

It converges, and a second run changes nothing and says so:

1. ``/etc/wsl.conf`` ``[boot] systemd=true`` and ``%UserProfile%\\.wslconfig`` ``[wsl2]``
   ``networkingMode=mirrored`` (the distro answers on the PC's own LAN address), merged with the
   deploy's own reader (``freetoken_infra/core/wsl_ini.py``: your comments and keys stay);
   ``.wslconfig`` is read and written as the deploy does (``freetoken_infra/core/hostio.py``):
   no link followed, a FIFO, folder or file over 64 KiB refused, written by rename;
2. sshd (Debian's ``openssh-server``) on ``--port`` (2222: Windows' own OpenSSH may hold 22),
   public-key authentication only, checked with ``sshd -t`` before it is used;
3. the controller's key in the deploy user's ``~/.ssh/authorized_keys`` (written by that user,
   never by root inside the user's home), and a sudoers drop-in without a password prompt for
   that user, checked with ``visudo -c`` before it is installed;
4. on Windows, through interop, in ONE elevated PowerShell (Windows asks once): the Hyper-V
   firewall rule that lets the port reach the distro, and the logon task that starts the distro
   (the deploy's ``windows_autostart`` task, same name);
5. Wake-on-LAN readiness, as far as WSL can see it.

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
import hashlib
import importlib
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
SSHD_DROPIN = "/etc/ssh/sshd_config.d/freetoken.conf"
SUDOERS_DROPIN = "/etc/sudoers.d/freetoken-deploy"
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key.pub"
TASK_NAME = "FreeToken-WSL"  # the deploy's windows_autostart task (deploys/freetoken.py)
FIREWALL_RULE = "FreeToken-WSL-sshd"
# The Hyper-V firewall's id for WSL's VM: the same on every machine (Microsoft's WSL docs,
# "Configure Hyper-V firewall").
WSL_VM_CREATOR_ID = "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}"
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


def inputs(args: argparse.Namespace, environ: dict[str, str]) -> Inputs:
    key = public_key(args.key if args.key is not None else _read_key_file(args.key_file))
    name = args.name or os.uname().nodename.split(".")[0]
    if not NAME.fullmatch(name):
        raise EnrolError(f"--name {name!r}: a host name is letters, digits and inner hyphens (at most 63)")
    user = args.user or environ.get("SUDO_USER") or "root"
    if not USER.fullmatch(user):
        raise EnrolError(f"--user {user!r}: not a user name")
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise EnrolError(f"--user {user}: no such user in this distro") from None
    if not 1024 <= args.port <= 65535:
        raise EnrolError(f"--port {args.port}: use a port from 1024 to 65535 (Windows may hold 22)")
    return Inputs(key, name, user, args.port)


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
        "# Written by freetoken-infra's enrol.py: the fleet's controller logs in with its key only.\n"
        f"Port {port}\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "AuthenticationMethods publickey\n"
        f"PermitRootLogin {'prohibit-password' if user == 'root' else 'no'}\n"
    )


def sudoers_dropin(user: str) -> str:
    return f"# Written by freetoken-infra's enrol.py: the deploy elevates without a prompt.\n{user} ALL=(ALL) NOPASSWD:ALL\n"


def powershell_script(port: int, distro: str, rule: bool, task: bool) -> str:
    """The one elevated script: the firewall rule and the logon task, each only when missing."""
    lines = ["$ErrorActionPreference = 'Stop'"]
    if rule:
        lines.append(
            f"New-NetFirewallHyperVRule -Name '{FIREWALL_RULE}' -DisplayName 'FreeToken WSL sshd' "
            f"-Direction Inbound -VMCreatorId '{WSL_VM_CREATOR_ID}' -Protocol TCP -LocalPorts {port}"
        )
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


def ensure_sshd(i: Inputs, run: Run) -> None:
    if _run(["dpkg-query", "-W", "-f=${Status}", "openssh-server"], "sshd").stdout.strip() != "install ok installed":
        print("  ...      installing openssh-server (Debian's package)", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "openssh-server"]):
            result = _run(argv, "sshd", env=env)
            if result.returncode != 0:
                raise EnrolError(f"sshd: {' '.join(argv)} failed: {(result.stderr or result.stdout).strip()[-300:]}")
        run.step("sshd installed (openssh-server)", True)
    previous = _read(SSHD_DROPIN)
    os.makedirs(os.path.dirname(SSHD_DROPIN), exist_ok=True)
    changed = write_atomic(SSHD_DROPIN, sshd_dropin(i.port, i.user).encode(), 0o644)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd -t wants its privilege separation folder
    check = _run(["/usr/sbin/sshd", "-t"], "sshd")
    if check.returncode != 0:
        if previous is None:
            os.unlink(SSHD_DROPIN)
        else:
            write_atomic(SSHD_DROPIN, previous, 0o644)
        raise EnrolError(
            f"sshd: its configuration does not pass `sshd -t`: {check.stderr.strip()[-300:]}; drop-in put back"
        )
    run.step(f"sshd: port {i.port}, public keys only ({SSHD_DROPIN})", changed)
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


def ensure_authorized_key(i: Inputs, run: Run) -> None:
    """The key appended by the user itself (a child process with the user's ids): root never
    opens a path inside the user's home, which the user could point anywhere."""
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
            fd = os.open(keys, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "r+", encoding="utf-8", errors="replace") as f:
                have = f.read()
                present = any(line.split()[:2] == i.key.split()[:2] for line in have.splitlines() if line.strip())
                if not present:
                    f.write(("" if have.endswith("\n") or not have else "\n") + i.key + "\n")
            os.chmod(keys, 0o600)
            os.write(write_w, b"present" if present else b"added")
            status = 0
        except BaseException as exc:
            os.write(write_w, f"error {exc.__class__.__name__}: {exc}".encode()[:300])
        finally:
            os._exit(status)
    os.close(write_w)
    with os.fdopen(read_w, "rb") as f:
        said = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    if said not in ("added", "present"):
        raise EnrolError(f"authorized_keys of {i.user}: {said or 'the writer died'}")
    run.step(f"the controller's key in ~{i.user}/.ssh/authorized_keys", said == "added")


def ensure_sudoers(i: Inputs, run: Run) -> None:
    if i.user == "root":
        run.step("sudo: the deploy logs in as root, no drop-in needed", False)
        return
    if not os.path.isdir("/etc/sudoers.d"):
        raise EnrolError("sudo: /etc/sudoers.d is missing; install sudo (apt-get install sudo), then run this again")
    text = sudoers_dropin(i.user).encode()
    if _read(SUDOERS_DROPIN) == text:
        run.step(f"sudo without a prompt for {i.user} ({SUDOERS_DROPIN})", False)
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
    run.step(f"sudo without a prompt for {i.user} ({SUDOERS_DROPIN})", True)


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


def ensure_windows(i: Inputs, run: Run) -> None:
    distro = distro_name()
    if not DISTRO.fullmatch(distro):
        raise EnrolError(
            f"Windows: the distro's name ({distro!r}, $WSL_DISTRO_NAME or `wslpath -w /`) is not a WSL distribution name"
        )
    rule = _powershell(f"Get-NetFirewallHyperVRule -Name '{FIREWALL_RULE}' | Out-Null").returncode != 0
    task = _run(["schtasks.exe", "/Query", "/TN", TASK_NAME], "Windows", cwd="/").returncode != 0
    if rule or task:
        print("  ...      Windows asks once for administrator rights (the firewall rule, the logon task)", flush=True)
        result = _run(elevated_command(powershell_script(i.port, distro, rule, task)), "Windows", cwd="/")
        if result.returncode != 0:
            raise EnrolError(f"Windows: the elevated PowerShell failed or was declined: {result.stderr.strip()[-300:]}")
        if rule and _powershell(f"Get-NetFirewallHyperVRule -Name '{FIREWALL_RULE}' | Out-Null").returncode != 0:
            raise EnrolError("Windows: the Hyper-V firewall rule is still missing (was the prompt declined?)")
        if task and _run(["schtasks.exe", "/Query", "/TN", TASK_NAME], "Windows", cwd="/").returncode != 0:
            raise EnrolError("Windows: the logon task is still missing (was the prompt declined?)")
    run.step(f"Windows: Hyper-V firewall rule {FIREWALL_RULE} (TCP {i.port} into WSL)", rule)
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
    print(f"--> enrolling {i.name} (deploy user {i.user}, sshd port {i.port})", flush=True)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="enrol.py", description="Make this WSL distro manageable by the fleet's controller."
    )
    ap.add_argument("--key", help="the controller's public key (one line: TYPE BASE64 [COMMENT])")
    ap.add_argument("--key-file", help="or a file holding it")
    ap.add_argument("--name", help="the host's name in the inventory (default: this distro's host name)")
    ap.add_argument("--user", help="the user the deploy logs in as (default: the user who ran sudo)")
    ap.add_argument("--port", type=int, default=2222, help="sshd's port (default 2222)")
    ap.add_argument("--bundle", action="store_true", help="print a single-file copy of this script and exit")
    args = ap.parse_args(argv)
    if args.bundle:
        sys.stdout.write(bundle())
        return 0
    try:
        if os.geteuid() != 0:
            raise EnrolError("run it as root: sudo python3 enrol.py --key '...'")
        given = inputs(args, dict(os.environ))
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
    print(f"    inventory line: {inventory_line(given, address, host_key)}")
    print(f"    on the controller: {add_command(given, address, host_key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
