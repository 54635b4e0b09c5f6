"""The run record: what a deploy run saw and did, per host, as JSON lines.

The deploy appends records to the file named by $FREETOKEN_RUN_RECORD (set by the rollout;
nothing is recorded without it): what the facts saw at preflight (``Observed``), the health
gate's result (``core.gate_record.GateResult``), a rollback, a connection lost, failed
operations, and at disconnect whether pyinfra failed the host and how many operations changed
something. Each line is one ``RunRecord`` (``to_json``/``from_json``, one round trip); the
operations write them, the report and the rollout read them: one structured path, no console
text scraped.

A rollout turns each host's records into one ``HostRow`` (``report.host_row``): a line of its
fleet report and an entry of the signed report file it writes (``to_dict``/``from_dict``, one
round trip), which a catch-up reads back.

Within the run, the same results live on one object attached to the run's pyinfra State
(``RunRecords``), never in module globals.
"""

from __future__ import annotations

import json
import math
import os
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

import click
from pyinfra.api.state import BaseStateCallback

from freetoken_infra.core.gate_record import GateResult
from freetoken_infra.core.pyinfra_internals import (
    callback_handler,
    changed_operations,
    connection_lost,
    is_active,
    reached_host_names,
)

RECORD_ENV = "FREETOKEN_RUN_RECORD"


# A blocker of the preflight as a host's record keeps it: (check, evidence, remedy), plain text.
Refusal = tuple[str, str, str]


@dataclass(frozen=True)
class Unchanged:
    """The host's converge record stood (operations/host_lock.py): every input of every fact its
    last converge read reads as it did then, and the controller's fingerprint is the same.
    ``refused``: the record is of a run the preflight refused, by these standing blockers."""

    host_name: str
    inputs: int
    refused: tuple[Refusal, ...] = ()


class RunRecordError(ValueError):
    """A run record line that is not one the deploy writes."""


class HostRowError(ValueError):
    """A fleet report row that is not one the rollout writes."""


@dataclass(frozen=True)
class Rollback:
    """A failed upgrade switched back: ``from_version`` (JSON ``from``) to ``to``; ``ok``: the
    old version passed its gate again."""

    from_version: str = field(metadata={"json": "from"})
    to: str
    reason: str
    ok: bool
    error: str | None = None


@dataclass(frozen=True)
class Lost:
    """The host's connection dropped during ``step``."""

    step: str


@dataclass(frozen=True)
class Finished:
    """At disconnect: whether pyinfra failed the host, how many operations changed something."""

    failed: bool
    changes: int = 0


@dataclass(frozen=True)
class HealthSeen:
    """The engine's ``/health`` before the run (``status`` "down" when it did not answer)."""

    status: str | None = None
    version: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Observed:
    """What the preflight saw on a host (``report.record_host``); ``health`` and ``last_gate``
    only on a host it let on."""

    gpu: str | None = None
    vram_mib: int | None = None
    wsl_version: str | None = None
    wsl_kind: str | None = None
    engine_active: str | None = None
    engine_version: str | None = None
    model: str | None = None
    blockers: tuple[str, ...] = ()
    restart_only: bool = False
    health: HealthSeen | None = None
    last_gate: GateResult | None = None
    restart_pending: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    """One line of the run record: a host and what one event said of it."""

    host: str
    observed: Observed | None = None
    gate: GateResult | None = None
    rollback: Rollback | None = None
    lost: Lost | None = None
    unreachable: str | None = None
    op_error: str | None = None
    finished: Finished | None = None
    restart_pending: tuple[str, ...] = ()  # Windows-side files whose change waits for a WSL restart

    def to_json(self) -> str:
        doc = _dump(self)
        return json.dumps({k: v for k, v in doc.items() if v not in (None, [])})

    @classmethod
    def from_json(cls, text: str) -> RunRecord:
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise RunRecordError(f"not JSON ({exc})") from None
        return cls.from_dict(doc)

    @classmethod
    def from_dict(cls, doc: Any) -> RunRecord:
        entry: RunRecord = _load(cls, doc, "run record")
        return entry


