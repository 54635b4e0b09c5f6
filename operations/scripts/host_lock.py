#!/usr/bin/env python3
"""The deploy's host lock, run ON THE TARGET by root's python3 (stdlib only, Python >= 3.8).

One deploy run per host at a time: a run takes the lock before it reads anything it will act
on, renews its lease while it works and releases it at its end. The lock file (JSON, root's,
mode 0600 like its mutex: the engine's user must not read who runs what, and the doctor reads it
as root) names its holder:
controller host, user, process id, start time, command line (secrets masked by the controller before it is sent), a random token (which run holds
it: only root changes the file), the lease's end, and the target-side session that took it:
the sshd process serving the holder's SSH connection (or, on a local run, the controller
process itself), with its start time so a reused process id is not mistaken for it.

Commands (the lock file is --lock-file; every decision is taken under an flock on --mutex):

    take --holder B64JSON --lease S     exit 0 and print {"taken": true, "took_over": OLD|null,
                                        "upload_dir": DIR|null}
                                        when the lock was free, left by a holder that is gone
                                        (its session process no longer exists), past its lease,
                                        or already ours (same token); else exit 3 and print
                                        {"taken": false, "holder": CURRENT}
    renew --token T --lease S           exit 0 when still ours (lease extended), else 3
    release --token T [--upload-dir D]  exit 0 (removed when ours; left alone when not); D, the
                                        run's upload folder, is removed
    take ... --unchanged-if FP --record R
                                        first, when the lock may be taken: if the converge record R
                                        (written by release, below) names fingerprint FP and every
                                        input it lists reads as it did then, exit 5 and print
                                        {"unchanged": true, "inputs": N[, "outcome": O]}: nothing
                                        is taken or written. Else the lock is taken as above and R
                                        is removed (this run's end writes it again if the run
                                        succeeds), and the output says why in "fast_check"
    release ... --record R --fingerprint FP --inputs B64JSON [--outcome B64JSON]
                                        before the lock is released (when ours): write R, the
                                        signature of the inputs (facts/inputs.py) as they read now
                                        and O, how the run ended when it was not a converge (a
                                        host refused until its next boot: the controller's words)
    (any, without root)                 exit 4 and print {"need_root": true, "error": ...}
    check --record R                    print {"changes": {INPUT: NOW}} (or a string: why there is
                                        no record to check): the converge record's inputs that read
                                        otherwise now; reads only (the drift tests' probe)
    show                                print {"holder": CURRENT|null, "alive": bool|null,
                                        "expired": bool|null, "now": EPOCH}

A holder is provably gone when its session process is gone: a killed controller closes its
TCP connection and sshd ends the session at once. A connection that died silently (a Wi-Fi
drop) keeps its sshd session until TCP notices; the lease covers that case.
"""

from __future__ import annotations

import fcntl
import marshal
import os
import stat
import sys
import time

# A no-op run's whole cost on the host is this script's start and its fast check
# (bench/converge.py), so the fast check imports nothing beyond the above: argparse, subprocess,
# socket, json, re and glob were half of the script's CPU there (python3 -X importtime on a
# simulated host). The options are parsed below, systemctl is spawned with os.posix_spawnp,
# /health is read through _socket, the record is marshal's (root's own file), the globs of
# facts/inputs.py are matched by _glob; json, base64 and re are imported where a run that takes
# the lock needs them.

HELD = 3
NEED_ROOT = 4
UNCHANGED = 5
# The converge record's inputs (facts/inputs.py): at most this many entries under a tree and in
# all, and this long for the engine's /health; beyond, the record cannot stand (a full run).
TREE_CAP = 5000
HEALTH_TIMEOUT_S = 2.0
HEALTH_MAX_BYTES = 65536
HEALTH_KEYS = ("status", "version", "model")
# The run's upload folder (pyinfra's _temp_dir): with sudo, pyinfra uploads a file as the SSH
# user to TEMP/pyinfra-<sha1 of the destination> before root copies it into place; in /tmp that
# name is predictable, and another local user could plant it first. So a run that went through
# sudo gets a fresh folder of its own, 0700 and owned by the SSH user (SUDO_UID), made when it
# takes the lock and removed when it releases it.
UPLOAD_PREFIX = "/tmp/freetoken-upload-"
UPLOAD_DIR_PATTERN = r"[A-Za-z0-9_]{8,32}"  # after the prefix


