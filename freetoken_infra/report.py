"""Plain-text reports: one findings table per host, one summary per fleet, and the fleet
report a rollout ends with (table and JSON)."""

from __future__ import annotations

import os
import shutil
import textwrap
from collections.abc import Iterable
from typing import Any

from freetoken_infra.core.layout import RESTART_MESSAGE
from freetoken_infra.core.records import RECORD_ENV, record
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
        # Evidence quotes what the host said (tool output, file text): escaped (issue 20, item 10).
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


# --------------------------------------------------------------------------- fleet report
# What a rollout (freetoken_infra.rollout) prints at its end: one row per host, from the run
# record (freetoken_infra.core.records) each batch's deploy writes.

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


def record_host(host_name: str, pre: HostPreflight) -> None:
    """Write what the preflight saw on this host to the run record (under $FREETOKEN_RUN_RECORD,
    for a rollout's fleet report). Reads nothing from the host: all of it is in the preflight's
    record."""
    if not os.environ.get(RECORD_ENV):
        return
    settings, obs = pre.settings, pre.observations
    gpu = primary_gpu(obs)
    observed: dict[str, Any] = {
        "gpu": gpu.name if gpu else None,
        "vram_mib": gpu.memory_total_mib if gpu else None,
        "wsl_version": ".".join(map(str, obs.wsl.version)) if obs.wsl.version else None,
        "wsl_kind": obs.kernel.kind,
        "engine_active": obs.engine.active if obs.engine else None,
        "engine_version": settings.engine_version,
        "model": f"{settings.model_repo}@{settings.model_revision}",
        "blockers": [f.check for f in pre.blocked],
        "restart_only": bool(pre.blocked) and pre.restart_only,
    }
    if not pre.blocked:
        health = obs.health
        observed["health"] = (
            {
                "status": health.status if health.reachable else "down",
                "version": health.version,
                "message": health.message,
            }
            if health is not None
            else None
        )
        observed["last_gate"] = obs.gate_record
    observed["restart_pending"] = list(obs.restart_pending or [])
    record(host_name, observed=observed)


def host_row(
    name: str,
    records: list[dict],
    *,
    batch: int | None = None,
    not_run: str | None = None,
    unreachable: str | None = None,
    no_result: str = "no result from the deploy",
) -> dict[str, Any]:
    """One report row from a host's records. `not_run`: why the rollout never got to it;
    `unreachable`: pyinfra's connection error when the deploy recorded nothing (the host is
    parked); `no_result`: the reason when it recorded nothing and no connection error was
    seen."""
    observed: dict = {}
    gate = rollback = finished = lost = None
    op_errors: list[str] = []
    restart_files: list[str] = []
    # pyinfra's connection error, recorded (core.records.RunRecords) or read from its output by the caller
    unreachable = next((r["unreachable"] for r in records if r.get("unreachable")), None) or unreachable
    records = [r for r in records if not r.get("unreachable")]
    for r in records:
        observed.update(r.get("observed") or {})
        gate = r.get("gate", gate)
        rollback = r.get("rollback", rollback)
        finished = r.get("finished", finished)
        lost = r.get("lost", lost)
        if r.get("op_error"):
            op_errors.append(r["op_error"])
        restart_files += r.get("restart_pending") or []
    restart_files += observed.get("restart_pending") or []
    restart_files = sorted(set(restart_files))

    last_gate = observed.get("last_gate") or None
    health_before = observed.get("health") or {}
    if gate is not None and gate.get("cut_off"):
        health, tps, tps_source, engine = "cut off", None, None, health_before.get("version")
    elif gate is not None:
        health = "ok" if gate.get("ok") else f"failed ({gate.get('phase') or '?'})"
        tps, tps_source = gate.get("decode_tps"), "this run"
        engine = gate.get("version") or (observed.get("engine_version") if gate.get("ok") else None)
    else:
        status = health_before.get("status")
        health = status or "-"
        tps, tps_source = None, None
        if status == "ok" and last_gate and last_gate.get("ok"):
            tps, tps_source = last_gate.get("decode_tps"), "last gate"
        engine = health_before.get("version") or observed.get("engine_active")
    if rollback:
        engine = rollback.get("to") if rollback.get("ok") else engine

    if not_run:
        result, reason = RESULT_NOT_RUN, not_run
    elif not records and unreachable:
        result, reason = RESULT_PARKED, f"unreachable: {_first_line(unreachable)}"
    elif not records:
        result, reason = RESULT_FAILED, no_result
    elif observed.get("blockers") and observed.get("restart_only"):
        result, reason = RESULT_FAILED, f"{RESTART_MESSAGE}, then re-run"
    elif observed.get("blockers"):
        result, reason = RESULT_REFUSED, "refused at preflight: " + ", ".join(observed["blockers"])
    elif lost:
        result, reason = RESULT_FAILED, f"connection lost during {lost.get('step')}; re-run to finish"
    elif rollback:
        result = RESULT_FAILED
        if rollback.get("ok"):
            reason = f"rolled back to {rollback.get('to')}: {_first_line(rollback.get('reason'))}"
        else:
            reason = (
                f"rollback to {rollback.get('to')} failed too: {_first_line(rollback.get('error'))} "
                f"(upgrade failed: {_first_line(rollback.get('reason'))})"
            )
    elif gate is not None and not gate.get("ok"):
        result = RESULT_FAILED
        reason = f"health gate failed in the {gate.get('phase') or '?'} phase: {_first_line(gate.get('error'))}"
    elif op_errors:
        result, reason = RESULT_FAILED, "failed at: " + "; ".join(op_errors)
    elif finished is None:
        result, reason = RESULT_FAILED, "the deploy stopped before this host finished"
    elif finished.get("failed"):
        result, reason = RESULT_FAILED, "pyinfra failed the host (see the log above)"
    else:
        result = RESULT_OK
        changes = finished.get("changes") or 0
        reason = f"{changes} change(s)" if changes else "no change"
        before = observed.get("engine_active")
        if before and engine and before != engine:
            reason += f", upgraded from {before}"
    vram = observed.get("vram_mib")
    untouched = result in UNTOUCHED
    return {
        "host": name,
        "batch": batch,
        "gpu": observed.get("gpu"),
        "vram_gb": round(vram / 1024) if isinstance(vram, (int, float)) else None,
        "wsl_version": observed.get("wsl_version"),
        "engine_version": engine,
        # what the host should serve; "-" (None) where the deploy did nothing on it
        "model": None if untouched else observed.get("model"),
        "health": "-" if untouched or not records else health,
        "tokens_per_s": None if untouched else tps,
        "tokens_per_s_source": None if untouched else tps_source,
        # None ("-"): the deploy did nothing here, so it owes no `wsl.exe --shutdown` either
        "restart_pending": bool(restart_files) if observed and not untouched else None,
        "restart_pending_files": [] if untouched else restart_files,
        "result": result,
        "reason": reason,
        "changes": (finished or {}).get("changes"),
    }