# --------------------------------------------------------------------------- the fleet report's row
RESULT_OK, RESULT_FAILED, RESULT_NOT_RUN = "ok", "failed", "not run"
# A host pyinfra could not connect to (a PC that is off tonight): nothing was done on it, it is
# no failure of the rollout, and a catch-up run converges it later.
RESULT_PARKED = "parked"
# A host the preflight stopped before any change (a blocker such as an old WSL): nothing was done.
RESULT_REFUSED = "refused"
RESULTS = (RESULT_OK, RESULT_PARKED, RESULT_REFUSED, RESULT_FAILED, RESULT_NOT_RUN)
# Results of a row where the deploy changed nothing on the host: its "what we did" columns
# (model, health, tok/s, restart) say "-".
UNTOUCHED = (RESULT_PARKED, RESULT_REFUSED, RESULT_NOT_RUN)


@dataclass(frozen=True, kw_only=True)
class HostRow:
    """One host's row of a rollout's fleet report (``report.host_row``): a line of the table and
    an entry of the report file's ``hosts``, whose JSON keys are the field names, in this order.

    ``result`` is one of ``RESULTS`` and ``reason`` says why; ``model``, ``health``, the tok/s and
    ``restart_pending`` are None ("-") where the deploy did nothing on the host;
    ``tokens_per_s_source`` is "this run" or "last gate"."""

    host: str
    batch: int | None = None
    gpu: str | None = None
    vram_gb: int | None = None
    wsl_version: str | None = None
    engine_version: str | None = None
    model: str | None = None
    health: str | None = None
    tokens_per_s: float | None = None
    tokens_per_s_source: str | None = None
    restart_pending: bool | None = None
    restart_pending_files: tuple[str, ...] = ()
    result: str
    reason: str = ""
    changes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as the report file keeps it (every key, None as null)."""
        doc: dict[str, Any] = _dump(self)
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str = "host row") -> HostRow:
        """A row read back from a report file, every field's type checked (keys it does not know
        are ignored); HostRowError naming the first field that is wrong."""
        try:
            row: HostRow = _load(cls, doc, where)
        except RunRecordError as exc:
            raise HostRowError(str(exc)) from None
        if row.result not in RESULTS:
            raise HostRowError(f"{where}: result: {_short(row.result)} is not one of {', '.join(RESULTS)}")
        return row


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _json_name(f: Any) -> str:
    return str(f.metadata.get("json", f.name))


def _dump(value: Any) -> Any:
    if isinstance(value, GateResult):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return {_json_name(f): _dump(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (tuple, list)):
        return [_dump(v) for v in value]
    return value


def _load(cls: Any, doc: Any, where: str) -> Any:
    """A record dataclass from its JSON document, every field's type checked."""
    if not isinstance(doc, dict):
        raise RunRecordError(f"{where}: not a JSON object")
    hints = get_type_hints(cls)
    values = {}
    for f in fields(cls):
        name = _json_name(f)
        if name in doc:
            values[f.name] = _typed(hints[f.name], doc[name], f"{where}: {name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise RunRecordError(f"{where}: {name}: missing")
    return cls(**values)


def _typed(kind: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (kind,) = [a for a in args if a is not type(None)]
        return _typed(kind, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise RunRecordError(f"{where}: not a list")
        return tuple(_typed(args[0], v, where) for v in value)
    if kind is GateResult:
        try:
            return GateResult.from_dict(value, where)
        except ValueError as exc:
            raise RunRecordError(str(exc)) from None
    if is_dataclass(kind):
        return _load(kind, value, where)
    number = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, number):
        raise RunRecordError(f"{where}: not {getattr(kind, '__name__', kind)}")
    if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN and Infinity
        raise RunRecordError(f"{where}: not a finite number")
    return value


def write(entry: RunRecord) -> None:
    """Append ``entry`` to $FREETOKEN_RUN_RECORD (no-op when unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(entry.to_json() + "\n")


def record(host_name: str, **fields: Any) -> None:
    """Append one record for `host_name` (``RunRecord``'s fields) to $FREETOKEN_RUN_RECORD."""
    write(RunRecord(host_name, **fields))


def read_records(path: str) -> dict[str, list[RunRecord]]:
    """The records of one deploy run, by host (a torn last line, or any line that is not a
    record, is left out)."""
    by_host: dict[str, list[RunRecord]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return by_host
    for line in lines:
        try:
            entry = RunRecord.from_json(line)
        except RunRecordError:
            continue
        by_host.setdefault(entry.host, []).append(entry)
    return by_host


def lost_line(host_name: str, step: str) -> str:
    """The one line a run prints for a host whose connection dropped."""
    return f"{host_name}: connection lost during {step}; re-run to finish"


def first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0] if lines else ""


class RunRecords(BaseStateCallback):
    """What one pyinfra run learns, kept on the run itself: the one callback handler of the
    report, registered on the run's State (``RunRecords.of(state)``), so that two runs in one
    process never share results (no module-level result state).

    It holds every host's settings (validated once), the preflight's record of each host, the
    health gate's results and each host's previous gate, and what pyinfra's callbacks say: an
    operation that failed, a connection lost, a host it could not connect to, a host done. The
    same events go to the run record file ($FREETOKEN_RUN_RECORD) a rollout reads. When every
    host of the run is done, the functions in ``at_end`` run (the health gate's table, which the
    preflight registers).
    """

    def __init__(self) -> None:
        self.settings: dict[str, Any] | None = None  # host name -> Settings (preflight.fleet_settings)
        self.fleet_fingerprint: str | None = None  # what every host's fingerprint shares (preflight)
        self.preflight: dict[str, Any] = {}  # host name -> rules.HostPreflight
        self.summary_printed = False
        self.gates: dict[str, GateResult] = {}  # host name -> this run's gate result
        self.last_gates: dict[str, GateResult | None] = {}  # host name -> its previous gate record
        self.failed_ops: dict[str, list[str]] = {}
        self.lost: dict[str, str] = {}  # host name -> the step during which its connection dropped
        self.answered: dict[str, str] = {}  # host name -> how its record answered (the fast check)
        self.done: set[str] = set()
        self.at_end: list[Callable[[RunRecords, Any], None]] = []

    @classmethod
    def of(cls, state: Any) -> RunRecords:
        """This run's records (created and registered on the first call)."""
        return callback_handler(state, cls)

    def when_done(self, report: Callable[[RunRecords, Any], None]) -> None:
        """Call ``report(self, state)`` once every host of the run is done (once per function)."""
        if report not in self.at_end:
            self.at_end.append(report)

    # pyinfra declares its callbacks as static methods; ours keep state on the instance.
    def host_connect_error(self, state: Any, host: Any, error: Any) -> None:  # type: ignore[override]
        """A host pyinfra could not connect to, with its reason (parked in a rollout's report)."""
        reason = error.args[0] if getattr(error, "args", None) else error
        record(host.name, unreachable=first_line(reason) or "could not connect")

    def operation_host_error(  # type: ignore[override]
        self, state: Any, host: Any, op_hash: Any, retry_count: int = 0, max_retries: int = 0
    ) -> None:
        names = sorted(state.get_op_meta(op_hash).names) or ["an operation"]
        if self.preflight:
            record(host.name, op_error=", ".join(names))
        self.failed_ops.setdefault(host.name, []).extend(names)
        # A step other than the gate lost the connection: pyinfra logged the socket error; the
        # run says what it means, once, and the fleet report gets the reason.
        gate = self.gates.get(host.name)
        if self.last_gates and connection_lost(host) and not (gate and gate.cut_off) and host.name not in self.lost:
            self.lost_during(host.name, "; ".join(names))

    def lost_during(self, host_name: str, step: str, say: bool = True) -> str:
        """The host's connection dropped during ``step``: kept for the gate table, written for
        the fleet report, and (``say``) printed as its one line. Returns that line."""
        self.lost[host_name] = step
        record(host_name, lost=Lost(step))
        line = lost_line(host_name, step)
        if say:
            click.echo(line, err=True)
        return line

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        if self.preflight:
            changes = changed_operations(state, host)
            record(host.name, finished=Finished(not is_active(state, host), changes))
        self.done.add(host.name)
        if reached_host_names(state) <= self.done:
            for report in self.at_end:
                report(self, state)
