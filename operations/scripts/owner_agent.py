#!/usr/bin/python3
"""FreeToken host agent (``freetoken-agent.service``, as root) and the owner's command
(``freetoken-owner``, issue 22 items 1 and 2).

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
runtime folder (``--state-file``, ``/run/freetoken-agent``) and the owner's command writes only
root's state folder (``--override-file``, ``/var/lib/freetoken-deploy``); the agent reads
the engine's key from root's 0600 file and sends it in a header (never an argument), runs only
fixed argument lists (``systemctl``, ``nvidia-smi``), and takes nothing from the engine's
answers but a status word and two numbers, each checked for its type.

Windows (issue 22 items 2 and 3), through interop, from a thread every ``--windows-interval-s``
(each interop start costs about half a second): ``tasklist.exe /fo csv /nh`` when ``--app``
names are set, PowerShell's call of shell32's ``SHQueryUserNotificationState`` with
``--fullscreen``, and ``reg.exe query`` of Windows Update's two reboot flags (every
``REBOOT_EVERY_S``). Root runs them only from their fixed paths under ``--system32`` (System32
under the drive root the deploy read from wsl.conf), with fixed arguments, never from PATH; what
they print is parsed strictly (``owner.parse_tasklist``, ``parse_notification_state``,
``reboot_flag``) and only compared: an app counts when its image name equals a listed one.

``owner snooze 2h | resume | status``: the owner's override (snooze and resume as root).

Runs on the target with the system python3; standard library only.
"""

from __future__ import annotations

import argparse
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
import urllib.error
import urllib.request
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if TYPE_CHECKING:  # the same modules, as the type checker finds them in the checkout
    from freetoken_infra.core import hostio, owner
else:
    try:  # uploaded beside this script on the target
        import hostio
        import owner
    except ImportError:  # run from a checkout of the project
        sys.path.insert(0, os.path.abspath(os.path.join(HERE, "..", "..")))
        from freetoken_infra.core import hostio, owner

PREFIX = "freetoken-agent:"
# nvidia-smi is not on systemd's PATH inside WSL: the Windows driver provides it here.
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
KEY_VAR = "FREETOKEN_API_KEY"
# The most the engine's prepare-stop waits for running streams (its own bound: 10 s).
PREPARE_STOP_MAX_S = 10.0
# Windows Update's flags change rarely: read every minute, not every round.
REBOOT_EVERY_S = 60.0
# One total deadline (wall clock) for each Windows program the agent runs: a program that hangs
# (Windows locked, microsoft/WSL#7001) or prints forever is killed with its whole group then.
WINDOWS_TIMEOUT_S = 20.0
# The most of a Windows program's stdout and stderr kept (the rest is read and dropped).
WINDOWS_OUTPUT_MAX = 1 << 20
# No proxy between the agent and the engine on loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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


def engine_active(unit: str) -> bool:
    run = subprocess.run(["systemctl", "is-active", "--quiet", unit], timeout=30, check=False)
    return run.returncode == 0


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


def _request(url: str, key: str | None, body: dict | None, timeout: float) -> dict | None:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            doc = json.loads(resp.read(65536))
    except urllib.error.HTTPError as exc:
        try:
            doc = json.loads(exc.read(65536))
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def health_ok(base: str) -> bool:
    doc = _request(f"{base}/health", None, None, timeout=2)
    return doc is not None and doc.get("status") == "ok"


def engine_vram_mib(base: str, key: str | None) -> int | None:
    doc = _request(f"{base}/v1/stats", key, None, timeout=2)
    vram = doc.get("vram_bytes") if doc else None
    if isinstance(vram, bool) or not isinstance(vram, int) or vram <= 0:
        return None  # 0: not loaded yet (what it will hold is unknown)
    return vram // 2**20


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
            time.sleep(max(0.0, self.interval_s - (time.time() - started)))

    def seen(self) -> tuple[tuple[str, ...], bool, bool]:
        with self.lock:
            return self.apps_running, self.fullscreen, self.reboot_pending


def local_now(now: float) -> tuple[int, int]:
    t = time.localtime(now)
    return t.tm_wday, t.tm_hour * 60 + t.tm_min


