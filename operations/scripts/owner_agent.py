#!/usr/bin/python3
"""FreeToken host agent (``freetoken-agent.service``, as root) and the owner's command
(``freetoken-owner``).

``serve``: once a second it looks at the host (the card's used memory from ``nvidia-smi``, the
engine unit's state, the engine's own ``/v1/stats`` VRAM and ``/health``, the owner's snooze)
and lets ``owner.step`` decide (``freetoken_infra/core/owner.py``, uploaded beside this script).
When the owner claims the GPU it reports ``drain`` to the gateway, lets running streams finish
(FreeToken's ``POST /v1/admin/prepare-stop`` on loopback, bounded), stops the engine (its VRAM
is free) and records why in root's state file; once the claim has been gone for
``--quiet-s`` it starts the engine and reports ``ready`` after ``/health`` is ok.

The agent-check port (HAProxy's ``agent-check``) answers one of three fixed lines (``owner
.agent_word``) to every connection and closes it: it reads nothing a client sends.

Trust: root, because it stops and starts the engine (like the guard). It writes only its own
runtime folder (``--state-file``, ``/run/freetoken-agent``) and its samples in node_exporter's
textfile folder (``--textfile``, root's, beside the guard's), and the owner's command writes only
root's state folder (``--override-file``, ``/var/lib/freetoken-deploy``); the agent reads
the engine's key from root's 0600 file and sends it in a header (never an argument), runs only
fixed argument lists (``systemctl``, ``nvidia-smi``, ``nft``), and takes nothing from the engine's
answers but a status word and a few numbers, each checked for its type.

Windows, through interop, from a thread every ``--windows-interval-s``
(each interop start costs about half a second): ``tasklist.exe /fo csv /nh`` when ``--app``
names are set, PowerShell's call of shell32's ``SHQueryUserNotificationState`` with
``--fullscreen``, and ``reg.exe query`` of Windows Update's two reboot flags (every
``REBOOT_EVERY_S``). Root runs them only from their fixed paths under ``--system32`` (System32
under the drive root the deploy read from wsl.conf), with fixed arguments, never from PATH; what
they print is parsed strictly (``owner.parse_tasklist``, ``parse_notification_state``,
``reboot_flag``) and only compared: an app counts when its image name equals a listed one.

Metrics (``--textfile``, node_exporter's textfile collector folder): after each round the agent's
mode, the owner's reason, its signals, the engine's counters from ``/v1/stats``, the card's power
and memory (NVML) and whether the firewall's table is live (``nft``, once a minute), rendered by
``agent_metrics.render`` (uploaded beside this script) and written atomically: at once when the
mode, reason, a signal or the firewall changes, else every ``METRICS_EVERY_S``.

``owner snooze 2h | resume | status``: the owner's override (snooze and resume as root).

Runs on the target with the system python3: the standard library and the core modules uploaded
beside it (``owner.py``, ``agent_metrics.py``, ``hostio.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/agent_metrics.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import agent_metrics, hostio, owner
else:
    import agent_metrics
    import hostio
    import owner

PREFIX = "freetoken-agent:"
# nvidia-smi is not on systemd's PATH inside WSL: the Windows driver provides it here.
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
KEY_VAR = "FREETOKEN_API_KEY"
# The most the engine's prepare-stop waits for running streams (its own bound: 10 s).
PREPARE_STOP_MAX_S = 10.0
# Windows Update's flags change rarely: read every minute, not every round.
REBOOT_EVERY_S = 60.0
# NVML, the library nvidia-smi itself reads: WSL's driver folder first, then the loader's path.
NVML_LIBS = ("/usr/lib/wsl/lib/libnvidia-ml.so.1", "libnvidia-ml.so.1")
NVML_RETRY_S = 60.0
# One total deadline (wall clock) for each Windows program the agent runs: a program that hangs
# (Windows locked, microsoft/WSL#7001) or prints forever is killed with its whole group then.
WINDOWS_TIMEOUT_S = 20.0
# The most of a Windows program's stdout and stderr kept (the rest is read and dropped).
WINDOWS_OUTPUT_MAX = 1 << 20
# Each read of the engine (untrusted: it parses LAN requests) has one total deadline, wall clock
# over connect, headers and body; an answer older than ENGINE_FRESH_S is no answer ("unknown").
ENGINE_DEADLINE_S = 2.0
ENGINE_FRESH_S = 3.0
ANSWER_MAX = 65536
# The engine unit's state is read with systemctl at least this often (UnitState).
UNIT_EVERY_S = 10.0
# The samples for node_exporter (--textfile) are written at once when the mode, the reason, a
# signal or the firewall changes, else this often (the loop's time, counters, power and memory):
# a render and an atomic write every few seconds, not every round.
METRICS_EVERY_S = 5.0
# The live firewall table is listed (`nft`, a process start) this often.
FIREWALL_EVERY_S = 60.0
FIREWALL_TABLE = ("inet", "freetoken")  # layout.FIREWALL_TABLE, as operations/firewall.py loads it
FIREWALL_TIMEOUT_S = 5.0


def log(message: str) -> None:
    print(f"{PREFIX} {message}", flush=True)


# --------------------------------------------------------------------------- observing
def find_nvidia_smi() -> str | None:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return WSL_NVIDIA_SMI if os.access(WSL_NVIDIA_SMI, os.X_OK) else None


def gpu_used_mib() -> int | None:
    """The first GPU's used memory (MiB), or None when nvidia-smi is missing or unreadable."""
    binary = find_nvidia_smi()
    if binary is None:
        return None
    try:
        out = subprocess.run(
            [binary, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        first = out.strip().splitlines()[0].strip()
        return int(first) if first.isdigit() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


class GpuReading(NamedTuple):
    """One read of the first GPU's memory, in bytes; the total None where the source does not say."""

    used_bytes: int
    total_bytes: int | None = None


class _NvmlMemory(ctypes.Structure):
    """nvml.h's nvmlMemory_t: bytes."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class Nvml:
    """The first GPU's memory through NVML in this process (``libnvidia-ml.so.1`` by ctypes; under
    WSL the Windows driver maps it into ``/usr/lib/wsl/lib``): a few microseconds a read, where
    an ``nvidia-smi`` process costs tens of milliseconds of CPU. OSError when the library is
    missing or does not initialise."""

    def __init__(self, paths: tuple[str, ...] = NVML_LIBS):
        lib = None
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
                break
            except OSError:
                continue
        if lib is None:
            raise OSError("libnvidia-ml.so.1 not found")
        try:
            lib.nvmlInit_v2.restype = ctypes.c_int
            lib.nvmlDeviceGetHandleByIndex_v2.restype = ctypes.c_int
            lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
            lib.nvmlDeviceGetMemoryInfo.restype = ctypes.c_int
            lib.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(_NvmlMemory)]
            lib.nvmlShutdown.restype = ctypes.c_int
        except AttributeError as exc:  # not NVML
            raise OSError(f"not NVML: {exc}") from None
        # The power draw is only a metric: a library without it still reads memory.
        self.power_usage = getattr(lib, "nvmlDeviceGetPowerUsage", None)
        if self.power_usage is not None:
            self.power_usage.restype = ctypes.c_int
            self.power_usage.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint)]
        if (rc := lib.nvmlInit_v2()) != 0:
            raise OSError(f"nvmlInit_v2 returned {rc}")
        handle = ctypes.c_void_p()
        if (rc := lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))) != 0:
            lib.nvmlShutdown()
            raise OSError(f"nvmlDeviceGetHandleByIndex_v2 returned {rc}")
        self.lib, self.handle = lib, handle

    def read(self) -> GpuReading | None:
        """Used and total memory."""
        memory = _NvmlMemory()
        if self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(memory)) != 0:
            return None
        return GpuReading(memory.used, memory.total)

    def power_watts(self) -> float | None:
        """The draw (``nvmlDeviceGetPowerUsage``: milliwatts), or None where the card or driver
        does not report it."""
        if self.power_usage is None:
            return None
        milliwatts = ctypes.c_uint()
        if self.power_usage(self.handle, ctypes.byref(milliwatts)) != 0:
            return None
        return milliwatts.value / 1000.0

    def used_mib(self) -> int | None:
        reading = self.read()
        return None if reading is None else reading.used_bytes // 2**20

    def close(self) -> None:
        self.lib.nvmlShutdown()


class GpuMemory:
    """The card's used memory (MiB): NVML in-process (``Nvml``), else the ``nvidia-smi`` process
    (``gpu_used_mib``) when the library is missing or errs; NVML is tried again every
    ``NVML_RETRY_S``. Each change of source is logged once. ``reading``: the last read whole
    (the total through NVML only), and ``power_watts``, for the agent's metrics."""

    def __init__(self, paths: tuple[str, ...] = NVML_LIBS, fallback=None, clock=time.monotonic):
        self.paths, self.clock = paths, clock
        self.fallback = fallback if fallback is not None else gpu_used_mib
        self.nvml: Nvml | None = None
        self.tried: float | None = None
        self.source = ""
        self.reading: GpuReading | None = None

    def _say(self, source: str) -> None:
        if source != self.source:
            log(f"GPU memory read {source}")
            self.source = source

    def used_mib(self) -> int | None:
        now = self.clock()
        if self.nvml is None and self.paths and (self.tried is None or now - self.tried >= NVML_RETRY_S):
            self.tried = now
            try:
                self.nvml = Nvml(self.paths)
            except OSError as exc:
                self._say(f"from nvidia-smi (NVML: {exc})")
        if self.nvml is not None:
            reading = self.nvml.read()
            if reading is not None:
                self._say("through NVML")
                self.reading = reading
                return reading.used_bytes // 2**20
            self.nvml.close()
            self.nvml = None
            self._say("from nvidia-smi (NVML: nvmlDeviceGetMemoryInfo failed)")
        used = self.fallback()
        self.reading = GpuReading(used * 2**20) if isinstance(used, int) else None
        return used

    def power_watts(self) -> float | None:
        """The card's draw through NVML, read only when asked (the metrics' writes); None without
        NVML."""
        return self.nvml.power_watts() if self.nvml is not None else None


def engine_active(unit: str) -> bool:
    run = subprocess.run(["systemctl", "is-active", "--quiet", unit], timeout=30, check=False)
    return run.returncode == 0


class UnitState:
    """The engine unit's state, read with ``systemctl is-active`` (a process start, a few ms of
    CPU) only when it may have changed: every ``every_s``, after the agent's own start or stop
    (``forget``), and as soon as the engine's HTTP port starts or stops answering (an engine that
    stopped or crashed stops answering at once; one that the operator started is seen within
    ``every_s``). Not once a second: that alone cost the owner more than the rest of the agent."""

    def __init__(self, unit: str, every_s: float = UNIT_EVERY_S, read=engine_active):
        self.unit, self.every_s, self.read = unit, every_s, read
        self.known: bool | None = None
        self.read_at = 0.0
        self.answered: bool | None = None

    def forget(self) -> None:
        self.known = None

    def active(self, now: float, answered: bool | None) -> bool:
        flipped = answered is not None and self.answered is not None and answered != self.answered
        if answered is not None:
            self.answered = answered
        if self.known is None or flipped or now - self.read_at >= self.every_s:
            self.known = self.read(self.unit)
            self.read_at = now
        return self.known


def read_key(path: str) -> str | None:
    """The engine's key from root's environment file (``FREETOKEN_API_KEY=...``), or None."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, sep, value = line.strip().partition("=")
                if sep and name == KEY_VAR and value:
                    return value.strip().strip("'\"")
    except OSError:
        return None
    return None


def _left(end: float, clock) -> float:
    left = end - clock()
    if left <= 0:
        raise TimeoutError("the engine's answer ran past its deadline")
    return left


def _body(head: bytes, rest: bytes, eof: bool) -> bytes | None:
    """The body of an answer whose headers are ``head``, once all of it is in ``rest`` (None:
    not yet). Content-Length, chunked, or up to the end of the connection."""
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                raise ValueError("content-length")
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value:
            chunked = True
    if chunked:
        out, at = bytearray(), 0
        while True:
            eol = rest.find(b"\r\n", at)
            if eol < 0:
                return None if not eof else b""
            size = int(rest[at:eol].split(b";")[0].strip() or b"x", 16)
            if size == 0:
                return bytes(out)
            if len(rest) < eol + 2 + size + 2:
                return None if not eof else b""
            out += rest[eol + 2 : eol + 2 + size]
            at = eol + 2 + size + 2
    if length is not None:
        return rest[:length] if len(rest) >= length else (None if not eof else b"")
    return rest if eof else None


def http_json(
    url: str,
    key: str | None = None,
    body: dict | None = None,
    deadline_s: float = ENGINE_DEADLINE_S,
    clock=time.monotonic,
) -> dict | None:
    """One request to the engine (untrusted) and its JSON object, or None for no answer. ONE
    total deadline, wall clock over the connect, the request, the headers and the body: an
    engine that drips its answer a byte at a time is cut off at ``deadline_s`` (a per-read
    timeout let one such answer hold the agent for hours). At most ``ANSWER_MAX`` bytes."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    data = b"" if body is None else json.dumps(body).encode()
    lines = [
        f"{'GET' if body is None else 'POST'} {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Connection: close",
        "Accept: application/json",
    ]
    if key and key.isprintable():
        lines.append(f"Authorization: Bearer {key}")
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(data)}"]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + data
    end = clock() + deadline_s
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=_left(end, clock)) as sock:
            sock.settimeout(_left(end, clock))
            sock.sendall(request)
            got = bytearray()
            answer = None
            while answer is None:
                sock.settimeout(_left(end, clock))
                chunk = sock.recv(65536)
                got += chunk
                if len(got) > ANSWER_MAX:
                    return None
                head, sep, rest = bytes(got).partition(b"\r\n\r\n")
                if sep:
                    answer = _body(head, rest, eof=not chunk)
                elif not chunk:
                    return None
            status = head.split(b"\r\n", 1)[0].split()
            if len(status) < 2 or not status[0].startswith(b"HTTP/") or not status[1].isdigit():
                return None
            doc = json.loads(answer)
    except (OSError, ValueError):  # TimeoutError is an OSError
        return None
    return doc if isinstance(doc, dict) else None


