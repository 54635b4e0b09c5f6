"""Roll the deploy out to a fleet: a canary first, then batches, each gated on the health gate.

    python -m freetoken_infra.rollout INVENTORY [--batches 1,25%,100%] [--canary HOST[,HOST]]
        [--max-fail-pct P] [--data KEY=VALUE ...] [--limit HOST[,HOST]] [--json FILE]
        [--only parked,failed --from REPORT]

Each batch is converged by exactly what a user runs by hand,
``pyinfra -y INVENTORY deploys/freetoken.py --limit HOST --limit HOST ...`` (the batch's hosts), so every host gets
the deploy's preflight, its blue-green engine switch and its health gate (a host whose gate
fails is failed by the deploy, after an automatic rollback when it was an upgrade).

* A host pyinfra cannot connect to (a PC that is off) is *parked*: nothing is done on it, it
  counts toward no stop, and a later ``--only parked,failed --from REPORT`` catches it up. A
  host its preflight stops is *refused* (nothing changed either).
* Hosts go in name order (natural: ws2 before ws10); ``--canary`` puts the named hosts first
  and makes them the first batch.
* ``--batches``: batch sizes, each a host count or a percentage of all hosts (rounded up),
  like Ansible's ``serial``; the last size repeats until every host had its turn. The first
  batch is the canary: any failure in it stops the rollout, no other host is touched, and so
  does a canary with no host that converged (all parked or refused: it proved nothing).
* Later batches stop the rollout when more than ``--max-fail-pct`` percent of their reached
  hosts failed (default 0: any failure stops the rest); parked hosts are not counted.
* A re-run resumes: the deploy is idempotent, converged hosts pass with no change.
* Behind a gateway (an inventory group ``gateway``, deploys/gateway.py), each batch is drained
  at the gateway before its engines are touched (running streams finish, new requests go to the
  other hosts) and put back only after its health gate passed: zero client errors. A failed
  host stays drained. Hosts that run no engine (``runs_engine = False``) are not rolled out.
* At the end: the fleet report (``freetoken_infra.report.format_fleet_report``), and the same
  rows as JSON, always written: to ``--json FILE``, else to a new file under
  ``$XDG_STATE_HOME/freetoken-infra/rollouts/`` (``~/.local/state`` by default), whose path
  the rollout prints; ``--from last`` reads the newest there. Each report is signed, with its
  run id and creation time inside the signed content; a catch-up takes no report older than the
  newest one this controller applied, and prints what it replays before anything runs.
* Exit status (the first that applies): 2 bad arguments or settings (nothing touched), 3 the
  rollout stopped early, 1 some host failed, 4 no host failed but some are parked, 5 no host
  failed or is parked but some were refused at preflight, 0 every host ok.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import hmac
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TextIO

from freetoken_infra.core.records import RECORD_ENV, HostRow, HostRowError, read_records
from freetoken_infra.core.redact import redact_command
from freetoken_infra.core.settings import InventoryError, load_inventory_settings, natural_key
from freetoken_infra.fleet import GATEWAY_GROUP, Fleet, FleetError
from freetoken_infra.report import (
    RESULT_FAILED,
    RESULT_NOT_RUN,
    RESULT_OK,
    RESULT_PARKED,
    RESULT_REFUSED,
    RESULTS,
    ending_line,
    fleet_counts,
    format_fleet_report,
    host_row,
)

DEFAULT_BATCHES = "1,25%,100%"
DEFAULT_DEPLOY = "deploys/freetoken.py"
DEFAULT_ONLY = "parked,failed"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED, EXIT_PARKED, EXIT_REFUSED = 0, 1, 2, 3, 4, 5


class RolloutError(Exception):
    """Bad arguments or settings: reported before any host is touched."""


# --------------------------------------------------------------------------- planning
def parse_batch_sizes(spec: str) -> list[str]:
    """``"1,25%,100%"`` -> ``["1", "25%", "100%"]``; RolloutError on anything else."""
    sizes = [part.strip() for part in spec.split(",") if part.strip()]
    if not sizes:
        raise RolloutError(f"--batches {spec!r}: give at least one size, e.g. 1,25%,100%")
    for size in sizes:
        m = re.fullmatch(r"(\d+)(%?)", size)
        if not m or int(m.group(1)) == 0 or (m.group(2) and int(m.group(1)) > 100):
            raise RolloutError(f"--batches {spec!r}: {size!r} is not a host count (>= 1) or a percentage (1%-100%)")
    return sizes


def batch_size(size: str, total: int) -> int:
    """A size of ``--batches`` as a host count: percentages of `total`, rounded up, at least 1."""
    if size.endswith("%"):
        return max(1, math.ceil(total * int(size[:-1]) / 100))
    return int(size)


def plan_batches(hosts: Sequence[str], sizes: Sequence[str], canary: Sequence[str] = ()) -> list[list[str]]:
    """Split `hosts` into batches: the canary hosts (when named) or the first size's hosts
    first, then the following sizes, the last one repeating until no host is left."""
    unknown = [h for h in canary if h not in hosts]
    if unknown:
        raise RolloutError(f"--canary: {', '.join(unknown)} not in the inventory (hosts: {', '.join(hosts)})")
    ordered = list(dict.fromkeys(canary)) + sorted((h for h in hosts if h not in canary), key=natural_key)
    total = len(ordered)
    batches: list[list[str]] = []
    rest = sizes
    if canary:
        batches.append(ordered[: len(set(canary))])
        ordered = ordered[len(set(canary)) :]
        rest = sizes[1:] or sizes
    i = 0
    while ordered:
        n = batch_size(rest[min(i, len(rest) - 1)], total)
        batches.append(ordered[:n])
        ordered = ordered[n:]
        i += 1
    return batches


def batch_stops(
    index: int, failed: int, size: int, max_fail_pct: float, parked: int = 0, ok: int | None = None
) -> str | None:
    """Why the rollout stops after this batch, or None to go on.

    Parked hosts (unreachable, nothing done) count neither way. The canary (index 0) allows no
    failure and needs at least one host that converged (`ok`; None: every host that did not
    fail): a canary of parked or refused hosts proved nothing about the change. Later batches
    allow up to `max_fail_pct` percent of their reached hosts to fail."""
    reached = size - parked
    ok = reached - failed if ok is None else ok
    if index == 0:
        if failed:
            return f"the canary failed ({failed} of {size} host(s))"
        if not reached:
            return f"the canary had no reachable host ({parked} of {size} parked): it proved nothing"
        if not ok:
            return f"no canary host converged ({reached - ok} of {size} refused at preflight): it proved nothing"
        return None
    if not failed:
        return None
    pct = 100.0 * failed / reached
    if pct > max_fail_pct:
        return (
            f"batch {index + 1}: {failed} of {reached} reached host(s) failed ({pct:.0f}% > "
            f"--max-fail-pct {max_fail_pct:g}%)"
        )
    return None


# --------------------------------------------------------------------------- inventory
def parse_data(items: Sequence[str]) -> dict:
    """``--data KEY=VALUE`` as pyinfra parses it (so validation sees what the deploy sees).

    Only our settings (core.settings.Settings) may be given: never a pyinfra global argument
    (``_shell_executable``, ``_sudo``...) or a connection setting (``ssh_hostname``...), which
    would change how, where or as whom every command of the run is executed. ``load_hosts``
    then validates the values as the inventory's."""
    from freetoken_infra.core.settings import Settings

    pairs = []
    for item in items:
        if not isinstance(item, str):
            raise RolloutError(f"--data {item!r}: expected KEY=VALUE")
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RolloutError(f"--data {item!r}: expected KEY=VALUE")
        if key not in Settings.model_fields:
            raise RolloutError(
                f"--data {key}: not a setting of this deploy (pyinfra arguments and connection "
                "settings belong in the inventory); see group_data/all.py for the settings"
            )
        pairs.append((key, value))
    if not pairs:
        return {}
    from freetoken_infra.core.pyinfra_internals import (
        parse_cli_value,
    )  # after the checks: it patches this process (gevent)

    return {key: parse_cli_value(value) for key, value in pairs}


