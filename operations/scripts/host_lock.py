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
    (any, without root)                 exit 4 and print {"need_root": true, "error": ...}
    show                                print {"holder": CURRENT|null, "alive": bool|null,
                                        "expired": bool|null, "now": EPOCH}

A holder is provably gone when its session process is gone: a killed controller closes its
TCP connection and sshd ends the session at once. A connection that died silently (a Wi-Fi
drop) keeps its sshd session until TCP notices; the lease covers that case.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time

HELD = 3
NEED_ROOT = 4
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


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description="The deploy's host lock.")
    parser.add_argument("command", choices=("take", "renew", "release", "show"))
    parser.add_argument("--holder", help="base64 of the holder's JSON (take)")
    parser.add_argument("--token", help="the holder's token (renew, release)")
    parser.add_argument("--upload-dir", help="the run's upload folder, removed (release)")
    parser.add_argument("--lease", type=float, default=300.0, help="seconds the lease lasts")
    parser.add_argument("--lock-file", required=True, help="layout.HOST_LOCK_FILE")
    parser.add_argument("--mutex", required=True, help="layout.HOST_LOCK_MUTEX")
    args = parser.parse_args(argv)

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
            doc = {**holder, "session": session_of(holder), "taken_at": now, "expires": now + args.lease}
            _write(args.lock_file, doc)
            took_over = current if why in ("holder gone", "lease expired") else None
            upload_dir = make_upload_dir()
            print(json.dumps({"taken": True, "took_over": took_over, "why": why, "upload_dir": upload_dir}))
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
        if ours:
            os.unlink(args.lock_file)
        print(json.dumps({"released": ours}))
        return 0
    finally:
        os.close(mutex)


if __name__ == "__main__":
    sys.exit(main())
