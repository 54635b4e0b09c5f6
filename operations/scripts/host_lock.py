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

import base64
import fcntl
import json
import os
import re
import stat
import sys
import time

# No argparse, subprocess or socket: a no-op run's whole cost on the host is this script's start
# (bench/converge.py), and those three imports were a third of it (about 7 ms of CPU, measured
# with `python3 -X importtime` on a simulated host): the options are parsed below, systemctl is
# spawned with os.posix_spawnp and /health read through _socket.

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
UPLOAD_DIR_RE = re.compile(re.escape(UPLOAD_PREFIX) + r"[A-Za-z0-9_]{8,32}")


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
    if path and UPLOAD_DIR_RE.fullmatch(path) and os.path.isdir(path) and not os.path.islink(path):
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


def _get(url: str) -> tuple:
    """(HTTP status, body) of a plain GET on loopback. A bare HTTP/1.0 request over a socket, not
    urllib or http.client: both import ssl, about a third of this script's CPU on a no-op run, on
    the owner's PC, for a loopback request that needs none of it."""
    import _socket

    match = re.fullmatch(r"http://(\[[0-9a-fA-F:.]+\]|[0-9.]+):(\d+)(/[A-Za-z0-9/_.-]*)", url)
    if not match:
        raise ValueError(f"not a loopback URL: {url}")
    host, port, path = match.group(1).strip("[]"), int(match.group(2)), match.group(3)
    family = _socket.AF_INET6 if ":" in host else _socket.AF_INET
    conn = _socket.socket(family, _socket.SOCK_STREAM)
    try:
        conn.settimeout(HEALTH_TIMEOUT_S)
        conn.connect((host, port))
        conn.sendall(f"GET {path} HTTP/1.0\r\nHost: {match.group(1)}:{port}\r\n\r\n".encode("ascii"))
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


def _health(url: str) -> str:
    """The engine's /health as far as the deploy reads it (its text is the engine's: only these
    fields of it are kept, and only compared)."""
    try:
        status, body = _get(url)
    except Exception as exc:  # refused, timed out, reset, not HTTP: the engine does not answer
        return f"unreachable {type(exc).__name__}"
    try:
        doc = json.loads(body) if status == 200 else None
    except ValueError:
        doc = None
    fields = [doc.get(k) if isinstance(doc, dict) else None for k in HEALTH_KEYS]
    return json.dumps([status, *[f if isinstance(f, (str, int, float, bool)) else None for f in fields]])


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "?"
    info = _stat(1)
    return f"{boot_id} {info[2] if info else '?'}"


def digest(inputs: dict) -> dict | None:
    """The signature of every input (facts/inputs.py), one string per input; None when it cannot
    stand for them (a tree past its cap)."""
    import glob

    out = {"boot": _boot()}
    for path in inputs.get("paths", []):
        out[f"path {path}"] = _sig(path)
    for path in inputs.get("dirs", []):
        out[f"dir {path}"] = _sig(path, folder=True)
    for pattern in inputs.get("globs", []):
        matches = sorted(glob.glob(pattern))
        out[f"glob {pattern}"] = " ".join(matches)
        for path in matches:
            out[f"path {path}"] = _sig(path)
    for root in inputs.get("trees", []):
        if not _tree(root, out):
            return None
    out.update(_units(list(inputs.get("units", []))))
    for url in inputs.get("health", []):
        out[f"health {url}"] = _health(url)
    return out


def changes(record: dict | None) -> dict | str:
    """Each input of the converge record that reads otherwise now: input -> what it reads now;
    or why the record cannot be checked."""
    if record is None:
        return "no record of a converge"
    inputs, then = record.get("inputs"), record.get("digest")
    if not isinstance(inputs, dict) or not isinstance(then, dict):
        return "no record of a converge"
    now = digest(inputs)
    if now is None:
        return "too many files to check"
    return {k: now.get(k, "gone") for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k)}


def unchanged(record_path: str, fingerprint: str) -> tuple:
    """(True, (inputs, outcome)) when the converge record names ``fingerprint`` and its inputs
    read as then (``outcome``: what the run that wrote it ended with, as its release was given
    it: None for a converge); else (False, why)."""
    record = _read(record_path)
    if record is not None and record.get("fingerprint") != fingerprint:
        return False, "settings or code changed"
    changed = changes(record)
    if isinstance(changed, str):
        return False, changed
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return False, "changed: " + ", ".join(list(changed)[:3]) + more
    return True, (len((record or {}).get("digest") or ()), (record or {}).get("outcome"))


def write_record(record_path: str, fingerprint: str, inputs: dict, outcome: dict | None = None) -> int | None:
    """Write the converge record (root's, 0600); the number of inputs, None when none stands.
    ``outcome``: how the run ended when it was not a converge (a refusal that stands until the
    next boot), handed back by the next ``take`` that finds the record standing."""
    now = digest(inputs)
    if now is None:
        _remove(record_path)
        return None
    os.makedirs(os.path.dirname(record_path) or ".", mode=0o755, exist_ok=True)
    doc = {"fingerprint": fingerprint, "inputs": inputs, "digest": now, "written": time.time()}
    if outcome is not None:
        doc["outcome"] = outcome
    _write(record_path, doc)
    return len(now)


def _remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _write(path: str, doc: dict) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)  # a leftover .tmp of an older release was 0644
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.write("\n")
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
        print(json.dumps({"error": f"{exc.strerror}: {exc.filename}", "need_root": True}))
        return NEED_ROOT
    try:
        fcntl.flock(mutex, fcntl.LOCK_EX)
        now = time.time()
        current = _read(args.lock_file)
        if args.command == "check":
            print(json.dumps({"changes": changes(_read(args.record) if args.record else None)}))
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
            fast_check = None
            if args.unchanged_if and args.record and not ours:
                same, detail = unchanged(args.record, args.unchanged_if)
                if same:
                    count, outcome = detail
                    answer = {"unchanged": True, "taken": False, "inputs": count}
                    if outcome is not None:
                        answer["outcome"] = outcome
                    print(json.dumps(answer))
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
                recorded = write_record(args.record, args.fingerprint, inputs, outcome)
        if ours:
            os.unlink(args.lock_file)
        print(json.dumps({"released": ours, "recorded": recorded}))
        return 0
    finally:
        os.close(mutex)


if __name__ == "__main__":
    sys.exit(main())