def load_hosts(inventory: str, data: dict, limit: Sequence[str] = ()) -> list[str]:
    """Host names of the inventory (as the pyinfra CLI loads it, group_data included), after
    validating every host's settings; RolloutError naming host and field otherwise."""
    try:
        _, settings = load_inventory_settings(inventory, data)
    except InventoryError as exc:
        raise RolloutError(str(exc)) from None
    names = [name for name, s in settings.items() if s.runs_engine]  # not a gateway-only host
    if limit:
        missing = [h for h in limit if h not in names]
        if missing:
            raise RolloutError(f"--limit: {', '.join(missing)} not in the inventory")
        names = [h for h in names if h in limit]
    if not names:
        raise RolloutError(f"{inventory}: no hosts")
    return names


# --------------------------------------------------------------------------- running
def pyinfra_executable() -> str:
    """The pyinfra beside this Python (the venv's, as the README runs it), else the one on PATH."""
    exe = Path(sys.executable).with_name("pyinfra")
    return str(exe) if exe.exists() else shutil.which("pyinfra") or "pyinfra"


def pyinfra_argv(inventory: str, deploy: str, hosts: Sequence[str], data: Sequence[str]) -> list[str]:
    argv = [pyinfra_executable(), "-y"]
    for item in data:
        argv += ["--data", item]
    argv += [inventory, deploy]
    for host in hosts:  # one --limit per host: pyinfra matches each as a pattern
        argv += ["--limit", host]
    return argv


