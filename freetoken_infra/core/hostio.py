"""What the host-side scripts share that is not a schema: writing a file whole, byte counts for
people, and root's reads and writes of the owner's Windows files without following a link.

Standard library only: uploaded beside ``fetch_model.py``, ``guard.py`` and ``windows_file.py``
under ``/usr/local/lib/freetoken/`` (``layout.HOSTIO_MODULE``) and imported from their own
folder, as ``manifest.py`` is; the controller imports it from here (the download's progress
lines), and the facts that read a Windows-side file run its source with ``python3 -c``
(``read_report``: a fact runs before anything is uploaded).

Windows-side files: under DrvFs' default mount options every file below the
drive root (``/mnt/c/Users/dev``, its Desktop) is 0777 and owned by uid 1000, so every Linux
account (the engine's user too) can plant a link, a FIFO or a huge file there. ``read_folder``
and ``write_below`` walk the path from ``/`` one folder at a time with
``O_DIRECTORY | O_NOFOLLOW`` descriptors: a link at any component is refused, never followed; a
file is read only when it is a regular file (``lstat``, then ``O_NOFOLLOW | O_NONBLOCK`` and
``fstat`` of what was opened) no larger than its cap; a write creates a new file with a random
name (``O_CREAT | O_EXCL | O_NOFOLLOW``) in the folder it holds open and renames it over the
name, which replaces a link itself and never writes through it.

The model folder: ``model_dir`` is written by the download's user, which talks
to the hub. Root reads its ``config.json``, ``hf_quant_config.json`` and the manifest the same
way (``read_folder``, at most ``MODEL_FILE_CAP`` bytes each), and the verify suite hashes its
files through ``open_below``: a link, FIFO, socket, device or folder where a file should be is
refused in one line naming the path, never read.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import stat
import tempfile
from typing import Any


def write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` through a temporary file in its folder, synced, then renamed over it:
    readers never see half a file, and a crash leaves the old one. World-readable (0644); the
    temporary name (``.NAME.*.tmp``) is one no reader of the folder takes for the file."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def human_bytes(n: float) -> str:
    """``512 B``, ``1.5 MB``, ``22.0 GB`` (decimal units, as disks and the hub count)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n} B"


# --------------------------------------------------------------------------- Windows-side files

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
WINDOWS_FILE_CAP = 64 * 1024  # .wslconfig and the Desktop shortcuts are a few hundred bytes
# config.json, hf_quant_config.json and the manifest: a few KiB to a few hundred KiB (a long
# per-layer exclusion list); anything larger is no file the downloader wrote.
MODEL_FILE_CAP = 8 * 1024 * 1024
READ_MARKER = "@@ft:read "


class Refused(Exception):
    """A path root does not read or write through; ``kind``: ``link``, ``fifo``, ``socket``,
    ``device``, ``folder``, ``file`` (a folder expected), ``size``, ``path`` or ``error``."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def _what(mode: int) -> tuple[str, str]:
    if stat.S_ISLNK(mode):
        return "a symbolic link", "link"
    if stat.S_ISFIFO(mode):
        return "a FIFO", "fifo"
    if stat.S_ISSOCK(mode):
        return "a socket", "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device", "device"
    if stat.S_ISDIR(mode):
        return "a folder", "folder"
    if stat.S_ISREG(mode):
        return "a file", "file"
    return "not a regular file", "device"


def _what_failed(name: str, dir_fd: int, shown: str, error: OSError) -> tuple[str, str]:
    """What ``name`` in ``dir_fd`` is (``_what``), after opening it as a folder failed with
    ``error``; Refused (``shown``: the path as the user reads it) when even that cannot be told."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        raise Refused(f"{shown}: {error.strerror}", "error") from None
    return _what(st.st_mode)


def size_text(n: int) -> str:
    """``5.0 MiB``, ``70000 bytes``, ``64 KiB`` (binary units, as the cap is)."""
    if n >= 1024**2:
        return f"{n / 1024**2:.1f} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} bytes"


def open_folder(path: str) -> int:
    """A descriptor of the folder ``path``, walked from ``/`` without following a link: each
    component is opened ``O_DIRECTORY | O_NOFOLLOW`` relative to the one before. Raises
    ``FileNotFoundError`` when a component is missing, ``Refused`` when one is a link or not a
    folder."""
    parts = [p for p in path.split("/") if p]
    if not path.startswith("/") or any(p in (".", "..") for p in parts):
        raise Refused(f"{path!r} is not a normalised absolute path", "path")
    fd = os.open("/", DIR_FLAGS)
    shown = ""
    try:
        for name in parts:
            shown += "/" + name
            try:
                child = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError as exc:
                what, kind = _what_failed(name, fd, shown, exc)
                if kind == "folder":
                    raise Refused(f"{shown}: {exc.strerror}", "error") from None
                raise Refused(f"{shown} is {what}, not a folder", "file" if kind == "file" else kind) from None
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _refuse_unless_regular(mode: int, size: int, shown: str, cap: float) -> None:
    what, kind = _what(mode)
    if kind != "file":
        raise Refused(f"{shown} is {what}", kind)
    if size > cap:
        raise Refused(f"{shown} is {size_text(size)}, over the {size_text(int(cap))} cap", "size")


