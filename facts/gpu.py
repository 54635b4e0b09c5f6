"""Fact about the NVIDIA GPUs visible to the target, through ``nvidia-smi``.

Under WSL, ``nvidia-smi`` and ``libcuda.so.1`` come from the Windows driver and live in
``/usr/lib/wsl/lib`` (often not on PATH); ``driver_version`` is the Windows driver's number.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass

from pyinfra.api import FactBase

from ._declare import BOOT_ONLY
from ._output import b64decode_lines, parse_int, section_map

WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
QUERY_FIELDS = "index,name,compute_cap,memory.total,memory.used,memory.free,driver_version"

# Values nvidia-smi prints where NVML cannot answer (partial NVML under WSL).
_UNAVAILABLE = {"[n/a]", "n/a", "[not supported]", "[unknown error]", "[insufficient permissions]", ""}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    compute_cap: tuple[int, int] | None
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    driver_version: str
    # Query fields nvidia-smi could not answer ("[N/A]", "[Not Supported]"): their int value is 0.
    unavailable_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuProcess:
    """One row of the plain table's "Processes:" section (the name is the host's text)."""

    gpu: int | None  # None from --query-compute-apps, which does not say which GPU
    pid: int
    name: str  # the host's text, made safe to print (``safe_process_name``)
    used_mib: int | None  # None where the table says N/A


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[GpuInfo, ...]
    cuda_version: str | None
    smi_path: str | None
    error: str | None
    # The table header's driver version ("Driver Version:", or "KMD Version:" from the 600s on).
    driver_version: str | None = None
    # The table's "Processes:" rows. Under WSL they stay empty while Windows' apps hold memory
    # (microsoft/WSL#7162): an empty list says nothing about who holds the card.
    processes: tuple[GpuProcess, ...] = ()
    # ``--query-compute-apps``: the compute processes with their whole names (the table cuts them),
    # all GPUs together (its ``gpu`` is None); also empty under WSL. None: not asked or unreadable.
    compute_apps: tuple[GpuProcess, ...] | None = None


def _unavailable(value: str) -> bool:
    return value.strip().lower() in _UNAVAILABLE


def _mib(value: str) -> int | None:
    match = re.fullmatch(r"\s*(\d+)(?:\s*MiB)?\s*", value)
    return int(match.group(1)) if match else None


def parse_query_csv(text: str) -> tuple[tuple[GpuInfo, ...], str | None]:
    """Parse ``--query-gpu=QUERY_FIELDS --format=csv[,noheader][,nounits]`` output.

    Returns ``(gpus, error)``; error is the tool's message when a line is not a GPU row
    (e.g. ``No devices were found``, NVML initialisation failures).
    """
    gpus: list[GpuInfo] = []
    problems: list[str] = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        row = [cell.strip() for cell in row]
        if not row or not any(row):
            continue
        if row[0].lower() == "index":
            continue  # header line of --format=csv without noheader
        if len(row) != 7 or parse_int(row[0]) is None:
            problems.append(", ".join(row))
            continue
        index, name, cap, total, used, free, driver = row
        unavailable: list[str] = []
        compute_cap = None
        if _unavailable(cap):
            unavailable.append("compute_cap")
        else:
            match = re.fullmatch(r"(\d+)\.(\d+)", cap)
            if match:
                compute_cap = (int(match.group(1)), int(match.group(2)))
            else:
                unavailable.append("compute_cap")
        mems: list[int] = []
        for field_name, value in (("memory.total", total), ("memory.used", used), ("memory.free", free)):
            number = None if _unavailable(value) else _mib(value)
            if number is None:
                unavailable.append(field_name)
            mems.append(number or 0)
        if _unavailable(driver):
            unavailable.append("driver_version")
            driver = ""
        gpus.append(
            GpuInfo(
                index=int(index),
                name=name,
                compute_cap=compute_cap,
                memory_total_mib=mems[0],
                memory_used_mib=mems[1],
                memory_free_mib=mems[2],
                driver_version=driver,
                unavailable_fields=tuple(unavailable),
            )
        )
    error = None
    if problems and not gpus:
        error = " ".join(problems)[:500]
    elif not gpus:
        error = "nvidia-smi listed no GPUs"
    return tuple(gpus), error


# The plain table's header: "NVIDIA-SMI 580.82.10   Driver Version: 581.29   CUDA Version: 13.0"; from
# the 600 series on "KMD Version: 610.43.02   CUDA UMD Version: 13.3" (nvidia-smi docs: Driver
# Version and CUDA Version deprecated in favour of KMD Version and CUDA UMD Version).
_CUDA_RE = re.compile(r"CUDA (?:UMD )?Version:\s*(\d+(?:\.\d+)*)")
_DRIVER_RE = re.compile(r"(?:Driver|KMD) Version:\s*(\d+(?:\.\d+)*)")
# A GPU's first two rows in the table: "|   0  NVIDIA GeForce RTX 4090   On  | ..." then
# "|  0%   38C    P8   16W / 450W |   1528MiB / 24564MiB | ...".
_TABLE_GPU_RE = re.compile(r"^\s*\|\s+(\d+)\s+(.+?)\s+(?:On|Off|WDDM|TCC)\s+\|")
_TABLE_MEM_RE = re.compile(r"\|\s*(\d+)MiB\s*/\s*(\d+)MiB\s*\|")


# A row of the "Processes:" section, 535 and later columns (GPU, GI, CI, PID, Type, name, memory):
# "|    0   N/A  N/A             821      C   python3                               21090MiB |".
_TABLE_PROCESS_RE = re.compile(
    r"^\|\s+(\d+)\s+\S+\s+\S+\s+(\d+)\s+(?:C\+G|M\+C|[CGM])\s+(.+?)\s+(?:(\d+)MiB|N/A)\s*\|$"
)


@dataclass(frozen=True)
class TableGpu:
    """A GPU as the plain table shows it (names longer than the column end in ``...``)."""

    index: int
    name: str
    memory_used_mib: int | None
    memory_total_mib: int | None


def parse_cuda_version(table: str) -> str | None:
    """The driver's CUDA version from the plain ``nvidia-smi`` table header (either label)."""
    match = _CUDA_RE.search(table)
    return match.group(1) if match else None