def vram_from_stats(doc: dict | None) -> int | None:
    """``/v1/stats``' ``vram_bytes`` in MiB, or None (0: not loaded yet, what it will hold is
    unknown). The figure is the engine's word only: ``owner.engine_share_mib`` bounds it by the
    card."""
    vram = doc.get("vram_bytes") if doc else None
    if isinstance(vram, bool) or not isinstance(vram, int) or vram <= 0:
        return None
    return vram // 2**20


def counters_from_stats(doc: dict | None) -> tuple[int | None, int | None]:
    """``/v1/stats``' ``requests.completed`` and ``requests.completion_tokens_total`` (FreeToken
    0.2.1's ``build_stats``), each None unless a non-negative integer: only metrics, never a
    decision."""
    requests = doc.get("requests") if doc else None
    if not isinstance(requests, dict):
        return None, None

    def count(value: object) -> int | None:
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    return count(requests.get("completed")), count(requests.get("completion_tokens_total"))


class EngineAnswer(NamedTuple):
    at: float  # the reader's clock when the reads ended
    answered: bool  # /health answered at all (the engine's port is open and speaks HTTP)
    health_ok: bool  # /health said "status": "ok"
    vram_mib: int | None  # /v1/stats (vram_from_stats)
    requests: int | None = None  # /v1/stats (counters_from_stats): the agent's metrics only
    generated_tokens: int | None = None


