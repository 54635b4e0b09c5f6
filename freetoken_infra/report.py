"""Plain-text reports: one findings table per host, one summary per fleet, the health gate
table a deploy ends with, and the fleet report a rollout ends with (table and JSON). They read
the typed records (``core.records``, ``core.gate_record``), attributes only."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import click

from freetoken_infra.core.gate_record import CUT_OFF, GateResult
from freetoken_infra.core.layout import RESTART_MESSAGE
from freetoken_infra.core.pyinfra_internals import active_host_names, reached_host_names
from freetoken_infra.core.records import (  # the results are re-exported: the rollout's words
    RECORD_ENV,
    RESULT_FAILED,
    RESULT_NOT_RUN,
    RESULT_OK,
    RESULT_PARKED,
    RESULT_REFUSED,
    RESULTS,
    UNTOUCHED,
    HealthSeen,
    HostRow,
    Observed,
    Rollback,
    RunRecord,
    RunRecords,
    record,
)
from freetoken_infra.core.records import first_line as _first_line
from freetoken_infra.core.text import printable
from freetoken_infra.rules import Finding, HostPreflight, primary_gpu

_MARK = {"pass": "pass", "warn": "WARN", "block": "BLOCK"}


def findings_table(host_name: str, findings: Iterable[Finding]) -> str:
    findings = list(findings)
    width = max(100, min(shutil.get_terminal_size((140, 20)).columns, 180))
    check_w = max(len("check"), *(len(f.check) for f in findings)) if findings else 5
    status_w = 6
    text_w = max(30, width - check_w - status_w - 6)
    lines = [f"== {host_name}: preflight ==", f"{'check':<{check_w}}  {'status':<{status_w}}  evidence / remedy"]
    lines.append("-" * min(width, check_w + status_w + 4 + text_w))
    for f in findings:
        # Evidence quotes what the host said (tool output, file text): escaped.
        body = textwrap.wrap(printable(f.evidence), text_w) or [""]
        if f.remedy and f.status != "pass":
            body += textwrap.wrap("-> " + printable(f.remedy), text_w, subsequent_indent="   ")
        lines.append(f"{f.check:<{check_w}}  {_MARK[f.status]:<{status_w}}  {body[0]}")
        lines += [f"{'':<{check_w}}  {'':<{status_w}}  {rest}" for rest in body[1:]]
    return "\n".join(lines)


def fleet_summary(results: dict[str, list[Finding]]) -> str:
    lines = ["== fleet preflight summary =="]
    name_w = max([4, *(len(n) for n in results)])
    for name in sorted(results):
        findings = results[name]
        blocked = [f.check for f in findings if f.status == "block"]
        warned = [f.check for f in findings if f.status == "warn"]
        verdict = "BLOCKED" if blocked else "ready"
        detail = ""
        if blocked:
            detail += " blockers: " + ", ".join(blocked)
        if warned:
            detail += " warnings: " + ", ".join(warned)
        lines.append(f"{name:<{name_w}}  {verdict:<7}{detail}")
    ready = sum(1 for f in results.values() if not any(x.status == "block" for x in f))
    lines.append(f"{ready} of {len(results)} host(s) ready")
    return "\n".join(lines)


# --------------------------------------------------------------------------- health gate
# The table a deploy ends with: each host's gate (operations/health.py), its last one when
# nothing changed, or why it never reached its gate.


@dataclass(frozen=True)
class GateRow:
    """A host's row of the gate table: its gate result; ``checked`` False: the host's last gate
    (nothing changed, so it did not run again); ``stopped``: why the host never reached its gate."""

    gate: GateResult | None = None
    checked: bool = True
    stopped: str | None = None


def announce(state, host_name: str, notices: Sequence[str], answered: str | None) -> None:
    """What a run says of a host before any step: its plan's notices, a line each; and how its
    record answered (the fast check), for the gate table of a run in which other hosts gate."""
    if answered is not None:
        RunRecords.of(state).answered[host_name] = answered
    for notice in notices:
        click.echo(f"    [{host_name}] {notice}", err=True)


def print_gate_report(run: RunRecords, state) -> None:
    """The health gate table, printed when every host of the run is done (pyinfra disconnects
    from each host last, failed ones included)."""
    hosts = sorted(reached_host_names(state))
    click.echo("\n" + format_gate_report(gate_rows(run, hosts, active_host_names(state))), err=True)


def print_gate_report_if_gated(run: RunRecords, state) -> None:
    """``print_gate_report`` for a run in which some host came to its gate (the preflight
    registers it for every deploy; a run whose hosts all stopped before has no gate table)."""
    if run.last_gates:
        print_gate_report(run, state)


def gate_rows(run: RunRecords, hosts: list[str], active: set[str]) -> dict[str, GateRow]:
    """A row per host: its gate result, the last gate of a host with nothing to prove again, or
    why it never reached its gate."""
    rows: dict[str, GateRow] = {}
    for name in hosts:
        if name in run.gates:
            rows[name] = GateRow(run.gates[name])
        elif name in active and name in run.last_gates:
            # Healthy before the run and nothing changed: the gate had nothing to prove.
            rows[name] = GateRow(replace(run.last_gates[name] or GateResult(), ok=True), checked=False)
        elif name in run.lost:
            rows[name] = GateRow(stopped=f"connection lost during {run.lost[name]}; re-run to finish")
        elif name in run.failed_ops:
            rows[name] = GateRow(stopped="failed at: " + "; ".join(run.failed_ops[name]))
        elif name in run.answered:  # the fast check: nothing was read, its gate not looked at
            rows[name] = GateRow(stopped=run.answered[name])
        else:
            rows[name] = GateRow(stopped="refused at preflight (findings above)")
    return rows


def _seconds(value: float | None) -> str:
    return f"{value:.1f} s" if value is not None else "-"


def format_gate_report(results: Mapping[str, GateRow | GateResult], floor_tps: float | None = None) -> str:
    """Per-host table of gate results (``gate_rows``; a plain result is a row of its own),
    flagging decode speeds below the floor. Each host's floor is its recorded
    ``decode_floor_tps``; ``floor_tps`` applies to hosts without one. A host's last gate is
    marked ``*``."""
    header = ("host", "health", "load wait", "decode tok/s", "floor", "note")
    rows = []
    failed = below = stopped = cut = 0
    shown_rows = {name: r if isinstance(r, GateRow) else GateRow(r) for name, r in results.items()}
    for name in sorted(shown_rows):
        row = shown_rows[name]
        g = row.gate or GateResult()
        floor = floor_tps if g.decode_floor_tps is None else g.decode_floor_tps
        tps = g.decode_tps
        tps_text = f"{tps:.1f}" if tps is not None else "-"
        health = "ok" if g.ok else "FAILED"
        note = ""
        if row.stopped:
            stopped += 1
            health, note = "-", f"no gate: {row.stopped}"
        elif g.cut_off:
            cut += 1
            health, note = CUT_OFF, "gate cut off: connection lost; re-run to finish (not an engine failure)"
        elif not g.ok:
            failed += 1
            error = (g.error or "").splitlines()
            note = f"FAILED in {g.phase or '?'}: {error[0] if error else ''}"
        elif floor is not None and (tps is None or tps < floor):
            below += 1
            note = "below floor" if tps is not None else "below floor (not measured)"
        if not row.checked:
            tps_text += "*" if tps_text != "-" else ""
            note = "; ".join(filter(None, ["not re-checked: nothing changed", note]))
        rows.append((name, health, _seconds(g.load_wait_s), tps_text, f"{floor:g}" if floor is not None else "-", note))

    def fmt(row):
        return "  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths, strict=False)).rstrip()

    shown = [tuple(printable(c) for c in row) for row in rows]  # the notes hold the engine's text
    widths = [max(len(str(row[i])) for row in [header, *shown]) for i in range(len(header))]
    lines = ["== health gate ==", fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [fmt(row) for row in shown]
    serving = len(rows) - failed - stopped - cut
    summary = f"{len(rows)} host(s): {serving} serving, {below} below the decode floor, {failed} failed"
    summary += f", {stopped} stopped before the gate" if stopped else ""
    lines.append(summary + (f", {cut} cut off" if cut else ""))
    if any(not r.checked and r.gate is not None and r.gate.decode_tps is not None for r in shown_rows.values()):
        lines.append("* tok/s of the host's last health gate (nothing changed, so the gate did not run again)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- fleet report
# What a rollout (freetoken_infra.rollout) prints at its end: one row per host (core.records.HostRow),
# from the run record (freetoken_infra.core.records) each batch's deploy writes.


def record_host(host_name: str, pre: HostPreflight) -> None:
    """Write what the preflight saw on this host to the run record (under $FREETOKEN_RUN_RECORD,
    for a rollout's fleet report). Reads nothing from the host: all of it is in the preflight's
    record."""
    if not os.environ.get(RECORD_ENV):
        return
    settings, obs = pre.settings, pre.observations
    gpu = primary_gpu(obs)
    health = obs.health
    seen = not pre.blocked  # what a blocked host's deploy never reads, it does not record either
    observed = Observed(
        gpu=gpu.name if gpu else None,
        vram_mib=gpu.memory_total_mib if gpu else None,
        wsl_version=".".join(map(str, obs.wsl.version)) if obs.wsl.version else None,
        wsl_kind=obs.kernel.kind,
        engine_active=obs.engine.active if obs.engine else None,
        engine_version=settings.engine_version,
        model=f"{settings.model_repo}@{settings.model_revision}",
        blockers=tuple(f.check for f in pre.blocked),
        restart_only=bool(pre.blocked) and pre.restart_only,
        health=(
            HealthSeen(health.status if health.reachable else "down", health.version, health.message)
            if seen and health is not None
            else None
        ),
        last_gate=obs.gate_record if seen else None,
        restart_pending=tuple(obs.restart_pending or []),
    )
    record(host_name, observed=observed)


_T = TypeVar("_T")


def _latest(values: Iterable[_T | None]) -> _T | None:
    """The last value that is set (a later record is the more recent)."""
    found = None
    for value in values:
        found = value or found
    return found


class _HostRun:
    """What a host's records say together: the latest of each kind, every op error, every file
    that waits for a WSL restart."""

    def __init__(self, entries: Sequence[RunRecord]) -> None:
        self.seen = _latest(r.observed for r in entries)
        self.gate = _latest(r.gate for r in entries)
        self.rollback = _latest(r.rollback for r in entries)
        self.finished = _latest(r.finished for r in entries)
        self.lost = _latest(r.lost for r in entries)
        self.op_errors = [r.op_error for r in entries if r.op_error]
        self.restart_files = [f for r in entries for f in r.restart_pending]


def _health_and_engine(
    observed: Observed, gate: GateResult | None, rollback: Rollback | None
) -> tuple[str, float | None, str | None, str | None]:
    """(health, tokens/s, where the tokens/s come from, engine version) for a host's row."""
    last_gate = observed.last_gate
    before = observed.health or HealthSeen()
    if gate is not None and gate.cut_off:
        health, tps, tps_source, engine = "cut off", None, None, before.version
    elif gate is not None:
        health = "ok" if gate.ok else f"failed ({gate.phase or '?'})"
        tps, tps_source = gate.decode_tps, "this run"
        engine = gate.version or (observed.engine_version if gate.ok else None)
    else:
        health = before.status or "-"
        tps, tps_source = None, None
        if before.status == "ok" and last_gate is not None and last_gate.ok:
            tps, tps_source = last_gate.decode_tps, "last gate"
        engine = before.version or observed.engine_active
    if rollback is not None:
        engine = rollback.to if rollback.ok else engine
    return health, tps, tps_source, engine


def _rollback_reason(rollback: Rollback) -> str:
    if rollback.ok:
        return f"rolled back to {rollback.to}: {_first_line(rollback.reason)}"
    return (
        f"rollback to {rollback.to} failed too: {_first_line(rollback.error)} "
        f"(upgrade failed: {_first_line(rollback.reason)})"
    )


def _result_and_reason(
    run: _HostRun, observed: Observed, *, recorded: bool, not_run: str | None, unreachable: str | None, no_result: str
) -> tuple[str, str]:
    """The host's result word and its reason, the first that applies of: not run, parked, no
    record, refused, connection lost, rolled back, gate failed, op failed, stopped, ok."""
    gate, finished = run.gate, run.finished
    if not_run:
        return RESULT_NOT_RUN, not_run
    if not recorded:
        if unreachable:
            return RESULT_PARKED, f"unreachable: {_first_line(unreachable)}"
        return RESULT_FAILED, no_result
    if observed.blockers and observed.restart_only:
        return RESULT_FAILED, f"{RESTART_MESSAGE}, then re-run"
    if observed.blockers:
        return RESULT_REFUSED, "refused at preflight: " + ", ".join(observed.blockers)
    if run.lost is not None:
        return RESULT_FAILED, f"connection lost during {run.lost.step}; re-run to finish"
    if run.rollback is not None:
        return RESULT_FAILED, _rollback_reason(run.rollback)
    if gate is not None and not gate.ok:
        return RESULT_FAILED, f"health gate failed in the {gate.phase or '?'} phase: {_first_line(gate.error)}"
    if run.op_errors:
        return RESULT_FAILED, "failed at: " + "; ".join(run.op_errors)
    if finished is None:
        return RESULT_FAILED, "the deploy stopped before this host finished"
    if finished.failed:
        return RESULT_FAILED, "pyinfra failed the host (see the log above)"
    return RESULT_OK, f"{finished.changes} change(s)" if finished.changes else "no change"


def host_row(
    name: str,
    records: Sequence[RunRecord | Mapping[str, Any]],
    *,
    batch: int | None = None,
    not_run: str | None = None,
    unreachable: str | None = None,
    no_result: str = "no result from the deploy",
) -> HostRow:
    """One report row from a host's records (``read_records``; a JSON document is read as one).
    `not_run`: why the rollout never got to it; `unreachable`: pyinfra's connection error when
    the deploy recorded nothing (the host is parked); `no_result`: the reason when it recorded
    nothing and no connection error was seen."""
    entries = [r if isinstance(r, RunRecord) else RunRecord.from_dict(r) for r in records]
    # pyinfra's connection error, recorded (core.records.RunRecords) or read from its output by the caller
    unreachable = next((r.unreachable for r in entries if r.unreachable), None) or unreachable
    entries = [r for r in entries if not r.unreachable]
    run = _HostRun(entries)
    seen, finished = run.seen, run.finished
    observed = seen or Observed()
    restart_files = sorted(set(run.restart_files) | set(observed.restart_pending))
    health, tps, tps_source, engine = _health_and_engine(observed, run.gate, run.rollback)
    result, reason = _result_and_reason(
        run, observed, recorded=bool(entries), not_run=not_run, unreachable=unreachable, no_result=no_result
    )
    if result == RESULT_OK and observed.engine_active and engine and observed.engine_active != engine:
        reason += f", upgraded from {observed.engine_active}"
    vram = observed.vram_mib
    untouched = result in UNTOUCHED
    return HostRow(
        host=name,
        batch=batch,
        gpu=observed.gpu,
        vram_gb=round(vram / 1024) if vram is not None else None,
        wsl_version=observed.wsl_version,
        engine_version=engine,
        # what the host should serve; "-" (None) where the deploy did nothing on it
        model=None if untouched else observed.model,
        health="-" if untouched or not entries else health,
        tokens_per_s=None if untouched else tps,
        tokens_per_s_source=None if untouched else tps_source,
        # None ("-"): the deploy did nothing here, so it owes no `wsl.exe --shutdown` either
        restart_pending=bool(restart_files) if seen is not None and not untouched else None,
        restart_pending_files=() if untouched else tuple(restart_files),
        result=result,
        reason=reason,
        changes=finished.changes if finished is not None else None,
    )


def fleet_counts(rows: Sequence[HostRow]) -> str:
    """``3 host(s): 1 ok, 1 parked, 1 refused, 0 failed, 0 not run``."""
    count = {k: sum(1 for r in rows if r.result == k) for k in RESULTS}
    return f"{len(rows)} host(s): " + ", ".join(f"{count[k]} {k}" for k in RESULTS)


def ending_line(row: HostRow) -> str:
    """One plain line of why for a host that is not ok (printed as its batch ends)."""
    result, reason = row.result, printable(row.reason)
    if result == RESULT_PARKED:
        return f"{row.host} parked: {reason}; nothing was done on it (catch it up when it is back)"
    if result == RESULT_REFUSED:
        return f"{row.host} refused: {reason}; nothing was changed on it (its findings say what to do)"
    if result == RESULT_NOT_RUN:
        return f"{row.host} not run: {reason}"
    return f"{row.host} {result}: {reason}"


def format_fleet_report(rows: Sequence[HostRow]) -> str:
    """The fleet table (one line per host, the reason last) and a one-line summary."""
    header = ("host", "GPU", "VRAM", "WSL", "engine", "model", "health", "tok/s", "restart", "result")
    table = []
    for r in rows:
        tps = r.tokens_per_s
        tps_text = "-" if tps is None else f"{tps:.1f}" + ("*" if r.tokens_per_s_source == "last gate" else "")
        restart = r.restart_pending
        table.append(
            (
                r.host,
                r.gpu or "-",
                f"{r.vram_gb} GB" if r.vram_gb is not None else "-",
                r.wsl_version or "-",
                r.engine_version or "-",
                r.model or "-",
                r.health or "-",
                tps_text,
                "-" if restart is None else ("yes" if restart else "no"),
                f"{r.result}: {r.reason}" if r.reason else r.result,
            )
        )
    # Engine version, model, health and reason come from hosts and the engine: escaped.
    shown = [tuple(printable(c) for c in row) for row in table]
    widths = [max(len(str(row[i])) for row in [header, *shown]) for i in range(len(header) - 1)]

    def fmt(row):
        cells = [f"{str(c):<{w}}" for c, w in zip(row[:-1], widths, strict=False)] + [str(row[-1])]
        return "  ".join(cells).rstrip()

    lines = ["== fleet report ==", fmt(header), "-" * (sum(widths) + 2 * len(widths) + len("result"))]
    lines += [fmt(row) for row in shown]
    lines.append(fleet_counts(rows))
    if any(r.tokens_per_s_source == "last gate" for r in rows):
        lines.append("* tok/s of the host's last health gate (nothing changed, so the gate did not run again)")
    return "\n".join(lines)