def parse_driver_version(table: str) -> str | None:
    """The driver version from the table header (``Driver Version:`` or ``KMD Version:``)."""
    match = _DRIVER_RE.search(table)
    return match.group(1) if match else None


def parse_table_gpus(table: str) -> tuple[TableGpu, ...]:
    """Each GPU row of the plain table with the memory on the row below it."""
    lines = table.splitlines()
    gpus: list[TableGpu] = []
    for number, line in enumerate(lines):
        match = _TABLE_GPU_RE.match(line)
        if not match:
            continue
        memory = _TABLE_MEM_RE.search(lines[number + 1]) if number + 1 < len(lines) else None
        gpus.append(
            TableGpu(
                int(match.group(1)),
                match.group(2).strip(),
                int(memory.group(1)) if memory else None,
                int(memory.group(2)) if memory else None,
            )
        )
    return tuple(gpus)


def parse_table_processes(table: str) -> tuple[GpuProcess, ...]:
    """The rows below the table's ``Processes:`` heading (none: "No running processes found")."""
    _, heading, rest = table.partition("| Processes:")
    if not heading:
        return ()
    found = []
    for line in rest.splitlines():
        match = _TABLE_PROCESS_RE.match(line.rstrip())
        if match:
            gpu, pid, name, used = match.groups()
            found.append(GpuProcess(int(gpu), int(pid), safe_process_name(name), int(used) if used else None))
    return tuple(found[:MAX_PROCESSES])


# A process's name is whatever that process (any user's, the engine's too) chose: any bytes but
# NUL, newlines and terminal escapes included. It is only ever shown, never run or used as a path;
# shown, it is printable ASCII only (anything else a "?") and at most this long.
MAX_PROCESS_NAME = 80
MAX_PROCESSES = 32  # more rows than any workstation has: the rest are not read
_PRINTABLE = re.compile(r"[^\x20-\x7e]")
_APP_PID = re.compile(r"[0-9]{1,10}")
_APP_MEMORY = re.compile(r"([0-9]{1,9})(?: MiB)?")


def safe_process_name(name: str) -> str:
    shown = _PRINTABLE.sub("?", name.strip())
    if len(shown) > MAX_PROCESS_NAME:
        shown = shown[: MAX_PROCESS_NAME - 3] + "..."
    return shown or "?"