def make_upload_dir() -> str | None:
    """A new 0700 folder for the SSH user's uploads (None when not run through sudo)."""
    uid, gid = os.environ.get("SUDO_UID"), os.environ.get("SUDO_GID")
    if not (uid and uid.isdigit() and gid and gid.isdigit()):
        return None
    # mkdtemp: a new name, made with O_EXCL semantics and mode 0700; in the sticky /tmp nobody
    # but root can rename or remove it before it is handed to the SSH user.
    import tempfile  # here, not at the top: a no-op run's fast check needs none of it

    path = tempfile.mkdtemp(prefix=os.path.basename(UPLOAD_PREFIX), dir=os.path.dirname(UPLOAD_PREFIX))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, int(uid), int(gid))
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def remove_upload_dir(path: str | None) -> None:
    import re

    shape = re.escape(UPLOAD_PREFIX) + UPLOAD_DIR_PATTERN
    if path and re.fullmatch(shape, path) and os.path.isdir(path) and not os.path.islink(path):
        import shutil

        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: follows no link inside


def _stat(pid: int) -> tuple | None:
    """(comm, ppid, start time in clock ticks) of a process, or None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, int(fields[1]), int(fields[19])


def session_of(holder: dict, pid: int | None = None) -> dict | None:
    """The process whose life is the holder's connection: the nearest sshd ancestor of this
    script, or, for a run on this machine itself, the controller's own process."""
    pid = os.getppid() if pid is None else pid
    own_host = os.uname().nodename
    sshd = None
    seen = 0
    while pid > 1 and seen < 64:
        info = _stat(pid)
        if info is None:
            break
        comm, ppid, start = info
        if holder.get("controller") == own_host and pid == holder.get("pid"):
            return {"pid": pid, "start": start, "what": "controller process"}
        if sshd is None and comm.startswith("sshd"):
            sshd = {"pid": pid, "start": start, "what": comm}
        pid, seen = ppid, seen + 1
    return sshd


def session_alive(session: dict | None) -> bool | None:
    """True / False when the holder's session is known to live / be gone; None when unknown."""
    if not isinstance(session, dict) or not isinstance(session.get("pid"), int):
        return None
    info = _stat(session["pid"])
    return info is not None and info[2] == session.get("start")