@dataclass
class BatchRun:
    hosts: list[str]
    returncode: int
    rows: list[HostRow] = field(default_factory=list)


def run_batch(
    index: int, hosts: list[str], inventory: str, deploy: str, data: Sequence[str], out: TextIO = sys.stdout
) -> BatchRun:
    """Converge one batch with the pyinfra CLI, streaming its output; one report row per host."""
    argv = pyinfra_argv(inventory, deploy, hosts, data)
    print(f"\n--> rollout batch {index + 1}: {', '.join(hosts)}", file=out, flush=True)
    print("    " + redact_command(argv), file=out, flush=True)
    fd, record_file = tempfile.mkstemp(prefix="freetoken-rollout-", suffix=".jsonl")
    os.close(fd)
    try:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
            env={**os.environ, RECORD_ENV: record_file},
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
        out.flush()
        returncode = proc.wait()
        records = read_records(record_file)
    finally:
        os.unlink(record_file)
    # Everything comes from the run record, connection errors included (core.records.RunRecords,
    # registered by config.py, which the CLI reads from the working directory): no console text
    # is parsed.
    rows = [
        host_row(
            h, records.get(h, []), batch=index + 1, no_result=f"no result from the deploy (pyinfra exited {returncode})"
        )
        for h in hosts
    ]
    if returncode != 0 and rows and all(r.result == RESULT_OK for r in rows):
        # pyinfra failed although no host reported a failure: trust the exit status.
        why = f"pyinfra exited {returncode} (see the log above)"
        rows = [replace(r, result=RESULT_FAILED, reason=why) for r in rows]
    return BatchRun(hosts, returncode, rows)


BatchRunner = Callable[..., BatchRun]


def drain_batch(gateway: Fleet, hosts: Sequence[str], timeout: float, out=sys.stdout) -> list[str]:
    """Drain `hosts` at the gateway and wait (up to `timeout`) for their running streams to
    finish; the hosts that are behind the gateway."""
    known = {s.host for s in gateway.servers()}
    behind = [h for h in hosts if h in known]
    missing = [h for h in hosts if h not in known]
    if missing:
        print(
            f"--> gateway: {', '.join(missing)} not behind the gateway (re-run deploys/gateway.py)",
            file=out,
            flush=True,
        )
    if behind:
        gateway.drain(behind)
        print(f"--> gateway: draining {', '.join(behind)}", file=out, flush=True)
        busy = gateway.wait_idle(behind, timeout)
        if busy:
            print(f"--> gateway: {', '.join(busy)} still streaming after {timeout:g} s; going on", file=out, flush=True)
    return behind


def ready_batch(gateway: Fleet, behind: Sequence[str], rows: Sequence[HostRow], out=sys.stdout) -> None:
    """Put the batch's hosts whose health gate passed back in service; failed ones stay drained."""
    passed = [r.host for r in rows if r.host in behind and r.result == RESULT_OK]
    failed = [h for h in behind if h not in passed]
    if passed:
        gateway.ready(passed)
        print(f"--> gateway: {', '.join(passed)} ready (in service once their checks pass)", file=out, flush=True)
    if failed:
        print(f"--> gateway: {', '.join(failed)} stay drained (failed)", file=out, flush=True)


def rollout(
    inventory: str,
    batches: list[list[str]],
    max_fail_pct: float = 0.0,
    data: Sequence[str] = (),
    deploy: str = DEFAULT_DEPLOY,
    out: TextIO = sys.stdout,
    run: BatchRunner | None = None,
    gateway: Fleet | None = None,
    drain_timeout: float = 300.0,
) -> tuple[list[HostRow], str | None]:
    """Run the batches in order; (report rows for every host, why it stopped or None).

    Per batch: drain it at the gateway (when there is one), converge it (`run`, the pyinfra
    CLI), put the hosts whose gate passed back, end it with one plain line per host that is not
    ok, then decide whether the rollout goes on (``batch_stops``)."""
    run = run or run_batch
    rows: list[HostRow] = []
    stopped: str | None = None
    for index, hosts in enumerate(batches):
        if stopped:
            rows += [host_row(h, [], batch=index + 1, not_run=f"rollout stopped: {stopped}") for h in hosts]
            continue
        try:
            behind = drain_batch(gateway, hosts, drain_timeout, out) if gateway is not None else []
        except FleetError as exc:
            stopped = f"gateway: {exc}"
            print(f"\n--> rollout stopped: {stopped}", file=out, flush=True)
            rows += [host_row(h, [], batch=index + 1, not_run=f"rollout stopped: {stopped}") for h in hosts]
            continue
        batch = run(index, hosts, inventory, deploy, data, out=out)
        rows += batch.rows
        if gateway is not None:
            try:
                ready_batch(gateway, behind, batch.rows, out)
            except FleetError as exc:
                stopped = f"gateway: {exc} (drained: {', '.join(behind)})"
        end_batch(index, batch.rows, out)
        count = {k: sum(1 for r in batch.rows if r.result == k) for k in RESULTS}
        failed = len(batch.rows) - count[RESULT_OK] - count[RESULT_PARKED] - count[RESULT_REFUSED]
        if index < len(batches) - 1 and not stopped:  # after the last batch nothing is left to stop
            stopped = batch_stops(
                index, failed, len(hosts), max_fail_pct, parked=count[RESULT_PARKED], ok=count[RESULT_OK]
            )
        if stopped:
            print(f"\n--> rollout stopped: {stopped}", file=out, flush=True)
    return rows, stopped


