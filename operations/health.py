"""
The health gate: the last step of a converge, proving the endpoint serves.

A unit that is "active" only means the process runs; FreeToken binds its HTTP port before the
weights load (2-3 min on a cold kernel cache, field report) and may still die after loading.
The gate waits on the engine's own readiness (``/health`` JSON), then sends a real chat and a
timed stream, on the target itself (the engine listens on loopback by default).
"""

from __future__ import annotations

import ipaddress
import json
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
from pyinfra import host as current_host
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.operations import files

from facts.files import FileText
from freetoken_infra.core.layout import ENGINE_UNIT, GATE_RECORD_FILE, GATE_SCRIPT, HostLayout
from freetoken_infra.core.pyinfra_internals import (
    active_host_names,
    connection_lost,
    current_op_elevation,
    reached_host_names,
)
from freetoken_infra.core.records import RunRecords, first_line, lost_line, record
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.text import printable, printable_block

GATE_SCRIPT_SOURCE = Path(__file__).resolve().parent / "scripts" / "health_gate.py"
GATE_SCRIPT_PATH = GATE_SCRIPT
JOURNAL_LINES = 30
# Time the chat and the stream may take once /health says ok (cold first requests compile
# kernels), on top of settings.health_timeout_s.
INFERENCE_MARGIN_S = 300