def _sig(path: str, folder: bool = False) -> str:
    """A path's metadata, not following its last component (a link's target is stat-ed too, for
    its metadata only: nothing is read or written through it). A non-root user cannot set
    ctime: a change of content, mode or owner shows even when undone. ``folder``: a folder's
    type, mode, owner and inode only (its times change with every entry made in it)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"error {exc.errno}"
    if folder and stat.S_ISDIR(st.st_mode):
        return f"{st.st_mode:o} {st.st_uid}:{st.st_gid} {st.st_ino}"
    sig = f"{st.st_mode:o} {st.st_uid}:{st.st_gid} {st.st_size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}"
    if os.path.islink(path):
        try:
            target = os.stat(path)
            sig += (
                f" -> {os.readlink(path)} {target.st_mode:o} {target.st_ino} {target.st_mtime_ns} {target.st_ctime_ns}"
            )
        except OSError as exc:
            sig += f" -> error {exc.errno}"
    return sig


def _tree(root: str, out: dict) -> bool:
    """Every entry below ``root`` (links not followed); False past TREE_CAP entries."""
    count = 0
    for folder, dirs, files in os.walk(root):  # followlinks=False: a link is an entry
        for name in sorted(dirs) + sorted(files):
            count += 1
            if count > TREE_CAP:
                return False
            path = os.path.join(folder, name)
            out[f"tree {path}"] = _sig(path, folder=True)
    return True


def _output(argv: list, timeout_s: int = 30) -> str:
    """What ``argv`` prints on stdout (its stdin and stderr /dev/null), bounded by coreutils'
    ``timeout``; raises OSError when it cannot be started."""
    read, write = os.pipe()
    try:
        pid = os.posix_spawnp(
            "timeout",
            ["timeout", str(timeout_s), *argv],
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, write, 1),
                (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
            ],
        )
    finally:
        os.close(write)
    chunks = []
    try:
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return b"".join(chunks).decode("utf-8", "replace")


def _units(units: list) -> dict:
    if not units:
        return {}
    try:
        shown = _output(["systemctl", "show", "--property=Id,ActiveState,UnitFileState,LoadState", "--", *units])
    except OSError as exc:
        return {"units": f"error {exc}"}
    out = {}
    for i, block in enumerate(shown.strip().split("\n\n")):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        name = units[i] if i < len(units) else props.get("Id", "?")
        out[f"unit {name}"] = " ".join(props.get(k, "?") for k in ("ActiveState", "UnitFileState", "LoadState"))
    return out


NFT_NAME = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")


def _nft(table: str) -> str:
    """What ``nft list table FAMILY NAME`` prints now ("" when there is no such table)."""
    family, _, name = table.partition(" ")
    if family not in ("inet", "ip", "ip6") or not name or not set(name) <= NFT_NAME:
        return "error: not a table"
    try:
        return _output(["nft", "list", "table", family, name])
    except OSError as exc:
        return f"error {exc}"


HEX_IP = frozenset("0123456789abcdefABCDEF:.")
PATH_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789/_.-")


def _loopback(url: str) -> tuple:
    """(netloc, port, path) of ``http://ADDRESS:PORT/PATH``, ADDRESS an IPv4 or [IPv6] literal
    (what facts/inputs.py writes); ValueError for anything else."""
    rest = url[len("http://") :] if url.startswith("http://") else ""
    netloc, slash, path = rest.partition("/")
    address, _, port = netloc.rpartition(":")
    if address.startswith("[") and address.endswith("]"):
        ok = len(address) > 2 and set(address[1:-1]) <= HEX_IP
    else:
        ok = bool(address) and set(address) <= frozenset("0123456789.")
    if not (ok and slash and port.isdigit() and set(path) <= PATH_CHARS):
        raise ValueError(f"not a loopback URL: {url}")
    return address, int(port), "/" + path


def _get(url: str) -> tuple:
    """(HTTP status, body) of a plain GET on loopback. A bare HTTP/1.0 request over a socket, not
    urllib or http.client: both import ssl, about a third of this script's CPU on a no-op run, on
    the owner's PC, for a loopback request that needs none of it."""
    import _socket

    netloc, port, path = _loopback(url)
    host = netloc.strip("[]")
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    conn = _socket.socket(family, _socket.SOCK_STREAM)
    try:
        conn.settimeout(HEALTH_TIMEOUT_S)
        conn.connect((host, port))
        conn.sendall(f"GET {path} HTTP/1.0\r\nHost: {netloc}:{port}\r\n\r\n".encode("ascii"))
        data, deadline = b"", time.monotonic() + HEALTH_TIMEOUT_S
        while len(data) <= HEALTH_MAX_BYTES:  # at most so much, and so long in all (a drip too)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("too slow")
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        conn.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if len(status) < 2 or not status[0].startswith(b"HTTP/") or not status[1].isdigit():
        raise ValueError("not an HTTP answer")
    return int(status[1]), body[:HEALTH_MAX_BYTES]


UPTIME_KEY = b'"uptime_s":'
NUMBER_CHARS = frozenset(b" \t0123456789.eE+-")


def _steady(status: int, body: bytes) -> str:
    """The answer without the value of ``uptime_s``, which moves every second. Two answers equal
    in this are equal in every field the deploy reads (status, version, model): what was cut is
    a number's characters only, never a quote or a comma. The key cannot occur inside a JSON
    string (its quotes would be escaped there)."""
    at = body.find(UPTIME_KEY)
    if at >= 0:
        end = at + len(UPTIME_KEY)
        while end < len(body) and body[end] in NUMBER_CHARS:
            end += 1
        body = body[: at + len(UPTIME_KEY)] + body[end:]
    return f"{status} " + body.decode("latin-1")