# --------------------------------------------------------------------------- acting
def prepare_stop(base: str, key: str | None, drain_timeout_s: float) -> str:
    """FreeToken closes its door to new generations and waits for running ones (bounded)."""
    wait = min(PREPARE_STOP_MAX_S, max(0.0, drain_timeout_s))
    doc = _request(
        f"{base}/v1/admin/prepare-stop",
        key,
        {"drain_timeout_s": wait, "abort_timeout_s": 3.0},
        timeout=wait + 3.0 + 5.0,
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


def serve(args: argparse.Namespace) -> int:
    apps = tuple(args.app or ())
    bad = [a for a in apps if not owner.app_name_ok(a)]
    if bad:
        log(f"not Windows image names, left out: {bad!r}")
        apps = tuple(a for a in apps if owner.app_name_ok(a))
    hours = owner.parse_hours(args.serve_hours) if args.serve_hours else None
    policy = owner.Policy(
        int(args.vram_threshold_gb * owner.MIB_PER_GIB),
        args.quiet_s,
        apps=apps,
        fullscreen=args.fullscreen,
        hours=hours,
        reboot=args.reboot_drain,
    )
    watch = WindowsWatch(
        args.system32, apps, args.fullscreen, args.reboot_drain, args.windows_interval_s, args.reboot_interval_s
    )
    if watch.wanted:
        threading.Thread(target=watch.serve, daemon=True).start()
    text = read_text(args.state_file)
    state = owner.load_state(text) if text else owner.AgentState(since=time.time())
    port = AgentPort(args.bind, args.port)
    now = time.time()
    port.set(owner.agent_word(state, now))
    threading.Thread(target=port.serve, daemon=True).start()
    log(f"answering agent checks on {args.bind}:{args.port}; state {state.mode}")
    written = None
    signals = ""
    while True:
        now = time.time()
        active = engine_active(args.unit)
        key = read_key(args.key_file)
        seen = watch.seen()
        obs = owner.Observation(
            now=now,
            gpu_used_mib=gpu_used_mib(),
            engine_active=active,
            engine_vram_mib=engine_vram_mib(args.engine_url, key) if active else None,
            health_ok=active and health_ok(args.engine_url),
            snooze_until=owner.load_snooze(read_text(args.override_file) or ""),
            drain_answered=port.drained(),
            apps_running=seen[0],
            fullscreen=seen[1],
            reboot_pending=seen[2],
            local=local_now(now),
        )
        before = state
        state, action = owner.step(state, obs, policy)
        # What the agent can see of its owner: logged once per change, answered to the gateway,
        # recorded for `freetoken-owner status`. It decides on VRAM whatever interop does.
        if (now_signals := watch.signals()) != signals:
            if now_signals:
                log(f"owner signals: {now_signals}")
            signals = now_signals
        state = replace(state, signals=signals)
        port.set(owner.agent_word(state, now))
        if state.mode != before.mode or state.word != before.word:
            log(f"{before.mode} -> {state.mode}: {state.reason}")
        if action == owner.STOP:
            if active:
                log(prepare_stop(args.engine_url, key, args.drain_timeout_s))
            error = systemctl("stop", args.unit)
            log(f"engine stopped ({state.reason})" if error is None else f"could not stop the engine: {error}")
        elif action == owner.START:
            error = systemctl("start", args.unit)
            log("engine started" if error is None else f"could not start the engine: {error}")
        # Written on a change of state or of others' VRAM by a quarter GiB (not every second).
        rough = None if state.others_mib is None else state.others_mib // 256
        record = owner.dump_state(replace(state, others_mib=rough), 0.0)
        if record != written:
            hostio.write_atomic(args.state_file, owner.dump_state(state, now))
            written = record
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


def main(argv: list[str] | None = None) -> int:
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
    o = sub.add_parser("owner")
    o.add_argument("--state-file", required=True)
    o.add_argument("--override-file", required=True)
    o.add_argument("verb", choices=("snooze", "resume", "status"))
    o.add_argument("duration", nargs="?")
    args = p.parse_args(argv)
    return serve(args) if args.command == "serve" else owner_command(args)


if __name__ == "__main__":
    sys.exit(main())
