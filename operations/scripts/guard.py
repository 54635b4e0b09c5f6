#!/usr/bin/python3
"""FreeToken memory guard: one sample per run, run by ``freetoken-guard.timer``.

The field report's operations advice: sample RAM/swap and GPU memory every 30 s; when swap
stays above 2 GB, or a CUDA out-of-memory appears, stop the engine to free memory (a box that
swaps with 16.9 GB of experts resident in RAM grinds the whole workstation to a halt).

Each run:
  * samples /proc/meminfo and ``nvidia-smi`` (missing or failing nvidia-smi: no GPU samples);
  * reads the engine unit's journal since the previous run, looking for the engine's own record
    of a CUDA OOM (its ERROR record of a backend death by OOM, or the dying worker's traceback
    right before the record of its death; never OOM text anywhere, which a prompt or a reply
    can carry: ``find_ooms``);
  * if swap used > --swap-limit-gb or the engine recorded an OOM, and the engine is running:
    ``systemctl stop`` it, print one ``freetoken-guard: stopped ...`` line (the journal, under
    systemd) and write the tripped state file (read by the doctor, cleared by the deploy when it
    starts the engine again). A tripped state is otherwise left alone;
  * always writes the samples for node_exporter's textfile collector.

Runs on the target with the system python3: the standard library and ``hostio.py``, uploaded beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/hostio.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import hostio
else:
    import hostio

PREFIX = "freetoken-guard:"
# "GB" as in .wslconfig (swap=4GB is 4 GiB) and in `free -h`, which the field report read.
GB = 1024**3
# What counts as the engine running out of GPU memory: the engine's own error records, never a
# phrase anywhere in its journal (FreeToken logs request text and model output there, so a
# prompt could otherwise stop a healthy engine). Shapes read from the real 0.2.1 wheel:
#  * utils/logger.py formats every record as BOLD "[%Y-%m-%d|%H:%M:%S<suffix>]" RESET, then the
#    level name in its colour padded to 8, RESET, the message (stdout, colours always on);
#    <suffix> is "|pid=N" with LOG_PID, then the logger's own tag, then "|core|rank=N" once a
#    process has a tensor-parallel rank.
#  * server/api_server.py (logger tag "FrontendAPI") logs a backend death as ERROR
#    "Backend supervisor: <reason>"; during
#    load <reason> is "<ExceptionType>: <message>" (server/launch.py _report_startup_error),
#    after load "backend worker <name> exited" (server/supervisor.py), the scheduler worker
#    (name freetoken-TP<rank>-scheduler, launch.py) having printed its traceback to stderr.
#  * PyTorch's allocator raises torch.OutOfMemoryError "CUDA out of memory. Tried to allocate
#    ..." (c10/cuda/CUDACachingAllocator.cpp); a raw CUDA allocation failure is RuntimeError
#    "CUDA error: out of memory" up to torch 2.10 and torch.AcceleratorError "CUDA error: out of
#    memory" since (pytorch/pytorch#152023; captured on an H200 with torch 2.11, its message
#    continuing on further lines: tests/fixtures/real/torch-2.11-cuda-oom-h200.txt). The
#    supervisor names the type without its module ("AcceleratorError: CUDA error: out of memory").
ENGINE_ERROR_RE = re.compile(
    r"\x1b\[1m\[\d{4}-\d\d-\d\d\|\d\d:\d\d:\d\d(?:\|pid=\d+)?\|FrontendAPI(?:\|core\|rank=\d+)?\]\x1b\[0m "
    r"\x1b\[31mERROR   \x1b\[0m (?P<message>.*)"
)
# Any record of the engine's logger, any level and tag: what follows it up to the next record or
# worker traceback is that record's message (a prompt, a reply), never a traceback of its own.
ENGINE_RECORD_RE = re.compile(r"\x1b\[1m\[\d{4}-\d\d-\d\d\|\d\d:\d\d:\d\d[^\]\x1b]*\]\x1b\[0m ")
TORCH_OOM = (
    r"(?:torch\.(?:cuda\.)?)?OutOfMemoryError: CUDA out of memory\. "
    r"|(?:torch\.)?AcceleratorError: CUDA error: out of memory$"
    r"|RuntimeError: CUDA error: out of memory|RuntimeError: CUDA out of memory\. "
)
LOAD_OOM_RE = re.compile(rf"Backend supervisor: (?P<oom>(?:{TORCH_OOM}).*)")
WORKER = r"freetoken-TP[0-9]+-scheduler"
WORKER_DIED_RE = re.compile(rf"Backend supervisor: backend worker (?P<worker>{WORKER})\b.* exited\b.*")
# A worker's uncaught exception as multiprocessing prints it to stderr: "Process <name>:", then
# Python's traceback, whose last exception line starts the line (column 0).
WORKER_TRACEBACK_RE = re.compile(rf"Process (?P<worker>{WORKER}):")
TRACEBACK_START = "Traceback (most recent call last):"
TRACEBACK_CHAINS = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# PyTorch before 1.13 raised the allocator's OOM as RuntimeError (tests/fixtures/real).
TRACEBACK_OOM_RE = re.compile(rf"(?:{TORCH_OOM}).*")
# The supervisor polls its workers every second; a traceback older than this whose death record
# never came belongs to no death.
PENDING_OOM_S = 120
# nvidia-smi is not on systemd's PATH inside WSL: the Windows driver provides it here.
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
# First run (no journal position yet): look back this far, not at the whole history, so an
# OOM from days ago does not stop a healthy engine.
FIRST_LOOKBACK_S = 120
RUNNING_STATES = ("active", "activating", "reloading")


def log(message: str, warning: bool = False) -> None:
    # Under systemd (JOURNAL_STREAM set), a "<4>" prefix files the line as a warning.
    level = "<4>" if warning and os.environ.get("JOURNAL_STREAM") else ""
    print(f"{level}{PREFIX} {message}", flush=True)


# --------------------------------------------------------------------------- samples


def read_meminfo(path: str) -> dict:
    """RAM and swap in bytes from /proc/meminfo; keys missing from the file are left out."""
    fields = {}
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    scale = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    fields[key.strip()] = int(parts[0]) * scale
    except OSError as exc:
        log(f"cannot read {path}: {exc}")
    samples = {}
    for name, key in (
        ("ram_total_bytes", "MemTotal"),
        ("ram_available_bytes", "MemAvailable"),
        ("swap_total_bytes", "SwapTotal"),
    ):
        if key in fields:
            samples[name] = fields[key]
    if "SwapTotal" in fields and "SwapFree" in fields:
        samples["swap_used_bytes"] = max(0, fields["SwapTotal"] - fields["SwapFree"])
    return samples


def find_nvidia_smi() -> str | None:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return WSL_NVIDIA_SMI if os.access(WSL_NVIDIA_SMI, os.X_OK) else None


def _mib(text: str) -> int | None:
    text = text.strip()
    return int(float(text) * 1024 * 1024) if text.replace(".", "", 1).isdigit() else None


def read_gpus() -> list:
    """[{index, memory_used_bytes, memory_total_bytes}]; [] when nvidia-smi is missing or fails."""
    binary = find_nvidia_smi()
    if not binary:
        return []
    try:
        proc = subprocess.run(
            [binary, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        log(f"nvidia-smi failed: {exc}")
        return []
    if proc.returncode != 0:
        return []
    gpus: list[dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        gpu: dict[str, Any] = {"index": cells[0]}
        used, total = _mib(cells[1]), _mib(cells[2])  # "[N/A]" / "[Not Supported]" -> None
        if used is not None:
            gpu["memory_used_bytes"] = used
        if total is not None:
            gpu["memory_total_bytes"] = total
        gpus.append(gpu)
    return gpus


# --------------------------------------------------------------------------- journal


def load_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _journalctl(unit: str, position: list) -> tuple[int, list]:
    cmd = ["journalctl", "-u", unit, "-o", "cat", "--no-pager", "-q", "--show-cursor", *position]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        log(f"journalctl failed: {exc}")
        return 1, []
    return proc.returncode, proc.stdout.splitlines()


def engine_message(line: str) -> str | None:
    """The message of one of the engine's own ERROR records; None for any other line."""
    m = ENGINE_ERROR_RE.fullmatch(line.rstrip("\r\n"))
    return m.group("message") if m else None


