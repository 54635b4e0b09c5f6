"""Fact about the host's memory, CPUs and free disk: the engine keeps MoE experts in system RAM
(``--moe-strategy offload``), and models are tens of GB."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase

from ._declare import BOOT_ONLY, PATH
from ._output import parse_int, quote, section_map


@dataclass(frozen=True)
class ResourcesInfo:
    mem_total_bytes: int
    mem_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    cpus: int
    disk_path: str
    disk_free_bytes: int | None
    # The existing ancestor of disk_path that df was run on, and its mount point.
    disk_checked_path: str | None = None
    disk_mount: str | None = None


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per key (``MemTotal: 24567892 kB`` -> 25157521408)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"(\w[\w()]*):\s+(\d+)(?:\s+kB)?\s*$", line)
        if match:
            factor = 1024 if line.rstrip().endswith("kB") else 1
            values[match.group(1)] = int(match.group(2)) * factor
    return values


def parse_df(text: str) -> tuple[int | None, str | None]:
    """``df -Pk`` data line -> (available bytes, mount point)."""
    for line in text.splitlines()[1:]:
        match = re.match(r"^(.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)%\s+(/.*)$", line)
        if match:
            return int(match.group(4)) * 1024, match.group(6)
    return None, None


def parse_resources_output(path: str, lines: list[str]) -> ResourcesInfo:
    secs = section_map(lines)
    mem = parse_meminfo("\n".join(secs.get("meminfo", ("", []))[1]))
    available = mem.get("MemAvailable")
    if available is None:
        available = mem.get("MemFree", 0) + mem.get("Buffers", 0) + mem.get("Cached", 0)
    nproc_lines = secs.get("nproc", ("", []))[1]
    cpus = parse_int(nproc_lines[0]) if nproc_lines else None
    checked = secs.get("df", ("", []))[0] or None
    free, mount = parse_df("\n".join(secs.get("df", ("", []))[1]))
    return ResourcesInfo(
        mem_total_bytes=mem.get("MemTotal", 0),
        mem_available_bytes=available,
        swap_total_bytes=mem.get("SwapTotal", 0),
        swap_used_bytes=max(0, mem.get("SwapTotal", 0) - mem.get("SwapFree", 0)),
        cpus=cpus or 0,
        disk_path=path or (secs.get("path", ("", []))[0]),
        disk_free_bytes=free,
        disk_checked_path=checked,
        disk_mount=mount,
    )


class HostResources(FactBase[ResourcesInfo]):
    """
    Returns ``ResourcesInfo``: RAM and swap from ``/proc/meminfo``, CPUs (``nproc``), and the
    free space of the file system that holds ``path`` (or would hold it: the nearest existing
    ancestor is measured).

    + path: where models / engines will be stored
    """

    argument_shapes = {"path": PATH}
    # Memory, cores and the model disk's free space: the preflight's findings only, which the
    # no-op run does not repeat (the doctor does).
    fast_check_inputs = BOOT_ONLY

    def command(self, path: str) -> str:
        self._path = path
        return (
            f'P={quote(path)}; echo "@@ft:path $P"; '
            "echo '@@ft:meminfo'; cat /proc/meminfo 2>/dev/null; "
            "echo '@@ft:nproc'; nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null; "
            'D=$P; while [ ! -e "$D" ] && [ "$D" != / ] && [ "$D" != . ]; do D=$(dirname "$D"); done; '
            'echo "@@ft:df $D"; df -Pk "$D" 2>&1; true'
        )

    @staticmethod
    def default() -> ResourcesInfo:
        return ResourcesInfo(0, 0, 0, 0, 0, "", None)

    def process(self, output: list[str]) -> ResourcesInfo:
        return parse_resources_output(getattr(self, "_path", ""), output)