def end_batch(index: int, rows: Sequence[HostRow], out: TextIO) -> None:
    """After pyinfra's own output: one plain line of why for each host that is not ok."""
    lines = [ending_line(r) for r in rows if r.result != RESULT_OK]
    ok = [r.host for r in rows if r.result == RESULT_OK]
    head = f"--> rollout batch {index + 1} ended: " + (f"{', '.join(ok)} ok" if ok else "no host ok")
    print("\n" + head, file=out, flush=True)
    for line in lines:
        print(f"    {line}", file=out, flush=True)


def exit_status(rows: Sequence[HostRow], stopped: str | None) -> int:
    """The rollout's exit status (module docstring): the first of stopped, failed, parked,
    refused that applies, else 0."""
    results = {r.result for r in rows}
    if stopped:
        return EXIT_STOPPED
    if results - {RESULT_OK, RESULT_PARKED, RESULT_REFUSED}:
        return EXIT_FAILED
    if RESULT_PARKED in results:
        return EXIT_PARKED
    if RESULT_REFUSED in results:
        return EXIT_REFUSED
    return EXIT_OK


def exit_meaning(status: int) -> str:
    return {
        EXIT_OK: "every host ok",
        EXIT_FAILED: "some host failed",
        EXIT_STOPPED: "the rollout stopped early",
        EXIT_PARKED: "every reached host converged or was refused; some hosts are parked (unreachable)",
        EXIT_REFUSED: "every reached host converged or was refused at preflight; none is parked",
    }[status]


# --------------------------------------------------------------------------- report files
def reports_dir() -> Path:
    """Where a rollout without ``--json`` writes its report (on the controller)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "freetoken-infra" / "rollouts"


def default_report_path(now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    path = reports_dir() / f"rollout-{stamp}.json"
    n = 1
    while path.exists():  # two rollouts in one second
        n += 1
        path = reports_dir() / f"rollout-{stamp}-{n}.json"
    return path


# A report says which hosts to converge and with which --data: a catch-up replays it, so it must
# be one this controller's rollout wrote. Each report carries an HMAC-SHA256 over its content
# under a key only the operator's account can read (REPORT_KEY_NAME beside the reports, 0600,
# made on first use). Chosen over trusting the file's owner, mode or folder: a report may be
# written anywhere (--json FILE) and copied, and whoever can edit it but not read the key
# cannot make a signature that matches; stdlib only, one small file of state.
REPORT_KEY_NAME = ".report-key"
SIGNATURE = "signature"


def _read_own_file(path: Path, what: str, remedy: str, *, encoding: str, limit: int = -1) -> str | None:
    """The text of `path` (at most `limit` characters), a file that only this user may read or
    write (None: there is none). RolloutError naming `what` when it cannot be read or is not
    this user's alone; `remedy` says what comes of removing it. No link is followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RolloutError(f"{what} {path} cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, encoding=encoding, errors="replace") as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise RolloutError(
                f"{what} {path} is not this user's alone (owner uid {info.st_uid}, mode "
                f"{info.st_mode & 0o777:o}); remove it: {remedy}"
            )
        return f.read(limit)


def report_key(create: bool) -> bytes:
    """This controller's report key (``reports_dir()/.report-key``); made (0600, in a 0700
    folder) when `create` and missing. RolloutError when it is missing (not `create`), not ours,
    or readable by others (anyone who could read it could forge a report)."""
    folder = reports_dir()
    path = folder / REPORT_KEY_NAME
    if create and not path.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass  # another rollout made it just now
        else:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(os.urandom(32).hex() + "\n")
    text = _read_own_file(path, "the report key", "the next rollout makes a new one", encoding="ascii")
    if text is None:
        raise RolloutError(f"no report key at {path}: no rollout of this controller signed a report yet")
    text = text.strip()
    if len(text) < 32:
        raise RolloutError(f"the report key {path} is damaged; remove it: the next rollout makes a new one")
    return text.encode("ascii", "replace")