def _health(url: str, then: str | None = None, steady_then: str | None = None) -> tuple:
    """(signature, steady) of the engine's /health as far as the deploy reads it: the HTTP status
    and the status, version and model of its JSON (the engine's text: only these fields are
    kept, and only compared). When the answer is steady-equal (``_steady``) to the one recorded
    with ``then``, its signature is ``then`` without parsing it (json's import is a seventh of a
    no-op's start)."""
    try:
        status, body = _get(url)
    except Exception as exc:  # refused, timed out, reset, not HTTP: the engine does not answer
        return f"unreachable {type(exc).__name__}", None
    steady = _steady(status, body)
    if then is not None and steady == steady_then:
        return then, steady
    import json

    try:
        doc = json.loads(body) if status == 200 else None
    except ValueError:
        doc = None
    fields = [doc.get(k) if isinstance(doc, dict) else None for k in HEALTH_KEYS]
    return json.dumps([status, *[f if isinstance(f, (str, int, float, bool)) else None for f in fields]]), steady


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "?"
    info = _stat(1)
    return f"{boot_id} {info[2] if info else '?'}"


def _glob(pattern: str) -> list:
    """``glob.glob(pattern)`` for an absolute pattern whose only wildcards are single ``*`` in
    its components (those of facts/inputs.py), without glob's import of re; any other pattern
    goes to glob. As glob's: ``*`` matches no leading dot unless the component starts with one,
    the folders on the way may be links to folders, the last component may be a dangling link."""
    parts = pattern.split("/")
    if not pattern.startswith("/") or "?" in pattern or "[" in pattern or any(p.count("*") > 1 for p in parts):
        import glob

        return glob.glob(pattern)
    found = ["/"]
    for i, part in enumerate(parts[1:], start=2):
        last = i == len(parts)
        reached = []
        for base in found:
            if "*" not in part:
                path = os.path.join(base, part)
                if os.path.lexists(path) if last else os.path.isdir(path):
                    reached.append(path)
                continue
            head, tail = part.split("*")
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                if name.startswith(".") and not head.startswith("."):
                    continue
                if len(name) >= len(head) + len(tail) and name.startswith(head) and name.endswith(tail):
                    path = os.path.join(base, name)
                    if last or os.path.isdir(path):
                        reached.append(path)
        found = reached
    return found


def digest(inputs: dict, then: dict | None = None, steady_then: dict | None = None) -> tuple:
    """(the signature of every input (facts/inputs.py), one string per input, or None when it
    cannot stand for them: a tree past its cap; the engine's steady /health answers, by URL).
    ``then``, ``steady_then``: the record's, which spare the parsing of an unchanged answer."""
    out = {"boot": _boot()}
    for path in inputs.get("paths", []):
        out[f"path {path}"] = _sig(path)
    for path in inputs.get("dirs", []):
        out[f"dir {path}"] = _sig(path, folder=True)
    for pattern in inputs.get("globs", []):
        matches = sorted(_glob(pattern))
        out[f"glob {pattern}"] = " ".join(matches)
        for path in matches:
            out[f"path {path}"] = _sig(path)
    for root in inputs.get("trees", []):
        if not _tree(root, out):
            return None, {}
    out.update(_units(list(inputs.get("units", []))))
    for table in inputs.get("nft", []):
        out[f"nft {table}"] = _nft(table)
    steady = {}
    for url in inputs.get("health", []):
        key = f"health {url}"
        out[key], steady[url] = _health(url, (then or {}).get(key), (steady_then or {}).get(url))
    return out, steady


def changes(record: dict | None) -> dict | str:
    """Each input of the converge record that reads otherwise now: input -> what it reads now;
    or why the record cannot be checked."""
    if record is None:
        return "no record of a converge"
    inputs, then, steady = record.get("inputs"), record.get("digest"), record.get("steady")
    if not isinstance(inputs, dict) or not isinstance(then, dict):
        return "no record of a converge"
    now, _ = digest(inputs, then, steady if isinstance(steady, dict) else None)
    if now is None:
        return "too many files to check"
    return {k: now.get(k, "gone") for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)}