def parse_compute_apps(text: str) -> tuple[GpuProcess, ...]:
    """Parse ``--query-compute-apps=pid,process_name,used_memory --format=csv,noheader[,nounits]``.

    Strict: a row is a pid of digits, then the name, then MiB of digits (or N/A), split at the
    first and the last comma (a name may hold commas); anything else (the header, "No running
    processes found", an error) is not a row. The name is made safe to print."""
    found: list[GpuProcess] = []
    for line in text.splitlines():
        first, _, rest = line.partition(",")
        name, comma, last = rest.rpartition(",")
        pid, used = first.strip(), last.strip()
        if not comma or not _APP_PID.fullmatch(pid) or int(pid) == 0:
            continue
        memory = _APP_MEMORY.fullmatch(used)
        if memory is None and not _unavailable(used):
            continue
        found.append(GpuProcess(None, int(pid), safe_process_name(name), int(memory.group(1)) if memory else None))
        if len(found) == MAX_PROCESSES:
            break
    return tuple(found)


def parse_nvidia_smi_output(lines: list[str]) -> GpuReport:
    secs = section_map(lines)
    if "missing" in secs:
        return GpuReport((), None, None, "nvidia-smi not found")
    smi_path = secs.get("path", ("", []))[0] or None
    query_rc = parse_int(secs.get("query-rc", ("", []))[0])
    query = "\n".join(line.rstrip("\r") for line in secs.get("query", ("", []))[1])
    table = "\n".join(line.rstrip("\r") for line in secs.get("table", ("", []))[1])
    if "table64" in secs:  # the table travels base64-encoded: its process names are any process's text
        table = _decoded(secs["table64"][1]) or ""
    apps = None
    if "apps64" in secs and parse_int(secs.get("apps-rc", ("", []))[0]) == 0:
        decoded = _decoded(secs["apps64"][1])
        apps = parse_compute_apps(decoded) if decoded is not None else None
    gpus, error = parse_query_csv(query)
    if error and query_rc not in (0, None):
        error = f"{error} (exit {query_rc})"
    return GpuReport(
        gpus,
        parse_cuda_version(table),
        smi_path,
        error,
        parse_driver_version(table),
        parse_table_processes(table),
        apps,
    )


def _decoded(lines: list[str]) -> str | None:
    data = b64decode_lines(lines)
    return None if data is None else data.decode("utf-8", "replace").replace("\r", "")


class NvidiaGpus(FactBase[GpuReport]):
    """
    Returns ``GpuReport``: each GPU's name, compute capability and memory, the driver's CUDA
    version, or the error nvidia-smi printed (no driver, no device, GPU access blocked).
    """

    # The GPU's answer: a new GPU or driver needs a restart of the WSL VM.
    fast_check_inputs = BOOT_ONLY

    def command(self) -> str:
        return (
            "S=$(command -v nvidia-smi 2>/dev/null); "
            f'if [ -z "$S" ] && [ -x {WSL_NVIDIA_SMI} ]; then S={WSL_NVIDIA_SMI}; fi; '
            "if [ -z \"$S\" ]; then echo '@@ft:missing'; else "
            "echo \"@@ft:path $S\"; echo '@@ft:query'; "
            f'"$S" --query-gpu={QUERY_FIELDS} --format=csv,noheader,nounits 2>&1 </dev/null; '
            'echo "@@ft:query-rc $?"; '
            # The table and the compute apps name processes, whose names are theirs to choose
            # (newlines, "@@ft:" lines): both travel base64-encoded, out of the markers' reach.
            "echo '@@ft:table64'; T=$(\"$S\" 2>&1 </dev/null); R=$?; printf '%s\\n' \"$T\" | base64; "
            'echo "@@ft:table-rc $R"; '
            "echo '@@ft:apps64'; "
            'A=$("$S" --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits 2>&1 </dev/null); '
            'R=$?; printf \'%s\\n\' "$A" | base64; echo "@@ft:apps-rc $R"; fi; true'
        )

    @staticmethod
    def default() -> GpuReport:
        return GpuReport((), None, None, "no output")

    def process(self, output: list[str]) -> GpuReport:
        return parse_nvidia_smi_output(output)