_REMEDY = {
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
# What a gate result says when the connection to the host was lost while the gate ran.
CUT_OFF = "cut off"


class ConnectionLost(Exception):
    """The host's connection dropped while the gate talked to it."""


def gate_url(settings: Settings) -> str:
    """Where the gate reaches the engine from the target itself."""
    address = ipaddress.ip_address(str(settings.listen_host))
    if address.is_unspecified:  # listening everywhere: loopback is one of them
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{settings.listen_port}"


def gate_command(
    settings: Settings, key_file: str | None, script_path: str = GATE_SCRIPT_PATH, expect_version: str | None = None
) -> str:
    """The shell command that runs the gate script on the target (no key in it, only its file)."""
    argv = [
        "python3",
        script_path,
        "--url",
        gate_url(settings),
        "--timeout",
        str(settings.health_timeout_s),
        "--model",
        settings.served_model_name,
    ]
    if key_file:
        argv += ["--key-file", key_file]
    if expect_version:
        argv += ["--expect-version", expect_version]
    return " ".join(shlex.quote(a) for a in argv)


def parse_gate_output(lines: list[str]) -> dict[str, Any] | None:
    """The final JSON line of the script's stdout, or None when it never printed one."""
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and "ok" in doc:
                return doc
    return None


def _run(host, command: str, elevation: Mapping[str, Any], **arguments: Any):
    """``host.run_shell_command``, raising ``ConnectionLost`` when the connection is gone."""
    try:
        status, output = host.run_shell_command(command, **elevation, **arguments)
    except Exception as exc:  # paramiko's SSHException, socket errors, EOFError: all mean the same
        if connection_lost(host) or type(exc).__name__ in ("SSHException", "EOFError") or isinstance(exc, OSError):
            raise ConnectionLost(str(exc) or type(exc).__name__) from None
        raise
    if not status and connection_lost(host):
        raise ConnectionLost("the SSH session ended")
    return status, output


def _gate_once(
    host,
    settings: Settings,
    key_file: str | None,
    script_path: str,
    elevation: Mapping[str, Any],
    expect_version: str | None = None,
) -> dict[str, Any]:
    """Run the gate script once; its JSON result (a failed one when it printed none)."""
    command = gate_command(settings, key_file, script_path, expect_version)
    click.echo(
        f"{host.print_prefix}health gate: {gate_url(settings)} "
        f"(model {settings.served_model_name}, up to {settings.health_timeout_s} s)",
        err=True,
    )
    # print_output streams the script's progress lines as they come, prefixed with the host.
    status, output = _run(
        host, command, elevation, print_output=True, _timeout=settings.health_timeout_s + INFERENCE_MARGIN_S
    )
    result = parse_gate_output(output.stdout_lines)
    if result is None:
        tail = "\n".join(output.output_lines[-10:])
        result = {
            "ok": False,
            "phase": "health",
            "load_wait_s": None,
            "decode_tps": None,
            "completion_tokens": None,
            "error": f"the gate script printed no result (exit {'0' if status else 'non-zero'}):\n{tail}",
        }
    elif not status and result.get("ok"):
        result = {**result, "ok": False, "error": "the gate script exited non-zero"}
    return {**result, "decode_floor_tps": settings.decode_floor_tps}


def _journal(host, elevation: Mapping[str, Any]) -> str:
    _, journal = _run(host, f"journalctl -u {ENGINE_UNIT} -n {JOURNAL_LINES} --no-pager -o cat", elevation)
    # Engine text: escaped, so its lines cannot drive the operator's terminal (issue 20, item 10).
    return "\n".join("    " + printable(line) for line in journal.output_lines) or "    (no journal lines)"


def _keep_result(host, result: Mapping[str, Any], path: str | None, elevation: Mapping[str, Any]) -> None:
    """Leave the gate record on the host (no secret in it; root's directory), written beside and
    renamed into place, so that a cut run leaves the old record or the new one, never half."""
    if path:
        text = shlex.quote(json.dumps(dict(result)))
        target = shlex.quote(path)
        tmp = shlex.quote(f"{path}.tmp")
        folder = shlex.quote(path.rsplit("/", 1)[0] or "/")
        _run(
            host, f"umask 022 && mkdir -p {folder} && printf '%s\\n' {text} > {tmp} && mv -f {tmp} {target}", elevation
        )


def _manifest_sha256(host, settings: Settings, elevation: Mapping[str, Any]) -> str | None:
    status, output = _run(
        host, f"sha256sum {shlex.quote(HostLayout.of(settings).model_manifest_file)} 2>/dev/null", elevation
    )
    words = (output.stdout_lines or [""])[0].split() if status else []
    return words[0] if words else None


def rollback_command(settings: Settings, version: str) -> str:
    """Point the ``active`` link back at ``version`` (atomically) and restart the engine."""
    target = shlex.quote(f"{settings.engine_base_dir}/{version}")
    link = shlex.quote(HostLayout.of(settings).engine_active_link)
    return f"ln -sfn {target} {link}.rollback && mv -Tf {link}.rollback {link} && systemctl restart {ENGINE_UNIT}"


def run_gate(
    state,
    host,
    settings: Settings,
    key_file: str | None,
    script_path: str = GATE_SCRIPT_PATH,
    elevation: Mapping[str, Any] | None = None,
    rollback_to: str | None = None,
    result_path: str | None = None,
    subject: Mapping[str, Any] | None = None,
    previous: Mapping[str, Any] | None = None,
) -> Any:
    """Execution-time half of the operation: run the script, record, or raise OperationError.

    ``elevation``: connector arguments such as ``{"_sudo": True}`` for the gate's commands.
    ``rollback_to``: the engine version that served before this run switched to
    ``settings.engine_version``; when the gate fails, the ``active`` link goes back to it, the
    engine restarts and the gate runs again. The host still fails (the upgrade did), with
    ``rolled back to <version>: <why>``. ``result_path``: the host's gate record
    (``layout.GATE_RECORD_FILE``); ``subject``: what this run gates (``plan.gate_subject``), kept in
    the record with the model manifest's hash; ``previous``: the record before this run.

    When the connection to the host drops, the run prints one line (``lost_line``), the result
    says the gate was cut off, and the operation fails without a traceback (returns False).
    """
    elevation = dict(elevation or {})
    run = RunRecords.of(state)
    try:
        return _run_gate(
            run, host, settings, key_file, script_path, elevation, rollback_to, result_path, subject, previous
        )
    except ConnectionLost as exc:
        step = "the health gate"
        cut = {
            "ok": False,
            "phase": CUT_OFF,
            "load_wait_s": None,
            "decode_tps": None,
            "completion_tokens": None,
            "cut_off": True,
            "error": f"connection lost ({exc})",
            "decode_floor_tps": settings.decode_floor_tps,
        }
        run.gates[host.name] = cut
        record(host.name, gate=cut, lost={"step": step})
        click.echo(lost_line(host.name, step), err=True)
        return False


def _passed(result: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "last_passed"}


def _run_gate(
    run: RunRecords,
    host,
    settings: Settings,
    key_file: str | None,
    script_path: str,
    elevation: Mapping[str, Any],
    rollback_to: str | None,
    result_path: str | None,
    subject: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None,
) -> dict[str, Any]:
    previous = previous or {}
    last_passed = _passed(previous) if previous.get("ok") else previous.get("last_passed")
    manifest = _manifest_sha256(host, settings, elevation) if subject is not None else None

    def gated(version: str) -> dict[str, Any] | None:
        if subject is None:
            return None
        return {**subject, "engine_version": version, "manifest_sha256": manifest}

    def keep(result: Mapping[str, Any], version: str) -> None:
        nonlocal last_passed
        doc = {**result, "gated": gated(version), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if doc.get("ok"):
            last_passed = _passed(doc)
        _keep_result(host, {**doc, "last_passed": last_passed}, result_path, elevation)

    new = settings.engine_version
    # Before the gate runs, the record says it did not finish: a run cut off from here on leaves
    # no passed gate for what is installed now, so the next run gates again.
    keep({"ok": False, "phase": "started", "error": "the gate did not finish (the run was cut off)"}, new)
    result = _gate_once(host, settings, key_file, script_path, elevation, expect_version=new)
    run.gates[host.name] = result
    keep(result, new)
    if result["ok"]:
        record(host.name, gate=result)
        return result

    journal_text = _journal(host, elevation)
    phase = result.get("phase") or "health"
    failure = (
        f"host {host.name}: the health gate failed in the {printable(phase)} phase: "
        f"{printable_block(result.get('error'))}\n"
        f"  what to do: {_REMEDY.get(phase, _REMEDY['health'])}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{journal_text}"
    )
    if not rollback_to or rollback_to == new:
        record(host.name, gate=result)
        raise OperationError(failure)

    # Blue-green: the previous version's environment is still there; switch back to it.
    reason = (
        f"{new} failed the health gate in the {printable(phase)} phase: {printable(first_line(result.get('error')))}"
    )
    click.echo(f"{host.print_prefix}{reason}; rolling back to {rollback_to}", err=True)
    switched, output = _run(host, rollback_command(settings, rollback_to), elevation)
    if not switched:
        error = "switching back failed: " + " / ".join(printable(line) for line in output.output_lines[-5:])
        record(
            host.name,
            gate=result,
            rollback={"from": new, "to": rollback_to, "reason": reason, "ok": False, "error": error},
        )
        raise OperationError(f"host {host.name}: rollback to {rollback_to} failed: {error}\n{failure}")
    keep(
        {
            "ok": False,
            "phase": "started",
            "error": "the gate did not finish (the run was cut off)",
            "rolled_back_from": new,
        },
        rollback_to,
    )
    again = {
        **_gate_once(host, settings, key_file, script_path, elevation, expect_version=rollback_to),
        "rolled_back_from": new,
    }
    run.gates[host.name] = again
    keep(again, rollback_to)
    record(
        host.name,
        gate=again,
        rollback={
            "from": new,
            "to": rollback_to,
            "reason": reason,
            "ok": bool(again["ok"]),
            "error": None if again["ok"] else again.get("error"),
        },
    )
    if again["ok"]:
        raise OperationError(
            f"host {host.name}: rolled back to {rollback_to}: {reason}\n"
            f"  {rollback_to} serves again (health gate passed); {new} stays installed beside it\n"
            f"  what {new} logged:\n{journal_text}"
        )
    raise OperationError(
        f"host {host.name}: rollback to {rollback_to} failed too: the health gate failed in the "
        f"{printable(again.get('phase') or 'health')} phase: {printable_block(again.get('error'))}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{_journal(host, elevation)}\n"
        f"  first failure ({new}): {printable(first_line(result.get('error')))}"
    )


def gate_record(settings: Settings, record_path: str = GATE_RECORD_FILE) -> dict[str, Any] | None:
    """The host's gate record (``GATE_RECORD_FILE``) as it was before this run, or None."""
    return _json_or_none(current_host.get_fact(FileText, path=record_path))


def health_gate(
    settings: Settings,
    key_file: str | None = None,
    script_path: str = GATE_SCRIPT_PATH,
    rollback_to: str | None = None,
    subject: Mapping[str, Any] | None = None,
    record_path: str = GATE_RECORD_FILE,
    **operation_arguments,
):
    """
    Wait until the FreeToken engine serves, then prove it with a chat and a timed stream.

    + settings: the host's ``Settings``; uses ``listen_host``/``listen_port`` (the URL,
      loopback when listening on all addresses), ``health_timeout_s`` (how long loading may
      take), ``served_model_name`` and ``decode_floor_tps`` (recorded for the report)
    + key_file: env-style file on the target with ``FREETOKEN_API_KEY=...`` (the service's
      key); ``None`` when the engine runs without a key
    + script_path: where the gate script is uploaded on the target
    + rollback_to: the engine version that served before this run (blue-green upgrade): on a
      failed gate the ``active`` link goes back to it, the engine restarts and the gate runs
      again; the operation still fails, saying ``rolled back to <version>: <why>``
    + subject: what this run gates (``plan.gate_subject``); the record keeps it with the model
      manifest's hash, and a later run skips its gate only when they match (``plan.why_gate``)
    + record_path: the gate record on the host (root's, ``layout.GATE_RECORD_FILE``)
    + operation_arguments: ``name=`` and pyinfra's global arguments (``_sudo``, ``_if`` ...)

    Run it as root (``_sudo=True``, or connected as root) so that the script can read the key
    file and the journal; the privilege arguments apply to the gate's commands too. The script
    (stdlib only, run by the target's ``python3``) polls ``/health`` until ``status: ok`` (printing progress), fails at once on
    ``status: error``, fails when the engine serving is not ``settings.engine_version``, asks a
    question with one right answer (and fails on a wrong one), then sends a streamed chat whose
    decode tokens/s it measures. The result lands in the run's ``RunRecords.gates``. On failure the operation
    raises ``OperationError`` naming the host, the failed phase and the engine's last 30
    journal lines. Never idempotent: it always checks (skip it with ``_if`` when nothing
    changed). When every host of the run is done, the run prints one table
    (``print_gate_report``): each host's health, decode tok/s, or why it has none.

    **Example:**

    .. code:: python

        from operations.health import health_gate

        health_gate(
            name="Health gate: the endpoint loads and serves",
            settings=settings,
            key_file="/etc/freetoken/api.env",
            _sudo=True,
        )
    """
    # Here, while the deploy is prepared, not in the operation: a gate skipped with `_if` never
    # runs its operation, and the report must see every host.
    run = RunRecords.of(current_host.state)
    run.when_done(print_gate_report)
    previous = gate_record(settings, record_path)
    run.last_gates[current_host.name] = previous
    return _health_gate(
        settings=settings,
        key_file=key_file,
        script_path=script_path,
        rollback_to=rollback_to,
        subject=subject,
        previous=previous,
        record_path=record_path,
        **operation_arguments,
    )


@operation(is_idempotent=False)
def _health_gate(
    settings: Settings,
    key_file: str | None,
    script_path: str,
    rollback_to: str | None,
    subject: Mapping[str, Any] | None,
    previous: Mapping[str, Any] | None,
    record_path: str,
):
    """The operation behind ``health_gate`` (see there)."""
    yield from files.put._inner(
        src=str(GATE_SCRIPT_SOURCE),
        dest=script_path,
        user="root",
        group="root",
        mode="755",
        add_deploy_dir=False,
    )
    elevation = current_op_elevation(current_host)
    yield FunctionCommand(
        run_gate,
        (settings, key_file, script_path, elevation),
        {"rollback_to": rollback_to, "result_path": record_path, "subject": subject, "previous": previous},
    )


def _json_or_none(text: str | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def print_gate_report(run: RunRecords, state) -> None:
    """The health gate table, printed when every host of the run is done (pyinfra disconnects
    from each host last, failed ones included)."""
    hosts = sorted(reached_host_names(state))
    click.echo("\n" + format_gate_report(gate_rows(run, hosts, active_host_names(state))), err=True)


def gate_rows(run: RunRecords, hosts: list[str], active: set[str]) -> dict[str, dict[str, Any]]:
    """A row per host: its gate result, the last gate of a host with nothing to prove again, or
    why it never reached its gate."""
    rows: dict[str, dict[str, Any]] = {}
    for name in hosts:
        if name in run.gates:
            rows[name] = run.gates[name]
        elif name in active and name in run.last_gates:
            # Healthy before the run and nothing changed: the gate had nothing to prove.
            rows[name] = {**(run.last_gates[name] or {}), "ok": True, "checked": False}
        elif name in run.lost:
            rows[name] = {"ok": False, "stopped": f"connection lost during {run.lost[name]}; re-run to finish"}
        elif name in run.failed_ops:
            rows[name] = {"ok": False, "stopped": "failed at: " + "; ".join(run.failed_ops[name])}
        else:
            rows[name] = {"ok": False, "stopped": "refused at preflight (findings above)"}
    return rows


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def format_gate_report(results: Mapping[str, Mapping[str, Any]], floor_tps: float | None = None) -> str:
    """Per-host table of gate results (``gate_rows``), flagging decode speeds below the floor.

    Each host's floor is its recorded ``decode_floor_tps``; ``floor_tps`` applies to hosts
    without one. A result with ``"checked": False`` is a host's last gate (marked ``*``); one
    with ``"stopped": REASON`` a host that never reached its gate.
    """
    header = ("host", "health", "load wait", "decode tok/s", "floor", "note")
    rows = []
    failed = below = stopped = cut = 0
    for name in sorted(results):
        r = results[name]
        floor = r.get("decode_floor_tps")
        floor = floor_tps if floor is None else floor
        tps = r.get("decode_tps")
        tps_text = f"{tps:.1f}" if isinstance(tps, (int, float)) else "-"
        health = "ok" if r.get("ok") else "FAILED"
        note = ""
        if r.get("stopped"):
            stopped += 1
            health, note = "-", f"no gate: {r['stopped']}"
        elif r.get("cut_off"):
            cut += 1
            health, note = CUT_OFF, "gate cut off: connection lost; re-run to finish (not an engine failure)"
        elif not r.get("ok"):
            failed += 1
            error = str(r.get("error") or "").splitlines()
            note = f"FAILED in {r.get('phase') or '?'}: {error[0] if error else ''}"
        elif floor is not None and (tps is None or tps < floor):
            below += 1
            note = "below floor" if tps is not None else "below floor (not measured)"
        if r.get("checked") is False:
            tps_text += "*" if tps_text != "-" else ""
            note = "; ".join(filter(None, ["not re-checked: nothing changed", note]))
        rows.append(
            (name, health, _seconds(r.get("load_wait_s")), tps_text, f"{floor:g}" if floor is not None else "-", note)
        )

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
    if any(r.get("checked") is False and isinstance(r.get("decode_tps"), (int, float)) for r in results.values()):
        lines.append("* tok/s of the host's last health gate (nothing changed, so the gate did not run again)")
    return "\n".join(lines)