def fleet_counts(rows: list[dict]) -> str:
    """``3 host(s): 1 ok, 1 parked, 1 refused, 0 failed, 0 not run``."""
    count = {k: sum(1 for r in rows if r["result"] == k) for k in RESULTS}
    return f"{len(rows)} host(s): " + ", ".join(f"{count[k]} {k}" for k in RESULTS)


def ending_line(row: dict) -> str:
    """One plain line of why for a host that is not ok (printed as its batch ends)."""
    result, reason = row["result"], printable(row.get("reason") or "")
    if result == RESULT_PARKED:
        return f"{row['host']} parked: {reason}; nothing was done on it (catch it up when it is back)"
    if result == RESULT_REFUSED:
        return f"{row['host']} refused: {reason}; nothing was changed on it (its findings say what to do)"
    if result == RESULT_NOT_RUN:
        return f"{row['host']} not run: {reason}"
    return f"{row['host']} {result}: {reason}"


def format_fleet_report(rows: list[dict]) -> str:
    """The fleet table (one line per host, the reason last) and a one-line summary."""
    header = ("host", "GPU", "VRAM", "WSL", "engine", "model", "health", "tok/s", "restart", "result")
    table = []
    for r in rows:
        tps = r.get("tokens_per_s")
        tps_text = (
            "-"
            if not isinstance(tps, (int, float))
            else (f"{tps:.1f}" + ("*" if r.get("tokens_per_s_source") == "last gate" else ""))
        )
        restart = r.get("restart_pending")
        table.append(
            (
                r["host"],
                r.get("gpu") or "-",
                f"{r['vram_gb']} GB" if r.get("vram_gb") is not None else "-",
                r.get("wsl_version") or "-",
                r.get("engine_version") or "-",
                r.get("model") or "-",
                r.get("health") or "-",
                tps_text,
                "-" if restart is None else ("yes" if restart else "no"),
                f"{r['result']}: {r['reason']}" if r.get("reason") else r["result"],
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
    if any(r.get("tokens_per_s_source") == "last gate" for r in rows):
        lines.append("* tok/s of the host's last health gate (nothing changed, so the gate did not run again)")
    return "\n".join(lines)
