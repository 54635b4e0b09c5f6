#!/usr/bin/env python3
"""Make one directory exist with the owner and mode the deploy wants, run ON THE TARGET by
root's python3 (stdlib only, Python >= 3.8), never following a link.

pyinfra's ``files.directory`` stats a path, then later runs ``chown``/``chmod`` on it by name:
both follow links, so a less-trusted user who can rename entries in a folder on the way can
swap it for a link in between and root re-owns the link's target. This
script walks the path from ``/`` one component at a time with
``open(O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)`` and acts only on the descriptors it holds
(``fchown``/``fchmod``): what it changes is the directory it opened, whatever is renamed around
it afterwards, and a component that is a link is refused, never followed.

    own_dir.py --path P --owner U --group G --mode 755 [--reclaim USER]... [--adopt-from USER]

* Missing intermediate folders are created root:root 0755. Existing ones are left as they are
  (a setting under /var/lib, /opt or /home/NAME gets only its own leaf), except one owned by a
  ``--reclaim`` user (the engine's or the download's): an earlier layout handed it to that user,
  so it goes back to root:root 0755.
* The leaf is created, or re-owned and re-moded, to OWNER:GROUP MODE.
* ``--adopt-from USER``: every folder and regular file below the leaf still owned by USER (what an
  earlier layout left: the model downloaded as the engine's user) is re-owned to OWNER:GROUP,
  folders 0755, files readable by all and writable by the owner only, set-id bits dropped. The
  walk is ``os.fwalk(follow_symlinks=False)``; every file is opened ``O_NOFOLLOW`` and checked to
  be the entry that was listed before it is touched. Links, devices, FIFOs and anything owned by
  someone else (a hard link to a root file) are left alone.

Exit 0 (each change printed on stdout), 3 with one line on stderr when a component is a link or
not a folder, 4 without root.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import stat
import sys

REFUSED = 3
NEED_ROOT = 4
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class Refused(Exception):
    pass


def _open_dir(name: str, parent_fd: int, shown: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except OSError:
            raise Refused(f"{shown}: {exc.strerror}") from None
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise Refused(f"{shown} is {what}; root does not follow or replace it: remove it and run again") from None


def _set(fd: int, shown: str, uid: int, gid: int, mode: int, changes: list[str]) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
        changes.append(f"{shown}: owner {st.st_uid}:{st.st_gid} -> {uid}:{gid}")
    # fchown may drop set-id bits: the mode is read again.
    now = stat.S_IMODE(os.fstat(fd).st_mode)
    if now != mode:
        os.fchmod(fd, mode)
        changes.append(f"{shown}: mode {now:o} -> {mode:o}")


def ensure(path: str, uid: int, gid: int, mode: int, reclaim: tuple[set[int], set[int]], changes: list[str]) -> int:
    """The leaf's descriptor, after every component is in place (see the module's text)."""
    parts = [p for p in path.split("/") if p]
    if not path.startswith("/") or not parts or any(p in (".", "..") for p in parts):
        raise Refused(f"{path!r}: not a normalised absolute path below /")
    fd = os.open("/", DIR_FLAGS)
    shown = ""
    for i, name in enumerate(parts):
        shown += "/" + name
        leaf = i == len(parts) - 1
        created = False
        try:
            os.mkdir(name, 0o700, dir_fd=fd)
            created = True
        except FileExistsError:
            pass
        child = _open_dir(name, fd, shown)
        os.close(fd)
        fd = child
        if leaf:
            if created:
                changes.append(f"{shown}: created")
            _set(fd, shown, uid, gid, mode, changes)
        elif created:
            changes.append(f"{shown}: created")
            _set(fd, shown, 0, 0, 0o755, [])
        else:
            st = os.fstat(fd)
            if st.st_uid in reclaim[0] or st.st_gid in reclaim[1]:
                _set(fd, shown, 0, 0, 0o755, changes)
    return fd


def adopt(leaf_fd: int, shown: str, old_uid: int, uid: int, gid: int, changes: list[str]) -> None:
    count = 0
    for dirpath, _dirs, files, dir_fd in os.fwalk(".", dir_fd=leaf_fd, follow_symlinks=False):
        where = shown if dirpath == "." else f"{shown}/{dirpath[2:]}"
        if dirpath != "." and os.fstat(dir_fd).st_uid == old_uid:
            _set(dir_fd, where, uid, gid, 0o755, [])
            count += 1
        for name in files:
            try:
                listed = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(listed.st_mode) or listed.st_uid != old_uid:
                continue
            try:
                fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino) or st.st_uid != old_uid:
                    continue
                _set(fd, f"{where}/{name}", uid, gid, (stat.S_IMODE(st.st_mode) & 0o755) | 0o644, [])
                count += 1
            finally:
                os.close(fd)
    if count:
        changes.append(f"{shown}: {count} entries re-owned from uid {old_uid} to {uid}:{gid}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True)
    p.add_argument("--owner", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--mode", required=True, help="octal, e.g. 755")
    p.add_argument("--reclaim", action="append", default=[], help="a user whose intermediate folders go back to root")
    p.add_argument("--adopt-from", help="re-own what this user owns below the leaf")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("own_dir.py: needs root", file=sys.stderr)
        return NEED_ROOT
    uid = pwd.getpwnam(args.owner).pw_uid
    gid = grp.getgrnam(args.group).gr_gid
    # A reclaimed user's folders, and folders of its own group (an earlier layout set both).
    uids, gids = set(), set()
    for name in args.reclaim:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            pass
        try:
            gids.add(grp.getgrnam(name).gr_gid)
        except KeyError:
            pass
    uids.discard(0)
    gids.discard(0)
    changes: list[str] = []
    try:
        fd = ensure(args.path, uid, gid, int(args.mode, 8), (uids, gids), changes)
    except Refused as exc:
        print(f"own_dir.py: {exc}", file=sys.stderr)
        return REFUSED
    try:
        if args.adopt_from:
            try:
                old_uid = pwd.getpwnam(args.adopt_from).pw_uid
            except KeyError:
                old_uid = None
            if old_uid is not None and old_uid not in (0, uid):
                adopt(fd, args.path, old_uid, uid, gid, changes)
    finally:
        os.close(fd)
    for line in changes:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