# A signature proves who wrote a report, not that it is the one to replay: an older signed report
# put in front (touched, copied back from a backup) would bring back its --data and its hosts'
# speeds. So each report carries its run id and creation time inside the signed content, and the
# controller keeps one small record, beside the key, of the newest report it applied (wrote, or
# replayed in a catch-up): a catch-up refuses a report older than that, and the gateway's weights
# order reports by their signed time, never by a file's mtime. Times are stamped under a lock on
# the reports folder and never before the record's (a clock set back cannot make a new report
# look older than the last one). No age bound: a catch-up of PCs that were away for weeks is
# legitimate, and the record already refuses every report but the newest.
APPLIED_NAME = ".newest-applied"
RUN_ID = "run_id"
CREATED = "created_utc"
_RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
_CREATED_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
_CREATED_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@dataclass(frozen=True)
class ReportStamp:
    """Which run wrote a report, and when (UTC): signed with the rest of the report."""

    run_id: str
    created: datetime

    @property
    def created_utc(self) -> str:
        return self.created.strftime(_CREATED_FORMAT)

    @classmethod
    def of(cls, doc: Any) -> ReportStamp | None:
        """The stamp of a report (or of the applied record), None when it has none of this shape."""
        if not isinstance(doc, dict):
            return None
        run_id, created = doc.get(RUN_ID), doc.get(CREATED)
        if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id):
            return None
        if not isinstance(created, str) or not _CREATED_RE.fullmatch(created):
            return None
        try:
            when = datetime.strptime(created, _CREATED_FORMAT).replace(tzinfo=timezone.utc)
        except ValueError:
            return None
        return cls(run_id, when)

    def describe(self) -> str:
        return f"run {self.run_id}, created {self.created_utc}"


@dataclass(frozen=True)
class Applied:
    """The newest report this controller applied: its stamp and where it was."""

    stamp: ReportStamp
    report: str


@contextlib.contextmanager
def _reports_lock() -> Iterator[None]:
    """One rollout at a time stamps a report and moves the applied record (flock on the folder)."""
    folder = reports_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def newest_applied() -> Applied | None:
    """The record of the newest report this controller applied (None: none yet). RolloutError
    when it is not this user's alone or damaged (remove it: the next rollout writes a new one)."""
    path = reports_dir() / APPLIED_NAME
    what = "the record of the newest applied report"
    text = _read_own_file(path, what, "the next rollout writes a new one", encoding="utf-8", limit=4096)
    if text is None:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    stamp = ReportStamp.of(doc)
    if stamp is None or not isinstance(doc.get("report"), str):
        raise RolloutError(
            f"the record of the newest applied report {path} is damaged; remove it: the next rollout writes a new one"
        )
    return Applied(stamp, doc["report"])


def _write_applied(stamp: ReportStamp, report: Path) -> None:
    """Record `stamp` as the newest applied, atomically (0600, renamed over the old record);
    call under ``_reports_lock``. An older stamp changes nothing."""
    current = newest_applied()
    if current is not None and current.stamp.created >= stamp.created:
        return
    folder = reports_dir()
    text = json.dumps({RUN_ID: stamp.run_id, CREATED: stamp.created_utc, "report": str(report.absolute())})
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f"{APPLIED_NAME}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / APPLIED_NAME)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def note_applied(stamp: ReportStamp, report: Path) -> None:
    """A catch-up replays `report`: from now on no older report is replayed."""
    with _reports_lock():
        _write_applied(stamp, report)


def report_signature(doc: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in doc.items() if k != SIGNATURE}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def write_report(path: Path, doc: dict[str, Any]) -> ReportStamp:
    """Write the report, stamped (a new run id, now: never before the newest applied report's
    time) and signed (``report_signature``: the stamp inside), atomically (a catch-up may read it
    while another rollout writes) and 0600 (its --data may hold a credential in a URL); then it
    is the newest applied report (its rollout applied its --data)."""
    key = report_key(create=True)
    with _reports_lock():
        now = datetime.now(timezone.utc)
        applied = newest_applied()
        if applied is not None and now <= applied.stamp.created:
            now = applied.stamp.created + timedelta(microseconds=1)
        stamp = ReportStamp(uuid.uuid4().hex, now)
        stamped = {**doc, RUN_ID: stamp.run_id, CREATED: stamp.created_utc}
        signed = {**stamped, SIGNATURE: report_signature(stamped, key)}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(signed, indent=1) + "\n")
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _write_applied(stamp, path)
    return stamp