def unchanged(record_path: str, fingerprint: str) -> tuple:
    """(True, (inputs, outcome)) when the converge record names ``fingerprint`` and its inputs
    read as then (``outcome``: what the run that wrote it ended with, as its release was given
    it: None for a converge); else (False, why)."""
    record = _read_record(record_path)
    if record is not None and record.get("fingerprint") != fingerprint:
        return False, "settings or code changed"
    changed = changes(record)
    if isinstance(changed, str):
        return False, changed
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return False, "changed: " + ", ".join(list(changed)[:3]) + more
    return True, (len((record or {}).get("digest") or ()), (record or {}).get("outcome"))


def unchanged_answer(count: int, outcome: str | None) -> str:
    """``{"unchanged": true, "taken": false, "inputs": N[, "outcome": O]}``, O the JSON text the
    record keeps (one line, as the release wrote it), without json's import."""
    more = f', "outcome": {outcome}' if isinstance(outcome, str) else ""
    return f'{{"unchanged": true, "taken": false, "inputs": {int(count)}{more}}}'


def write_record(record_path: str, fingerprint: str, inputs: dict, outcome: str | None = None) -> int | None:
    """Write the record (root's, 0600, marshal's format: read back by root's python3 alone, and
    without json's import); the number of inputs, None when none stands. ``outcome``: how the
    run ended when it was not a converge (a refusal that stands until the next boot: JSON text,
    as the controller gave it), handed back by the next ``take`` that finds the record standing."""
    now, steady = digest(inputs)
    if now is None:
        _remove(record_path)
        return None
    os.makedirs(os.path.dirname(record_path) or ".", mode=0o755, exist_ok=True)
    doc = {"fingerprint": fingerprint, "inputs": inputs, "digest": now, "steady": steady, "written": time.time()}
    if outcome is not None:
        doc["outcome"] = outcome
    _write_bytes(record_path, marshal.dumps(doc))
    return len(now)