class EngineReader:
    """Reads the engine's ``/health`` and ``/v1/stats`` from a thread of its own, each read with
    one total deadline (``http_json``), and keeps the latest answer with its time. The decision
    loop takes it only while it is fresh (``fresh``): an engine that answers slowly, drips its
    answer or never answers is "unknown" to it, never a wait."""

    def __init__(
        self,
        base: str,
        key_file: str,
        interval_s: float,
        deadline_s: float = ENGINE_DEADLINE_S,
        clock=time.monotonic,
    ):
        self.base, self.key_file, self.interval_s, self.deadline_s = base, key_file, interval_s, deadline_s
        self.clock = clock
        self.lock = threading.Lock()
        self.latest: EngineAnswer | None = None
        self.published = threading.Event()  # set at each answer (tests wait on it)

    def read_once(self) -> EngineAnswer:
        health = http_json(f"{self.base}/health", None, None, self.deadline_s, self.clock)
        stats = None
        if health is not None:
            stats = http_json(f"{self.base}/v1/stats", read_key(self.key_file), None, self.deadline_s, self.clock)
        ok = health is not None and health.get("status") == "ok"
        return EngineAnswer(self.clock(), health is not None, ok, vram_from_stats(stats), *counters_from_stats(stats))

    def serve(self) -> None:
        while True:
            started = self.clock()
            try:
                answer: EngineAnswer | None = self.read_once()
            except Exception:  # never let the thread die: no answer is "unknown"
                answer = None
            with self.lock:
                if answer is not None:
                    self.latest = answer
            self.published.set()
            time.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    def fresh(self, now: float, fresh_s: float) -> EngineAnswer | None:
        """The latest answer if it is at most ``fresh_s`` old by the reader's clock, else None."""
        with self.lock:
            latest = self.latest
        return latest if latest is not None and now - latest.at <= fresh_s else None