def open_regular(folder_fd: int, name: str, shown: str, cap: int | None = None) -> int | None:
    """A descriptor of the regular file ``name`` in the folder held open (None: there is none),
    opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the open) and checked again with
    ``fstat``; ``Refused`` for a link, FIFO, socket, device or folder, or a file over ``cap``
    bytes (None: no cap)."""
    limit = cap if cap is not None else float("inf")
    try:
        listed = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    _refuse_unless_regular(listed.st_mode, listed.st_size, shown, limit)
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=folder_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # swapped for a link since the lstat: ELOOP
        try:
            now = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        except OSError:
            raise Refused(f"{shown}: {exc.strerror}", "error") from None
        _refuse_unless_regular(now.st_mode, now.st_size, shown, limit)
        raise Refused(f"{shown}: {exc.strerror}", "error") from None
    try:
        st = os.fstat(fd)
        _refuse_unless_regular(st.st_mode, st.st_size, shown, limit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(folder_fd: int, name: str, shown: str, cap: int = WINDOWS_FILE_CAP) -> bytes | None:
    """The bytes of the regular file ``name`` in the folder held open (None: there is none);
    ``Refused`` for a link, FIFO, socket, device or folder, or a file over ``cap`` bytes."""
    fd = open_regular(folder_fd, name, shown, cap)
    if fd is None:
        return None
    try:
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, cap + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > cap:  # it grew after the fstat
            raise Refused(f"{shown} is over the {size_text(cap)} cap", "size")
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_below(folder_fd: int, rel: str, shown: str) -> int | None:
    """A descriptor of the regular file at ``rel`` (``a/b/c``) below the folder held open, each
    folder on the way opened ``O_DIRECTORY | O_NOFOLLOW`` and the file as ``open_regular`` opens
    it (no cap). None: there is none; ``Refused`` for a link anywhere on the way, or a file that
    is not a regular one."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise Refused(f"{rel!r} is not a relative file name", "path")
    fd = os.dup(folder_fd)
    try:
        for part in parts[:-1]:
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                what, kind = _what_failed(part, fd, shown, exc)
                raise Refused(f"{shown}: a folder on the way is {what}", kind) from None
            os.close(fd)
            fd = child
        return open_regular(fd, parts[-1], shown)
    finally:
        os.close(fd)


def read_folder(folder: str, names: list[str], cap: int = WINDOWS_FILE_CAP) -> dict[str, Any]:
    """What ``read_report`` prints: ``{"folder": "ok", "files": {name: None | {"data": base64}
    | {"refused": why, "kind": kind}}}``, or ``{"folder": "missing"}``, or ``{"folder":
    "refused", "refused": why, "kind": kind}``."""
    try:
        fd = open_folder(folder)
    except FileNotFoundError:
        return {"folder": "missing"}
    except Refused as exc:
        return {"folder": "refused", "refused": str(exc), "kind": exc.kind}
    except OSError as exc:
        return {"folder": "refused", "refused": f"{folder}: {exc.strerror}", "kind": "error"}
    files: dict[str, Any] = {}
    try:
        for name in names:
            shown = folder.rstrip("/") + "/" + name
            if "/" in name or name in ("", ".", ".."):
                files[name] = {"refused": f"{name!r} is not a file name", "kind": "path"}
                continue
            try:
                data = read_at(fd, name, shown, cap)
            except Refused as exc:
                files[name] = {"refused": str(exc), "kind": exc.kind}
            except OSError as exc:
                files[name] = {"refused": f"{shown}: {exc.strerror}", "kind": "error"}
            else:
                files[name] = None if data is None else {"data": base64.b64encode(data).decode("ascii")}
    finally:
        os.close(fd)
    return {"folder": "ok", "files": files}


def read_report(folder: str, names: list[str], cap: int = WINDOWS_FILE_CAP) -> str:
    """One line for a fact: ``@@ft:read `` and ``read_folder``'s answer as base64 JSON (file
    names and bytes the host's users wrote travel encoded)."""
    doc = json.dumps(read_folder(folder, names, cap))
    return READ_MARKER + base64.b64encode(doc.encode("utf-8")).decode("ascii")


def write_below(path: str, data: bytes, tmp_name: str | None = None) -> None:
    """Replace the file ``path`` by ``data``: a new file with a random name (``tmp_name`` in
    tests) made ``O_CREAT | O_EXCL | O_NOFOLLOW`` in the folder held open (``open_folder``),
    synced, then renamed over the name. A link at the name is replaced, never written through;
    a link at the temporary name makes the create fail; nothing is written when a folder on
    the way is a link (``Refused``)."""
    folder, name = os.path.split(path)
    if not name or name in (".", ".."):
        raise Refused(f"{path!r} names no file", "path")
    fd = open_folder(folder or "/")
    try:
        tmp = tmp_name or f".{name}.{secrets.token_hex(8)}.tmp"
        out = os.open(tmp, WRITE_FLAGS, 0o644, dir_fd=fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
                os.fsync(out)
            finally:
                os.close(out)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise
        try:
            os.fsync(fd)
        except OSError:  # a folder's fsync is not supported everywhere (DrvFs)
            pass
    finally:
        os.close(fd)