class WorkerTraceback:
    """One worker's traceback block, line by line: ``Process <worker>:``, Python's traceback
    (frames, chained exceptions), its last exception line and that exception's further lines."""

    def __init__(self, worker: str):
        self.worker = worker
        self.state = "header"  # then "frames", then "exception" (the last line seen was one)
        self.exception: str | None = None

    def feed(self, line: str) -> bool:
        """Take the next line; False when it cannot belong to this block (nothing counts then)."""
        if self.state == "header":
            self.state = "frames" if line == TRACEBACK_START else "broken"
        elif not line.strip():
            pass  # the blank line after a message, or before a chained exception
        elif line == TRACEBACK_START or line in TRACEBACK_CHAINS:
            self.state = "frames"
        elif self.state == "frames" and not line.startswith(" "):
            self.exception, self.state = line, "exception"
        # else: a frame ("  File ...", its code) or a further line of the exception's message
        return self.state != "broken"

    @property
    def oom(self) -> str | None:
        last = self.exception if self.state == "exception" else None
        return last.strip() if last and TRACEBACK_OOM_RE.fullmatch(last) else None


def find_ooms(lines: list, pending: dict | None = None) -> tuple[list, dict | None]:
    """The engine's out-of-memory failures among journal lines, oldest first, as text for the
    reason, and a worker's OOM traceback still waiting for its death record (carried to the next
    run as ``{"worker", "line"}``).

    A death counts as an OOM only by the engine's own records: the supervisor's ERROR record of
    a death during load that names the OOM, or, once serving (the record then says only "backend
    worker <name> exited"), that worker's own traceback block ending in the OOM right before the
    record, with no other record of the engine between them. An OOM-shaped line anywhere else
    (a prompt, a reply, any record's message and its further lines) is text: it is never held
    for a later death."""
    found = []
    block: WorkerTraceback | None = None
    for raw in lines:
        line = raw.rstrip("\r\n")
        if ENGINE_RECORD_RE.match(line):
            if block is not None:  # a traceback ends where the engine's next record begins
                pending = {"worker": block.worker, "line": block.oom} if block.oom else None
                block = None
            message = engine_message(line) or ""
            died = WORKER_DIED_RE.fullmatch(message)
            load = LOAD_OOM_RE.fullmatch(message)
            if load:
                found.append(load.group("oom"))
            elif died and pending and pending.get("worker") == died.group("worker"):
                found.append(f"{pending['line']} ({message[len('Backend supervisor: ') :]})")
            pending = None  # whatever this record is, a traceback before it is no longer the last word
            continue
        start = WORKER_TRACEBACK_RE.fullmatch(line)
        if start:
            block = WorkerTraceback(start.group("worker"))
            pending = None
        elif block is not None and not block.feed(line):
            block = None
    if block is not None:  # the death record may come in the next run
        pending = {"worker": block.worker, "line": block.oom} if block.oom else None
    return found, pending