def read_text(path: str) -> str | None:
    # Root's own folder (the deploy's state dir): no user of less trust writes there.
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(65536)
    except OSError:
        return None


# --------------------------------------------------------------------------- Windows, through interop
class Ran(NamedTuple):
    returncode: int | None  # None: it did not start, or was killed at the deadline
    stdout: bytes
    stderr: bytes
    timed_out: bool
    error: OSError | None  # the exec's error (Errno 8: no binfmt handler for .exe)


def run_bounded(argv: list[str], deadline_s: float, cwd: str, cap: int = WINDOWS_OUTPUT_MAX) -> Ran:
    """Run ``argv`` with one total deadline, in a session of its own: at the deadline its whole
    process group is killed (what it started too; ``subprocess.run(timeout=)`` kills only the
    child and then waits for pipes its children still hold). Output past ``cap`` is dropped."""
    end = time.monotonic() + deadline_s
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        return Ran(None, b"", b"", False, exc)
    assert proc.stdout is not None and proc.stderr is not None
    fd_out, fd_err = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {fd_out: bytearray(), fd_err: bytearray()}
    timed_out = False
    try:
        with selectors.DefaultSelector() as sel:
            for fd in kept:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = end - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    buf = kept[key.fd]
                    buf += chunk[: max(0, cap - len(buf))]
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
    finally:
        if proc.returncode is None:  # not reaped yet: its group id is still its own
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return Ran(None if timed_out else proc.returncode, bytes(kept[fd_out]), bytes(kept[fd_err]), timed_out, None)


