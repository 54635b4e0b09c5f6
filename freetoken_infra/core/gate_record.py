"""The health gate's result and the host's gate record: one schema, one JSON round trip.

Stdlib only, because the same schema is used in two places (as ``manifest.py`` is):

- on the target, by ``operations/scripts/health_gate.py`` (this file is uploaded beside it,
  ``layout.GATE_RECORD_MODULE``), which prints its result as ``GateResult.to_json()``;
- on the controller, by ``operations/health.py`` (the script's last line, the record it keeps
  on the host), the plan (``why_gate``, ``rollback_target``), the preflight (the record before
  the run) and the reports.

What comes back from a host is untrusted text: ``from_json`` checks the type of every field it
knows and raises ``GateRecordError`` (a ``ValueError``) naming the first field that is wrong;
fields it does not know are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

# Where the gate stopped: the script's phases, "started" (the record a gate leaves before it
# runs), and what the controller says of a gate whose connection dropped.
PHASE_STARTED = "started"
NOT_FINISHED = "the gate did not finish (the run was cut off)"  # the error of a "started" record
CUT_OFF = "cut off"
# What to do when a gate fails in each phase (the operation's error says it).
REMEDY = {
    "health": "see the engine's journal below; `systemctl status freetoken` and "
    "`pyinfra INVENTORY deploys/doctor.py` help, and a slow first start may need a "
    "larger health_timeout_s",
    "chat": "the engine is up but does not answer a chat; a 401 means the key file does not "
    "match the key the engine was started with (restart the service after a key change)",
    "stream": "the engine answers plain chats but not streamed ones; see the journal below",
    "answer": "the engine answers, but wrongly: broken kernels or a damaged model file; re-verify the model "
    "(`--data model_reverify=true`) and see the journal below",
    "version": "another run (or a person) switched the engine while this run gated it; re-run once the "
    "other run is done",
}
# More than any record the gate writes (its error holds at most a few output lines).
MAX_TEXT = 1 << 20


class GateRecordError(ValueError):
    """A gate result or record that is not what the gate writes."""


def _check(doc: dict[str, Any], name: str, kinds: tuple[type, ...], where: str) -> Any:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds:  # JSON true is no number
        raise GateRecordError(f"{where}: {name} must be {' or '.join(k.__name__ for k in kinds)}, not a boolean")
    if not isinstance(value, kinds):
        raise GateRecordError(
            f"{where}: {name} must be {' or '.join(k.__name__ for k in kinds)}, not {type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise GateRecordError(f"{where}: {name} must be a finite number, not {value}")
    return value


def _object(text: str, where: str) -> dict[str, Any]:
    if not isinstance(text, str):
        raise GateRecordError(f"{where}: not text")
    if len(text) > MAX_TEXT:
        raise GateRecordError(f"{where}: {len(text)} characters, more than a gate record holds")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise GateRecordError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise GateRecordError(f"{where}: not a JSON object")
    return doc


@dataclass(frozen=True)
class Gated:
    """What a passed gate proved: the engine version, the unit and its environment (hashes), the
    model revision, the launch command line and the model manifest's hash. A run skips its gate
    only when all of them are the same (``plan.why_gate``)."""

    engine_version: str | None = None
    unit_sha256: str | None = None
    environment_sha256: str | None = None
    model: str | None = None
    launch: tuple[str, ...] | None = None
    manifest_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["launch"] = list(self.launch) if self.launch is not None else None
        return doc

    @classmethod
    def from_dict(cls, doc: Any, where: str = "gated") -> Gated:
        if not isinstance(doc, dict):
            raise GateRecordError(f"{where}: not a JSON object")
        launch = _check(doc, "launch", (list,), where)
        if launch is not None and not all(isinstance(a, str) for a in launch):
            raise GateRecordError(f"{where}: launch must be a list of strings")
        text = {f.name: _check(doc, f.name, (str,), where) for f in fields(cls) if f.name != "launch"}
        return cls(**text, launch=tuple(launch) if launch is not None else None)

    def differs(self, other: Gated) -> list[str]:
        """The names of the fields in which ``other`` is not the same, sorted."""
        return sorted(f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name))


@dataclass(frozen=True)
class GateResult:
    """One gate's result, and the host's gate record (the same fields, plus what it gated).

    The script's: ``ok``, ``phase`` (where it stopped; "done" when all passed), ``load_wait_s``,
    ``decode_tps``, ``completion_tokens``, ``error``, ``version`` (what ``/health`` reported once
    ok), ``question`` and ``answer``. The controller's: ``decode_floor_tps`` (for the table),
    ``cut_off`` (the connection dropped), ``rolled_back_from``. The record's: ``gated``, ``at``
    and ``last_passed`` (the host's last passed gate, kept in a later failed one's record).
    """

    ok: bool = False
    phase: str | None = None
    load_wait_s: float | None = None
    decode_tps: float | None = None
    completion_tokens: int | None = None
    error: str | None = None
    version: str | None = None
    question: str | None = None
    answer: str | None = None
    decode_floor_tps: float | None = None
    cut_off: bool = False
    rolled_back_from: str | None = None
    gated: Gated | None = None
    at: str | None = None
    last_passed: GateResult | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["gated"] = self.gated.to_dict() if self.gated is not None else None
        doc["last_passed"] = self.last_passed.to_dict() if self.last_passed is not None else None
        return doc

    def to_json(self) -> str:
        """One line of JSON (what the script prints last, what the record file holds)."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str, where: str = "gate result") -> GateResult:
        return cls.from_dict(_object(text, where), where)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "gate result", nested: bool = False) -> GateResult:
        if not isinstance(doc, dict):
            raise GateRecordError(f"{where}: not a JSON object")
        ok = doc.get("ok")
        if not isinstance(ok, bool):
            raise GateRecordError(f"{where}: ok must be true or false, not {json.dumps(ok)[:40]}")
        number = (int, float)
        last = doc.get("last_passed")
        if last is not None and nested:
            raise GateRecordError(f"{where}: a last passed gate holds no last passed gate of its own")
        gated = doc.get("gated")
        return cls(
            ok=ok,
            phase=_check(doc, "phase", (str,), where),
            load_wait_s=_check(doc, "load_wait_s", number, where),
            decode_tps=_check(doc, "decode_tps", number, where),
            completion_tokens=_check(doc, "completion_tokens", (int,), where),
            error=_check(doc, "error", (str,), where),
            version=_check(doc, "version", (str,), where),
            question=_check(doc, "question", (str,), where),
            answer=_check(doc, "answer", (str,), where),
            decode_floor_tps=_check(doc, "decode_floor_tps", number, where),
            cut_off=bool(_check(doc, "cut_off", (bool,), where)),
            rolled_back_from=_check(doc, "rolled_back_from", (str,), where),
            gated=Gated.from_dict(gated, f"{where}: gated") if gated is not None else None,
            at=_check(doc, "at", (str,), where),
            last_passed=cls.from_dict(last, f"{where}: last_passed", nested=True) if last is not None else None,
        )

    def script_part(self) -> GateResult:
        """Only what the gate script reports: the fields the controller adds cleared (a host
        cannot say a gate was cut off, rolled back or what it gated)."""
        return replace(
            self, decode_floor_tps=None, cut_off=False, rolled_back_from=None, gated=None, at=None, last_passed=None
        )

    def passed_part(self) -> GateResult:
        """This result as a later record's ``last_passed`` (without a ``last_passed`` of its own)."""
        return replace(self, last_passed=None)

    def last_passed_gate(self) -> GateResult | None:
        """The host's last passed gate as this record knows it: itself, or the one it kept."""
        return self.passed_part() if self.ok else self.last_passed


def parse_output(lines: list[str]) -> GateResult | None:
    """The gate script's result: its last line that is a JSON object with ``ok`` (None when it
    printed none). Raises ``GateRecordError`` when that line is not a gate result."""
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "ok" in doc:
                return GateResult.from_dict(doc, "the gate script's result")
    return None
