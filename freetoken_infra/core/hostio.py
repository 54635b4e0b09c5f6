"""What the host-side scripts share that is not a schema: writing a file whole, and byte counts
for people.

Standard library only: uploaded beside ``fetch_model.py`` and ``guard.py`` under
``/usr/local/lib/freetoken/`` (``layout.HOSTIO_MODULE``) and imported from their own folder, as
``manifest.py`` is; the controller imports it from here (the download's progress lines).
"""

from __future__ import annotations

import os
import tempfile


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