class WindowsWatch:
    """Reads the owner's side of the PC from a thread (interop is slow): the listed apps
    running, a full-screen app, a pending reboot. Each answer it cannot read counts as no
    claim, and is logged once per change."""

    def __init__(
        self,
        system32: str | None,
        apps: tuple[str, ...],
        fullscreen: bool,
        reboot: bool,
        interval_s: float,
        reboot_interval_s: float = REBOOT_EVERY_S,
        deadline_s: float = WINDOWS_TIMEOUT_S,
    ):
        self.system32 = system32
        self.apps, self.fullscreen_wanted, self.reboot_wanted = apps, fullscreen, reboot
        self.interval_s, self.reboot_interval_s = interval_s, reboot_interval_s
        self.lock = threading.Lock()
        self.apps_running: tuple[str, ...] = ()
        self.fullscreen = False
        self.reboot_pending = False
        self._reboot_read = 0.0
        self._problems: dict[str, str | None] = {}
        self.deadline_s = deadline_s
        self.last_reason = owner.INTEROP_OK
        self.configured = tuple(
            name
            for name, on in zip(owner.WINDOWS_SIGNALS, (bool(apps), fullscreen, reboot), strict=True)
            if on and system32 is not None
        )
        self.broken: dict[str, str] = {}  # signal -> why it is off (owner.interop_reason)
        self.read_yet = False  # the signals are known once the first read is done

    @property
    def wanted(self) -> bool:
        if self.system32 is None or not (self.apps or self.fullscreen_wanted or self.reboot_wanted):
            return False
        if not os.path.isdir(self.system32):
            log(f"no Windows here ({self.system32} is not there): apps, full screen and reboots are not watched")
            with self.lock:
                self.broken = dict.fromkeys(self.configured, owner.NO_WINDOWS)
                self.read_yet = True
            return False
        return True

    def tool(self, relative: str) -> str | None:
        """A Windows program at its fixed place under System32 (never PATH), or None."""
        assert self.system32 is not None
        path = os.path.join(self.system32, relative)
        return path if os.path.isfile(path) else None

    def run(self, relative: str, args: list[str]) -> tuple[int, bytes] | None:
        """``(exit status, stdout)`` of one Windows program, or None when interop failed (the
        reason, ``owner.interop_reason``, is kept for its signal and logged once per change). An
        answer that runs but does not read is not an interop failure: its parser says so."""
        self.last_reason = owner.PROGRAM_MISSING
        path = self.tool(relative)
        if path is None:
            self.problem(relative, f"{relative} is not in {self.system32}")
            return None
        # From the C: drive: from a Linux folder Windows programs warn about UNC paths.
        drive = os.path.dirname(os.path.dirname(path if self.system32 is None else self.system32.rstrip("/")))
        ran = run_bounded([path, *args], self.deadline_s, drive if os.path.isdir(drive) else "/")
        reason = owner.interop_reason(
            ran.error, ran.returncode, ran.stdout, ran.stderr, timed_out=ran.timed_out, timeout_s=self.deadline_s
        )
        self.last_reason = reason
        if reason != owner.INTEROP_OK or ran.returncode is None:
            self.problem(relative, f"{relative}: {reason or owner.INTEROP_ERROR}")
            return None
        self.problem(relative, None)
        return ran.returncode, ran.stdout

    def problem(self, what: str, text: str | None) -> None:
        """Logged once per change of what is wrong with ``what`` (a program, or its answer)."""
        if self._problems.get(what, None) != text:
            known = what in self._problems
            self._problems[what] = text
            if text or known:
                log(f"Windows: {text}" if text else f"Windows: {what} read again")

    def read_once(self, now: float) -> None:
        apps: tuple[str, ...] = ()
        broken: dict[str, str] = {}
        if self.apps:
            out = self.run("tasklist.exe", list(owner.TASKLIST_ARGS))
            names = owner.parse_tasklist(out[1]) if out and out[0] == 0 else None
            if out is not None:
                self.problem("tasklist", None if names is not None else "tasklist.exe's answer was not understood")
            if out is None:
                broken[owner.SIG_APPS] = self.last_reason
            apps = owner.running_apps(names or set(), self.apps)
        fullscreen = False
        if self.fullscreen_wanted:
            argv = ["-NoProfile", "-NonInteractive", "-Command", owner.NOTIFICATION_SCRIPT]
            out = self.run("WindowsPowerShell/v1.0/powershell.exe", argv)
            state = owner.parse_notification_state(out[1]) if out and out[0] == 0 else None
            if out is not None:
                self.problem(
                    "notification state", None if state is not None else "the notification state was not understood"
                )
            if out is None:
                broken[owner.SIG_FULLSCREEN] = self.last_reason
            fullscreen = owner.notification_fullscreen(state)
        with self.lock:
            self.apps_running, self.fullscreen = apps, fullscreen
            self.broken = {**{k: v for k, v in self.broken.items() if k == owner.SIG_REBOOT}, **broken}
        if self.reboot_wanted and now - self._reboot_read >= self.reboot_interval_s:
            self._reboot_read = now
            flags = []
            reasons = []
            for key in owner.REBOOT_KEYS:
                out = self.run("reg.exe", ["query", key])
                flags.append(owner.reboot_flag(key, out[0], out[1]) if out else None)
                if out is None:
                    reasons.append(self.last_reason)
            understood = flags.count(None) == len(reasons)  # a program that did not run: logged by run()
            self.problem("reboot flags", None if understood else "reg.exe's answer was not understood")
            with self.lock:
                self.reboot_pending = any(f is True for f in flags)
                self.broken.pop(owner.SIG_REBOOT, None)
                if reasons:
                    self.broken[owner.SIG_REBOOT] = reasons[0]
        with self.lock:
            self.read_yet = True

    def signals(self) -> str:
        """The owner signals read now (``owner.signals_line``): VRAM, and each configured
        Windows signal unless its last read failed; "" until the first read is done."""
        with self.lock:
            if self.configured and not self.read_yet:
                return ""
            return owner.signals_line(self.configured, dict(self.broken))

    def serve(self) -> None:
        while True:
            started = time.time()
            try:
                self.read_once(started)
            except Exception as exc:  # never let the thread die: no Windows claim until it reads again
                self.problem("watch", f"reading Windows failed: {type(exc).__name__}")
                with self.lock:
                    self.apps_running, self.fullscreen, self.reboot_pending = (), False, False
                    self.broken = dict.fromkeys(self.configured, owner.INTEROP_ERROR)
                    self.read_yet = True
            time.sleep(max(0.0, self.period_s - (time.time() - started)))

    @property
    def period_s(self) -> float:
        """How often the thread wakes: every ``interval_s`` for apps and full screen, else only
        for the reboot flags (every ``reboot_interval_s``): each interop call starts a Windows
        process, what the owner pays for."""
        return self.interval_s if self.apps or self.fullscreen_wanted else self.reboot_interval_s

    def seen(self) -> tuple[tuple[str, ...], bool, bool]:
        with self.lock:
            return self.apps_running, self.fullscreen, self.reboot_pending

    def signal_states(self) -> tuple[tuple[str, bool], ...]:
        """Each configured Windows signal (``owner.SIGNAL_LABELS``) and whether its last read
        worked; none until the first read is done."""
        with self.lock:
            if not self.read_yet:
                return ()
            return tuple((owner.SIGNAL_LABELS[s], s not in self.broken) for s in self.configured)