def scan_journal(unit: str, position_file: str, now: float) -> tuple[list, dict]:
    """The engine's OOM failures logged since the previous run, and the position to save."""
    previous = load_json(position_file) or {}
    since = previous.get("time")
    since = since if isinstance(since, (int, float)) else now - FIRST_LOOKBACK_S
    by_time = ["--since", f"@{int(since)}"]
    cursor = previous.get("cursor")
    rc, lines = _journalctl(unit, [f"--after-cursor={cursor}"] if isinstance(cursor, str) else by_time)
    if rc != 0 and isinstance(cursor, str):
        # The cursor's journal file was rotated away: fall back to the time.
        cursor = None
        rc, lines = _journalctl(unit, by_time)
    records = []
    for line in lines:
        if line.startswith("-- cursor: "):
            cursor = line[len("-- cursor: ") :].strip()
        else:
            records.append(line)
    # A worker's traceback and the supervisor's record of its death may fall either side of a run.
    carried: Any = previous.get("pending_oom")
    fresh = (
        isinstance(carried, dict)
        and isinstance(carried.get("line"), str)
        and isinstance(carried.get("worker"), str)
        and isinstance(carried.get("time"), (int, float))
        and now - carried["time"] <= PENDING_OOM_S
    )
    before = {"worker": carried["worker"], "line": carried["line"]} if fresh else None
    found, pending = find_ooms(records, before)
    keep = None
    if pending is not None:
        kept_since = carried["time"] if fresh and pending == before else now
        keep = {**pending, "time": kept_since}
    return found, {"cursor": cursor, "time": now, "pending_oom": keep}


# --------------------------------------------------------------------------- output