def _remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _read(path: str) -> dict | None:
    if not os.path.lexists(path):  # the lock when no run holds it: no json needed
        return None
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _read_record(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            doc = marshal.loads(f.read())
    except (OSError, ValueError, EOFError, TypeError):
        return None
    return doc if isinstance(doc, dict) else None


def _write(path: str, doc: dict) -> None:
    import json

    _write_bytes(path, (json.dumps(doc) + "\n").encode("utf-8"))


def _write_bytes(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a leftover .tmp of an older release was 0644
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def free_reason(current: dict | None, now: float) -> str | None:
    """Why the lock may be taken (None: it is held)."""
    if not current:
        return "free"
    alive = session_alive(current.get("session"))
    if alive is False:
        return "holder gone"
    expires = current.get("expires")
    if not isinstance(expires, (int, float)) or expires <= now:
        return "lease expired"
    return None


COMMANDS = ("take", "renew", "release", "show", "check")
# Every option takes a value: --holder (take: base64 of the holder's JSON), --token (renew,
# release), --upload-dir (release: removed), --lease (seconds), --record (layout.CONVERGE_RECORD_FILE),
# --unchanged-if (take: the controller's fingerprint), --fingerprint and --inputs (release: the
# record's fingerprint, base64 of the inputs' JSON), --outcome (release: base64 of the JSON of how
# the run ended, when not a converge), --lock-file and --mutex (required).
OPTIONS = (
    "holder",
    "token",
    "upload-dir",
    "lease",
    "record",
    "unchanged-if",
    "fingerprint",
    "inputs",
    "outcome",
    "lock-file",
    "mutex",
)


class Args:
    """The parsed command line: ``command`` and each option (None when absent)."""

    def __init__(self, command: str, values: dict) -> None:
        self.command = command
        self.holder, self.token, self.upload_dir = values.get("holder"), values.get("token"), values.get("upload-dir")
        self.record, self.unchanged_if = values.get("record"), values.get("unchanged-if")
        self.fingerprint, self.inputs, self.outcome = (
            values.get("fingerprint"),
            values.get("inputs"),
            values.get("outcome"),
        )
        self.lock_file, self.mutex = str(values["lock-file"]), str(values["mutex"])
        self.lease = float(values.get("lease") or 300.0)


def parse_args(argv: list) -> Args:
    """``COMMAND --option VALUE ...`` (ValueError naming what is wrong)."""
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"the first argument must be one of {', '.join(COMMANDS)}")
    values: dict = {}
    rest = list(argv[1:])
    while rest:
        option = rest.pop(0)
        name = option[2:] if option.startswith("--") else ""
        if name not in OPTIONS:
            raise ValueError(f"unknown option {option!r}")
        if not rest:
            raise ValueError(f"{option} needs a value")
        values[name] = rest.pop(0)
    for name in ("lock-file", "mutex"):
        if not values.get(name):
            raise ValueError(f"--{name} is required")
    try:
        float(values.get("lease") or 0)
    except ValueError:
        raise ValueError(f"--lease must be a number of seconds, not {values['lease']!r}") from None
    return Args(argv[0], values)


def main(argv: list | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"host_lock.py: {exc} (usage: see this script's docstring)", file=sys.stderr)
        return 2

    folder = os.path.dirname(args.lock_file) or "."
    try:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        mutex = os.open(args.mutex, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.fchmod(mutex, 0o600)
    except PermissionError as exc:  # not root: the controller asks again through sudo
        import json

        print(json.dumps({"error": f"{exc.strerror}: {exc.filename}", "need_root": True}))
        return NEED_ROOT
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        now = time.time()
        current = _read(args.lock_file)
        early = None  # the fast check's reading, when no run holds the lock: before any import
        if args.command == "take" and current is None and args.unchanged_if and args.record:
            same, early = unchanged(args.record, args.unchanged_if)
            if same:
                print(unchanged_answer(*early))
                return UNCHANGED
        import base64
        import json

        if args.command == "check":
            print(json.dumps({"changes": changes(_read_record(args.record) if args.record else None)}))
            return 0
        if args.command == "show":
            print(
                json.dumps(
                    {
                        "holder": current,
                        "now": now,
                        "alive": session_alive((current or {}).get("session")) if current else None,
                        "expired": (not isinstance(current.get("expires"), (int, float)) or current["expires"] <= now)
                        if current
                        else None,
                    }
                )
            )
            return 0
        if args.command == "take":
            holder = json.loads(base64.b64decode(args.holder or "").decode("utf-8"))
            if not isinstance(holder, dict) or not holder.get("token"):
                print(json.dumps({"error": "--holder must be a JSON object with a token"}))
                return 2
            ours = current is not None and current.get("token") == holder["token"]
            why = "ours" if ours else free_reason(current, now)
            if why is None:
                print(json.dumps({"taken": False, "holder": current, "now": now}))
                return HELD
            fast_check = early
            if args.unchanged_if and args.record and not ours and early is None:
                same, detail = unchanged(args.record, args.unchanged_if)
                if same:
                    print(unchanged_answer(*detail))
                    return UNCHANGED
                fast_check = detail
            doc = {**holder, "session": session_of(holder), "taken_at": now, "expires": now + args.lease}
            _write(args.lock_file, doc)
            _remove(args.record)  # written again by this run's release, if the run succeeds
            took_over = current if why in ("holder gone", "lease expired") else None
            upload_dir = make_upload_dir()
            print(
                json.dumps(
                    {
                        "taken": True,
                        "took_over": took_over,
                        "why": why,
                        "upload_dir": upload_dir,
                        "fast_check": fast_check,
                    }
                )
            )
            return 0
        ours = current is not None and current.get("token") == args.token
        if args.command == "renew":
            if current is None or not ours:
                print(json.dumps({"renewed": False, "holder": current}))
                return HELD
            _write(args.lock_file, {**current, "expires": now + args.lease})
            print(json.dumps({"renewed": True}))
            return 0
        remove_upload_dir(args.upload_dir)  # release
        recorded = None
        if ours and args.record and args.fingerprint and args.inputs:
            inputs = json.loads(base64.b64decode(args.inputs).decode("utf-8"))
            outcome = json.loads(base64.b64decode(args.outcome).decode("utf-8")) if args.outcome else None
            if isinstance(inputs, dict) and (outcome is None or isinstance(outcome, dict)):
                text = None if outcome is None else json.dumps(outcome)  # one line
                recorded = write_record(args.record, args.fingerprint, inputs, text)
        if ours:
            os.unlink(args.lock_file)
        print(json.dumps({"released": ours, "recorded": recorded}))
        return 0
    finally:
        os.close(mutex)


if __name__ == "__main__":
    sys.exit(main())