def local_now(now: float) -> tuple[int, int]:
    t = time.localtime(now)
    return t.tm_wday, t.tm_hour * 60 + t.tm_min


# --------------------------------------------------------------------------- the firewall
def nft_table() -> str | None:
    """What ``nft list table inet freetoken`` prints now (as ``host_lock.py`` lists it), or None:
    no such table, no nft, or no answer within ``FIREWALL_TIMEOUT_S``."""
    try:
        run = subprocess.run(
            ["nft", "list", "table", *FIREWALL_TABLE],
            capture_output=True,
            text=True,
            timeout=FIREWALL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout if run.returncode == 0 and run.stdout.strip() else None


class FirewallCheck:
    """Whether the deploy's nftables table is live as its unit loaded it: ``nft list table inet
    freetoken`` now equals the listing the unit recorded right after loading it (``record``,
    root's file in /run), as the deploy's ``FirewallTable`` fact judges it (``intact``). A
    flushed ruleset (``nft flush ruleset``, Debian's nftables.service) or a table changed by hand
    reads False. Listed every ``every_s`` only (a process start)."""

    def __init__(self, record: str, every_s: float = FIREWALL_EVERY_S, listing=nft_table):
        self.record, self.every_s, self.listing = record, every_s, listing
        self.loaded = False
        self.read_at: float | None = None

    def check(self, now: float) -> bool:
        if self.read_at is None or not 0 <= now - self.read_at < self.every_s:
            self.read_at = now
            live = self.listing()
            self.loaded = live is not None and live == read_text(self.record)
        return self.loaded


# --------------------------------------------------------------------------- acting
def prepare_stop(base: str, key: str | None, drain_timeout_s: float, clock=time.monotonic) -> str:
    """FreeToken closes its door to new generations and waits for running ones: bounded by one
    total deadline (its own wait, its abort time and 5 s), however slowly it answers."""
    wait = min(PREPARE_STOP_MAX_S, max(0.0, drain_timeout_s))
    doc = http_json(
        f"{base}/v1/admin/prepare-stop",
        key,
        {"drain_timeout_s": wait, "abort_timeout_s": 3.0},
        deadline_s=wait + 3.0 + 5.0,
        clock=clock,
    )
    if doc is None:
        return "prepare-stop: no answer"
    return "streams finished" if doc.get("drain_complete") is True else "prepare-stop: not sealed"


def systemctl(verb: str, unit: str) -> str | None:
    """``systemctl stop|start UNIT``; the error, if any."""
    run = subprocess.run(["systemctl", verb, unit], capture_output=True, text=True, timeout=300, check=False)
    return None if run.returncode == 0 else (run.stderr.strip() or f"exit status {run.returncode}")


# --------------------------------------------------------------------------- the agent-check port
def held_socket() -> socket.socket | None:
    """The listening socket systemd passed (``LISTEN_FDS=1``, fd 3, for this very process), or None."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or os.environ.get("LISTEN_FDS") != "1":
        return None
    return socket.socket(fileno=3)


class AgentPort:
    """HAProxy's agent-check: every connection gets the current word, then is closed; nothing a
    client sends is read."""

    def __init__(self, bind: str, port: int):
        held = held_socket()
        if held is not None:  # freetoken-agent.socket: systemd bound it at boot, before the engine
            self.sock = held
        else:
            family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            self.sock = socket.socket(family, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((bind, port))
            self.sock.listen(16)
        self.word = owner.WORD_UP
        self.drain_answers = 0  # how many times `drain` was read
        self.lock = threading.Lock()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            try:
                conn.settimeout(1.0)
                with self.lock:
                    word = self.word
                    if word.startswith(owner.DRAIN_PREFIX):
                        self.drain_answers += 1
                conn.sendall(word)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                conn.close()

    def set(self, word: bytes) -> None:
        with self.lock:
            if word.startswith(owner.DRAIN_PREFIX) and not self.word.startswith(owner.DRAIN_PREFIX):
                self.drain_answers = 0
            self.word = word

    def drained(self) -> bool:
        with self.lock:
            return self.drain_answers > 0


class Agent:
    """The decision loop: one look at the host a round (``look``), ``owner.step``, the action
    (``act``), the state file. Nothing in a round waits on the engine: its answers come from
    the ``EngineReader`` thread, taken only while fresh."""

    def __init__(
        self,
        args: argparse.Namespace,
        watch: WindowsWatch,
        port: AgentPort,
        gpu=None,
        clock=time.time,
        readings=None,
        power=None,
    ):
        apps = tuple(args.app or ())
        bad = [a for a in apps if not owner.app_name_ok(a)]
        if bad:
            log(f"not Windows image names, left out: {bad!r}")
            apps = tuple(a for a in apps if owner.app_name_ok(a))
        self.args, self.watch, self.port, self.clock = args, watch, port, clock
        self.policy = owner.Policy(
            int(args.vram_threshold_gb * owner.MIB_PER_GIB),
            args.quiet_s,
            apps=apps,
            fullscreen=args.fullscreen,
            hours=owner.parse_hours(args.serve_hours) if args.serve_hours else None,
            reboot=args.reboot_drain,
        )
        self.gpu = gpu if gpu is not None else gpu_used_mib
        self.reader = EngineReader(args.engine_url, args.key_file, args.interval_s)
        self.unit = UnitState(args.unit)
        self.fresh_s = max(ENGINE_FRESH_S, 2 * args.interval_s)
        self.systemctl = systemctl
        text = read_text(args.state_file)
        self.state = owner.load_state(text) if text else owner.AgentState(since=clock())
        self.written: bytes | None = None
        self.signals = ""
        # The samples for node_exporter (--textfile): the GPU's last read whole (GpuMemory.reading;
        # else the used memory alone) and its draw (read only for a write), the engine's last
        # fresh answer, the firewall's table.
        self.readings, self.power = readings, power
        self.answer: EngineAnswer | None = None
        self.firewall = FirewallCheck(args.firewall_record) if args.firewall_record else None
        self.exported: agent_metrics.AgentSample | None = None
        self.exported_at: float | None = None
        self.export_problem: str | None = None

    def look(self, now: float) -> owner.Observation:
        answer = self.reader.fresh(self.reader.clock(), self.fresh_s)  # None: no fresh answer, unknown
        active = self.unit.active(self.reader.clock(), None if answer is None else answer.answered)
        seen = self.watch.seen()
        self.answer = answer if active else None
        return owner.Observation(
            now=now,
            gpu_used_mib=self.gpu(),
            engine_active=active,
            engine_vram_mib=answer.vram_mib if active and answer is not None else None,
            health_ok=active and answer is not None and answer.health_ok,
            snooze_until=owner.load_snooze(read_text(self.args.override_file) or ""),
            drain_answered=self.port.drained(),
            apps_running=seen[0],
            fullscreen=seen[1],
            reboot_pending=seen[2],
            local=local_now(now),
        )

    def decide(self, now: float) -> tuple[owner.Observation, str | None]:
        """One look and ``owner.step``: the new state (kept, answered to the gateway) and the
        action to take."""
        obs = self.look(now)
        before = self.state
        state, action = owner.step(before, obs, self.policy)
        # What the agent can see of its owner: logged once per change, answered to the gateway,
        # recorded for `freetoken-owner status`. It decides on VRAM whatever interop does.
        if (now_signals := self.watch.signals()) != self.signals:
            if now_signals:
                log(f"owner signals: {now_signals}")
            self.signals = now_signals
        self.state = replace(state, signals=self.signals)
        self.port.set(owner.agent_word(self.state, now))
        if self.state.mode != before.mode or self.state.word != before.word:
            log(f"{before.mode} -> {self.state.mode}: {self.state.reason}")
        return obs, action

    def act(self, obs: owner.Observation, action: str | None) -> None:
        if action == owner.STOP:
            if obs.engine_active:
                log(prepare_stop(self.args.engine_url, read_key(self.args.key_file), self.args.drain_timeout_s))
            error = self.systemctl("stop", self.args.unit)
            self.unit.forget()
            log(f"engine stopped ({self.state.reason})" if error is None else f"could not stop the engine: {error}")
        elif action == owner.START:
            error = self.systemctl("start", self.args.unit)
            self.unit.forget()
            log("engine started" if error is None else f"could not start the engine: {error}")

    def record(self, now: float) -> None:
        # Written on a change of state or of others' VRAM by a quarter GiB (not every second).
        state = self.state
        rough = None if state.others_mib is None else state.others_mib // 256
        record = owner.dump_state(replace(state, others_mib=rough), 0.0)
        if record != self.written:
            hostio.write_atomic(self.args.state_file, owner.dump_state(state, now))
            self.written = record

    def sample(self, now: float, obs: owner.Observation) -> agent_metrics.AgentSample:
        """The round's samples for node_exporter (``core.agent_metrics``)."""
        reading = self.readings() if self.readings is not None else None
        if obs.gpu_used_mib is None:
            reading = None
        elif reading is None:
            reading = GpuReading(obs.gpu_used_mib * 2**20)
        answer = self.answer
        return agent_metrics.AgentSample(
            modes=owner.MODES,
            mode=self.state.mode,
            reasons=owner.YIELD_REASONS,
            reason=owner.yield_reason(self.state),
            signals=((owner.SIGNAL_LABELS[owner.SIG_VRAM], obs.gpu_used_mib is not None), *self.watch.signal_states()),
            last_loop=now,
            engine_requests=answer.requests if answer is not None else None,
            engine_generated_tokens=answer.generated_tokens if answer is not None else None,
            gpu_power_watts=None,  # read by export, only for a write
            gpu_memory_used_bytes=reading.used_bytes if reading is not None else None,
            gpu_memory_total_bytes=reading.total_bytes if reading is not None else None,
            firewall_loaded=self.firewall.check(now) if self.firewall is not None else None,
        )

    def export(self, now: float, obs: owner.Observation) -> None:
        """The samples written for node_exporter's textfile collector (``--textfile``, atomically:
        the collector never reads half a file): at once when the mode, the reason, a signal or
        the firewall changed, else every ``METRICS_EVERY_S``. A folder that is not there (no
        node_exporter) or a write that fails is logged once per change and tried again every
        ``METRICS_EVERY_S``; the loop goes on."""
        if not self.args.textfile:
            return
        at = self.exported_at
        due = at is None or not 0 <= now - at < METRICS_EVERY_S
        sample = self.sample(now, obs)
        if not due and (self.export_problem is not None or not agent_metrics.changed(self.exported, sample)):
            return
        if self.power is not None and sample.gpu_memory_used_bytes is not None:
            sample = replace(sample, gpu_power_watts=self.power())
        problem = None
        try:
            hostio.write_atomic(self.args.textfile, agent_metrics.render(sample).encode())
            self.exported = sample  # what the file holds
        except (OSError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
        self.exported_at = now
        if problem != self.export_problem:
            log(f"metrics not written to {self.args.textfile} ({problem})" if problem else "metrics written")
            self.export_problem = problem

    def round(self) -> None:
        now = self.clock()
        obs, action = self.decide(now)
        self.act(obs, action)
        self.record(now)
        self.export(self.clock(), obs)


def serve(args: argparse.Namespace) -> int:
    watch = WindowsWatch(
        args.system32,
        tuple(a for a in args.app or () if owner.app_name_ok(a)),
        args.fullscreen,
        args.reboot_drain,
        args.windows_interval_s,
        args.reboot_interval_s,
    )
    if watch.wanted:  # no Windows signal configured: no thread, no interop call at all
        threading.Thread(target=watch.serve, daemon=True).start()
    port = AgentPort(args.bind, args.port)
    nvml = NVML_LIBS if args.nvml_lib is None else tuple(p for p in [args.nvml_lib] if p)
    gpu = GpuMemory(nvml)
    agent = Agent(args, watch, port, gpu=gpu.used_mib, readings=lambda: gpu.reading, power=gpu.power_watts)
    port.set(owner.agent_word(agent.state, time.time()))
    threading.Thread(target=port.serve, daemon=True).start()
    threading.Thread(target=agent.reader.serve, daemon=True).start()
    log(f"answering agent checks on {args.bind}:{args.port}; state {agent.state.mode}")
    while True:
        agent.round()
        time.sleep(args.interval_s)


# --------------------------------------------------------------------------- freetoken-owner
def owner_command(args: argparse.Namespace) -> int:
    now = time.time()
    if args.verb in ("snooze", "resume") and os.geteuid() != 0:
        print(
            f"freetoken-owner {args.verb}: run it as root: sudo freetoken-owner {args.verb} "
            f"{args.duration or ''}".rstrip()
            + f" (from Windows: wsl.exe -u root freetoken-owner {args.verb} {args.duration or ''})".rstrip(),
            file=sys.stderr,
        )
        return 2
    if args.verb == "snooze":
        try:
            seconds = owner.parse_duration(args.duration or "")
        except ValueError as exc:
            print(f"freetoken-owner snooze: {exc}", file=sys.stderr)
            return 2
        until = now + seconds
        hostio.write_atomic(args.override_file, (json.dumps({"snooze_until": until, "set_at": now}) + "\n").encode())
        print(f"snoozed until {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(until))}: the engine leaves the GPU")
        return 0
    if args.verb == "resume":
        try:
            os.unlink(args.override_file)
        except FileNotFoundError:
            pass
        print("resumed: the engine serves again once the GPU has been free for the quiet time")
        return 0
    state = owner.load_state(read_text(args.state_file) or "")
    print(owner.describe(state, owner.load_snooze(read_text(args.override_file) or ""), now))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="owner_agent.py")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--unit", required=True)
    s.add_argument("--engine-url", required=True)
    s.add_argument("--key-file", required=True)
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--vram-threshold-gb", type=float, required=True)
    s.add_argument("--quiet-s", type=float, required=True)
    s.add_argument("--drain-timeout-s", type=float, required=True)
    s.add_argument("--interval-s", type=float, default=1.0)
    s.add_argument("--system32", help="C:\\Windows\\System32 as the distro mounts it (interop tools)")
    s.add_argument("--app", action="append", help="a Windows image name whose running claims the GPU")
    s.add_argument("--fullscreen", action="store_true", help="a full-screen app claims the GPU")
    s.add_argument("--reboot-drain", action="store_true", help="a pending Windows reboot drains the host")
    s.add_argument("--serve-hours", help="when the host serves (owner.parse_hours)")
    s.add_argument("--windows-interval-s", type=float, default=5.0)
    s.add_argument("--reboot-interval-s", type=float, default=REBOOT_EVERY_S)
    s.add_argument("--state-file", required=True)
    s.add_argument("--override-file", required=True)
    s.add_argument("--nvml-lib", help="NVML's library (default: WSL's, then the loader's); '': nvidia-smi only")
    s.add_argument("--textfile", help="node_exporter's textfile collector file for the agent's samples (unset: none)")
    s.add_argument("--firewall-record", help="the firewall unit's listing of its table: report whether it is live")
    o = sub.add_parser("owner")
    o.add_argument("--state-file", required=True)
    o.add_argument("--override-file", required=True)
    o.add_argument("verb", choices=("snooze", "resume", "status"))
    o.add_argument("duration", nargs="?")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return serve(args) if args.command == "serve" else owner_command(args)


if __name__ == "__main__":
    sys.exit(main())