def write_atomic(path: str, text: str) -> None:
    """The file written whole (``hostio.write_atomic``), its folder made first. World-readable:
    node_exporter and the doctor (not root) read these; the temporary name does not end in
    .prom, so the textfile collector skips it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    hostio.write_atomic(path, text.encode("utf-8"))


METRICS = (
    ("ram_total_bytes", "Total RAM (MemTotal)."),
    ("ram_available_bytes", "Available RAM (MemAvailable)."),
    ("swap_total_bytes", "Total swap (SwapTotal)."),
    ("swap_used_bytes", "Used swap (SwapTotal - SwapFree)."),
    ("gpu_memory_used_bytes", "GPU memory used, from nvidia-smi."),
    ("gpu_memory_total_bytes", "GPU memory total, from nvidia-smi."),
    ("tripped", "1 when the guard has stopped the engine and nobody has started it again."),
    ("last_run_timestamp_seconds", "Unix time of the guard's last run."),
)


def _value(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


def render_metrics(samples: dict, tripped: bool, now: float) -> str:
    values = dict(samples)
    values["tripped"] = 1 if tripped else 0
    values["last_run_timestamp_seconds"] = round(now, 3)
    out = []
    for name, help_text in METRICS:
        full = f"freetoken_guard_{name}"
        if name.startswith("gpu_"):
            key = name[len("gpu_") :]
            rows = [(f'{{gpu="{gpu["index"]}"}}', gpu[key]) for gpu in samples.get("gpus", []) if key in gpu]
        else:
            rows = [("", values[name])] if name in values else []
        out.append(f"# HELP {full} {help_text}")
        out.append(f"# TYPE {full} gauge")
        out.extend(f"{full}{labels} {_value(value)}" for labels, value in rows)
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- decision


def engine_running(unit: str) -> bool:
    try:
        proc = subprocess.run(["systemctl", "is-active", unit], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True  # cannot tell: act as if it were running
    return proc.stdout.strip() in RUNNING_STATES


def stop_engine(unit: str) -> str | None:
    """Stop the unit; None on success, else what went wrong."""
    try:
        proc = subprocess.run(["systemctl", "stop", unit], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
    return None


def problems(samples: dict, swap_limit_gb: float, oom_lines: list) -> list:
    found = []
    used = samples.get("swap_used_bytes")
    if used is not None and used > swap_limit_gb * GB:
        found.append(f"swap {used / GB:.1f} GB > {swap_limit_gb:.1f} GB")
    if oom_lines:
        line = oom_lines[-1]
        line = line if len(line) <= 200 else line[:197] + "..."
        reason = f"CUDA out of memory in the engine's journal: {line!r}"
        gpus = [g for g in samples.get("gpus", []) if "memory_used_bytes" in g and g.get("memory_total_bytes")]
        if gpus and all(g["memory_used_bytes"] < g["memory_total_bytes"] / 2 for g in gpus):
            # Field report pitfall 4B: an OOM with the GPU mostly free is old WSL's WDDM accounting.
            reason += " with GPU memory mostly free (pitfall 4B: check `wsl --version`)"
        found.append(reason)
    return found


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # float("1e309") is inf: a limit nothing ever passes
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stop the FreeToken engine when memory runs out.")
    parser.add_argument("--unit", default="freetoken.service")
    parser.add_argument("--swap-limit-gb", type=finite_float, default=2.0)
    parser.add_argument("--state-file", default="/var/lib/freetoken-deploy/guard-state.json")
    parser.add_argument("--textfile", default="/var/lib/freetoken-deploy/metrics/freetoken.prom")
    parser.add_argument("--meminfo", default="/proc/meminfo")
    parser.add_argument(
        "--journal-position-file",
        default=None,
        help="where the journal position is kept (default: beside --state-file)",
    )
    args = parser.parse_args(argv)
    position_file = args.journal_position_file or os.path.join(
        os.path.dirname(args.state_file) or ".", "guard-journal.json"
    )

    now = time.time()
    samples = read_meminfo(args.meminfo)
    samples["gpus"] = read_gpus()
    oom_lines, position = scan_journal(args.unit, position_file, now)

    status = 0
    state = load_json(args.state_file)
    tripped = bool(state and state.get("tripped") is True)
    found = problems(samples, args.swap_limit_gb, oom_lines)
    # A stopped engine frees nothing more; swap pages linger after it stops, so acting again
    # would only repeat the log line every run.
    if found and engine_running(args.unit):
        reason = "; ".join(found)
        error = stop_engine(args.unit)
        if error:
            reason += f" (systemctl stop failed: {error})"
            log(f"FAILED to stop {args.unit}: {reason}", warning=True)
            status = 1
        else:
            log(f"stopped {args.unit}: {reason}", warning=True)
        stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds")
        write_atomic(
            args.state_file,
            json.dumps(
                {"tripped": True, "reason": reason, "time": stamp, "unit": args.unit, "samples": samples},
                indent=2,
                sort_keys=True,
            )
            + "\n",
        )
        tripped = True

    write_atomic(position_file, json.dumps(position) + "\n")
    write_atomic(args.textfile, render_metrics(samples, tripped, now))
    return status


if __name__ == "__main__":
    sys.exit(main())