def newest_report() -> Path:
    """The report file changed last (its mtime: anyone who can touch it moves it here, so what
    it holds is checked by ``load_report``: signature, then its signed time)."""
    found = sorted(reports_dir().glob("rollout-*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RolloutError(f"--from last: no rollout report in {reports_dir()} yet")
    return found[-1]


def measured_decode_tps(newest: int = 50) -> dict[str, float]:
    """Each host's decode tok/s as its last passed health gate measured it, from the newest of
    this controller's rollout reports that has it (an ``ok`` row with a tok/s): what the gateway
    weighs hosts by (deploys/gateway.py). Only reports whose signature holds count, newest by
    their signed creation time (a file's mtime puts no older report in front); a report without
    a signed time (written before reports carried one) counts for nothing. None yet: {}."""
    found = []
    for path in reports_dir().glob("rollout-*.json"):
        try:
            doc, stamp = _verified_report(path, str(path))
        except RolloutError:
            continue  # not ours, damaged, unstamped, or no key yet: it steers nothing
        found.append((stamp.created, path, doc))
    out: dict[str, float] = {}
    for _, path, doc in sorted(found, key=lambda item: item[0], reverse=True)[:newest]:
        try:
            rows = report_rows(doc, str(path))
        except RolloutError:
            continue
        for row in rows:
            if row.result == RESULT_OK and row.tokens_per_s is not None:
                out.setdefault(row.host, row.tokens_per_s)
    return out


def parse_only(spec: str) -> list[str]:
    """``--only parked,failed`` -> the results to select; RolloutError on an unknown one."""
    wanted = [part.strip().replace("-", " ") for part in spec.split(",") if part.strip()]
    unknown = [w for w in wanted if w not in RESULTS]
    if not wanted or unknown:
        names = ", ".join(r.replace(" ", "-") for r in RESULTS)
        raise RolloutError(f"--only {spec!r}: give results from {names}")
    return wanted


def _verified_report(path: Path, source: str) -> tuple[dict[str, Any], ReportStamp]:
    """A report this controller's rollout wrote: read, its signature checked, then its signed
    stamp (run id, creation time); RolloutError otherwise, in one line."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RolloutError(f"--from {source}: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise RolloutError(f"--from {source}: {path} is not a rollout report: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("hosts"), list):
        raise RolloutError(f"--from {source}: {path} is not a rollout report (no host rows)")
    signature = doc.get(SIGNATURE)
    try:
        key = report_key(create=False)
    except RolloutError as exc:
        raise RolloutError(f"--from {source}: {path} cannot be checked, {exc}; nothing was run") from None
    if not isinstance(signature, str) or not hmac.compare_digest(signature, report_signature(doc, key)):
        raise RolloutError(
            f"--from {source}: {path} is not a report this controller's rollout wrote (its signature "
            f"does not match the key in {reports_dir()}); nothing was run"
        )
    stamp = ReportStamp.of(doc)
    if stamp is None:
        raise RolloutError(
            f"--from {source}: {path} carries no signed run id and creation time (a rollout before "
            "they were signed wrote it), so it cannot be told from an older report put in its place; "
            "run the rollout again (it catches up by itself: converged hosts pass unchanged); nothing was run"
        )
    return doc, stamp


def load_report(source: str) -> tuple[Path, dict[str, Any]]:
    """The report a catch-up replays (`source`: a file or ``last``): ours (signed), stamped, its
    rows well-formed, and no older than the newest report this controller applied (an older
    one, however signed, would bring back settings and hosts a later rollout replaced)."""
    path = newest_report() if source == "last" else Path(source)
    doc, stamp = _verified_report(path, source)
    applied = newest_applied()
    if applied is not None and (
        stamp.created < applied.stamp.created
        or (stamp.created == applied.stamp.created and stamp.run_id != applied.stamp.run_id)
    ):
        raise RolloutError(
            f"--from {source}: {path} ({stamp.describe()}) is older than the newest report this "
            f"controller applied, {applied.report} ({applied.stamp.describe()}); a catch-up "
            "replays no older report (its --data and hosts would undo a later rollout); "
            f"catch up from {applied.report}, or run the rollout again; nothing was run"
        )
    report_rows(doc, source)  # every row checked before anything of the report is used
    return path, doc


def replayed_options(doc: dict[str, Any], source: str) -> dict[str, Any]:
    """What a catch-up takes from its report: the batches, the max-fail-pct and the --data items
    the rollout decided, each checked for its type (the --data keys and values are then checked
    like any --data: ``parse_data``, ``load_hosts``)."""
    out: dict[str, Any] = {}
    batches, pct, data = doc.get("batches_spec"), doc.get("max_fail_pct"), doc.get("data")
    if batches is not None:
        if not isinstance(batches, str):
            raise RolloutError(f"--from {source}: batches_spec {batches!r} is not a text")
        out["batches"] = batches
    if pct is not None:
        if isinstance(pct, bool) or not isinstance(pct, (int, float)):
            raise RolloutError(f"--from {source}: max_fail_pct {pct!r} is not a number")
        out["max_fail_pct"] = float(pct)
    if data is not None:
        if not isinstance(data, list) or not all(isinstance(item, str) for item in data):
            raise RolloutError(f"--from {source}: data {data!r} is not a list of KEY=VALUE texts")
        parse_data(data)  # settings keys only, before anything else is done
        out["data"] = list(data)
    return out


def replay_line(path: Path, doc: dict[str, Any], taken: dict[str, Any]) -> str:
    """One line: the report a catch-up replays (its run and time) and the options it takes from
    it, each --data item as the rollout will pass it, a secret value masked."""
    stamp = ReportStamp.of(doc)
    argv = []
    if "batches" in taken:
        argv += ["--batches", taken["batches"]]
    if "max_fail_pct" in taken:
        argv += ["--max-fail-pct", f"{taken['max_fail_pct']:g}"]
    for item in taken.get("data", []):
        argv += ["--data", item]
    what = redact_command(argv) if argv else "nothing (every option given again)"
    return f"--> replaying {path} ({stamp.describe() if stamp else 'unstamped'}): {what}"


def report_rows(doc: dict[str, Any], source: str) -> list[HostRow]:
    """A report's host rows (``load_report``'s document), each checked field by field: the file
    is signed, but a row the rollout did not write is refused all the same, in one line."""
    rows = []
    for i, entry in enumerate(doc["hosts"]):
        try:
            rows.append(HostRow.from_dict(entry, f"hosts[{i}]"))
        except HostRowError as exc:
            raise RolloutError(f"--from {source}: not a rollout report's host row: {exc}; nothing was run") from None
    return rows


def select_hosts(doc: dict[str, Any], only: Sequence[str], inventory_hosts: Sequence[str], source: str) -> list[str]:
    """The hosts of a report whose result is one of `only`, as they are in the inventory now."""
    chosen = [r.host for r in report_rows(doc, source) if r.result in only]
    gone = [h for h in chosen if h not in inventory_hosts]
    if gone:
        raise RolloutError(f"--from {source}: {', '.join(gone)} not in the inventory (now)")
    return chosen


def gateway_of(inventory: str, data: dict) -> Fleet | None:
    """The inventory's gateway (None: it has none); RolloutError when it cannot be reached, since
    rolling out behind it without draining would fail clients' requests."""
    try:
        gateway = Fleet.from_inventory(inventory, data)
    except FleetError:
        return None  # no gateway group (a bad inventory was reported by load_hosts already)
    try:
        gateway.servers()
    except FleetError as exc:
        raise RolloutError(f"the gateway cannot be reached to drain batches: {exc}") from None
    return gateway


PROG = "python -m freetoken_infra.rollout"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The command line of ``main``; ``freetoken rollout`` (freetoken_infra/cli.py) shows the same."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Converge a fleet canary first, then in batches, each gated on the health gate; "
        "print the fleet report.",
    )
    ap.add_argument("inventory", help="pyinfra inventory, e.g. inventories/fleet.py")
    ap.add_argument(
        "--batches",
        default=DEFAULT_BATCHES,
        help="batch sizes, counts or percentages of all hosts; the first batch is the canary, "
        # argparse formats help with %: a literal one is doubled
        f"the last size repeats (default {DEFAULT_BATCHES.replace('%', '%%')})",
    )
    ap.add_argument("--canary", default="", help="comma-separated hosts forming the canary batch")
    ap.add_argument(
        "--max-fail-pct",
        type=float,
        default=0.0,
        help="a batch after the canary stops the rollout when more than this percent of its hosts failed (default 0)",
    )
    ap.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting for every host, as pyinfra's --data",
    )
    ap.add_argument("--limit", default="", help="comma-separated hosts: roll out to these only")
    ap.add_argument("--deploy", default=DEFAULT_DEPLOY, help=f"deploy file (default {DEFAULT_DEPLOY})")
    ap.add_argument(
        "--json",
        dest="json_file",
        help="write the fleet report as JSON to this file (default: a new file under "
        "$XDG_STATE_HOME/freetoken-infra/rollouts/, printed at the end)",
    )
    ap.add_argument(
        "--from",
        dest="from_report",
        metavar="REPORT",
        help="catch up: roll out to the hosts of this earlier report (a file, or 'last' for "
        "the newest under $XDG_STATE_HOME/freetoken-infra/rollouts/) whose result is one "
        "of --only; its --batches, --max-fail-pct and --data apply unless given again",
    )
    ap.add_argument(
        "--only",
        metavar="RESULT,...",
        help=f"with --from: the results to catch up (default {DEFAULT_ONLY}; any of "
        f"{', '.join(r.replace(' ', '-') for r in RESULTS)})",
    )
    ap.set_defaults(batches=None, max_fail_pct=None, data=None)
    ap.add_argument(
        "--drain-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help=f"behind a gateway (group '{GATEWAY_GROUP}'): wait up to S seconds for a drained "
        "batch's streams to finish (default 300)",
    )
    return ap


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(argv)
    # option -> (its default, its key in a report): a catch-up reuses the report's
    defaults = {
        "batches": (DEFAULT_BATCHES, "batches_spec"),
        "max_fail_pct": (0.0, "max_fail_pct"),
        "data": ([], "data"),
    }
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    source: Path | None = None
    try:
        if args.only and not args.from_report:
            raise RolloutError("--only needs --from REPORT (the rollout report whose hosts to catch up)")
        newest_applied()  # a record that is not ours stops here, before any host is touched
        if args.from_report:
            source, earlier = load_report(args.from_report)
            replayed = replayed_options(earlier, args.from_report)
            taken = []
            for key in defaults:  # its batches and gates, unless given again
                if getattr(args, key) is None and key in replayed:
                    setattr(args, key, replayed[key])
                    taken.append(key)
            # What the report brings back, before anything runs (a credential in a URL masked).
            print(replay_line(source, earlier, {k: replayed[k] for k in taken}), flush=True)
        for key, (value, _) in defaults.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if not 0 <= args.max_fail_pct <= 100:
            raise RolloutError(f"--max-fail-pct {args.max_fail_pct:g}: give a percentage from 0 to 100")
        sizes = parse_batch_sizes(args.batches)
        hosts = load_hosts(args.inventory, parse_data(args.data), split(args.limit))
        if source is not None:
            only = parse_only(args.only or DEFAULT_ONLY)
            chosen = select_hosts(earlier, only, hosts, args.from_report)
            print(f"--> catch-up of {source}: {', '.join(chosen) or 'no host'} ({' or '.join(only)} there)", flush=True)
            if not chosen:
                print("nothing to catch up", flush=True)
                return EXIT_OK
            hosts = chosen
            stamp = ReportStamp.of(earlier)  # load_report refused a report without one
            if stamp is not None:
                note_applied(stamp, source)  # no older report is replayed from now on
        batches = plan_batches(hosts, sizes, split(args.canary))
        report_path = Path(args.json_file) if args.json_file else default_report_path()
        gateway = gateway_of(args.inventory, parse_data(args.data))
    except RolloutError as exc:
        print(f"rollout: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(
        "--> rollout plan: "
        + " | ".join(f"{'canary' if i == 0 else f'batch {i + 1}'}: {', '.join(b)}" for i, b in enumerate(batches)),
        flush=True,
    )

    rows, stopped = rollout(
        args.inventory,
        batches,
        args.max_fail_pct,
        args.data,
        args.deploy,
        gateway=gateway,
        drain_timeout=args.drain_timeout,
    )

    print("\n" + format_fleet_report(rows), flush=True)
    if stopped:
        print(f"rollout stopped: {stopped}", flush=True)
    status = exit_status(rows, stopped)
    doc = {
        "inventory": args.inventory,
        "batches": batches,
        "stopped": stopped,
        "hosts": [r.to_dict() for r in rows],
        # what a catch-up (--from) reuses: the options as given
        "batches_spec": args.batches,
        "max_fail_pct": args.max_fail_pct,
        "data": list(args.data),
        "caught_up_from": str(source) if source else None,
        "summary": fleet_counts(rows),
        "exit_status": status,
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    write_report(report_path, doc)
    print(f"report: {report_path}", flush=True)
    behind = [k for k in (RESULT_PARKED, RESULT_FAILED, RESULT_NOT_RUN) if any(r.result == k for r in rows)]
    if behind:
        catch_up = ",".join(dict.fromkeys([*parse_only(DEFAULT_ONLY), *behind])).replace(" ", "-")
        print(
            f"catch up later: python -m freetoken_infra.rollout {args.inventory} --only {catch_up} --from {report_path}",
            flush=True,
        )
    print(f"exit status {status}: {exit_meaning(status)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
