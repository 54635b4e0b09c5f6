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
from pathlib import Path
from typing import Any, Mapping, Optional

import click
from pyinfra import host as current_host
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import BaseStateCallback
from pyinfra.operations import files

from facts.files import FileText
from freetoken_infra.core.layout import HostLayout
from freetoken_infra.core.records import record
from freetoken_infra.core.settings import Settings

GATE_SCRIPT_SOURCE = Path(__file__).resolve().parent / "scripts" / "health_gate.py"
GATE_SCRIPT_PATH = "/usr/local/lib/freetoken/health_gate.py"
ENGINE_UNIT = "freetoken.service"
JOURNAL_LINES = 30
# Time the chat and the stream may take once /health says ok (cold first requests compile
# kernels), on top of settings.health_timeout_s.
INFERENCE_MARGIN_S = 300
# The operation's privilege arguments (``_sudo=True`` ...) also apply to the gate's own commands:
# a python callback does not inherit them, so they are handed over explicitly.
_ELEVATION_ARGS = ("_sudo", "_sudo_user", "_use_sudo_login", "_sudo_password", "_preserve_sudo_env",
                   "_su_user", "_use_su_login", "_preserve_su_env", "_su_shell", "_su_password",
                   "_doas", "_doas_user", "_dzdo", "_dzdo_user")

# host name -> the gate script's result, plus "decode_floor_tps" (the host's floor, or None).
# Written as each host's gate runs; GateReport prints the table (format_gate_report) when the
# run ends.
GATE_RESULTS: dict[str, dict[str, Any]] = {}
# host name -> the result its previous run's gate left on the host (None: none), read while the
# deploy is prepared: the tok/s shown for a host whose gate had nothing to prove again.
LAST_GATES: dict[str, Optional[dict[str, Any]]] = {}

_REMEDY = {
    "health": "see the engine's journal below; `systemctl status freetoken` and "
              "`pyinfra INVENTORY deploys/doctor.py` help, and a slow first start may need a "
              "larger health_timeout_s",
    "chat": "the engine is up but does not answer a chat; a 401 means the key file does not "
            "match the key the engine was started with (restart the service after a key change)",
    "stream": "the engine answers plain chats but not streamed ones; see the journal below",
}


def gate_url(settings: Settings) -> str:
    """Where the gate reaches the engine from the target itself."""
    address = ipaddress.ip_address(str(settings.listen_host))
    if address.is_unspecified:  # listening everywhere: loopback is one of them
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{settings.listen_port}"


def gate_command(settings: Settings, key_file: Optional[str], script_path: str = GATE_SCRIPT_PATH) -> str:
    """The shell command that runs the gate script on the target (no key in it, only its file)."""
    argv = ["python3", script_path, "--url", gate_url(settings),
            "--timeout", str(settings.health_timeout_s), "--model", settings.served_model_name]
    if key_file:
        argv += ["--key-file", key_file]
    return " ".join(shlex.quote(a) for a in argv)


def parse_gate_output(lines: list[str]) -> Optional[dict[str, Any]]:
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


def _gate_once(host, settings: Settings, key_file: Optional[str], script_path: str,
               elevation: Mapping[str, Any]) -> dict[str, Any]:
    """Run the gate script once; its JSON result (a failed one when it printed none)."""
    command = gate_command(settings, key_file, script_path)
    click.echo(f"{host.print_prefix}health gate: {gate_url(settings)} "
               f"(model {settings.served_model_name}, up to {settings.health_timeout_s} s)", err=True)
    # print_output streams the script's progress lines as they come, prefixed with the host.
    status, output = host.run_shell_command(
        command, print_output=True, **elevation,
        _timeout=settings.health_timeout_s + INFERENCE_MARGIN_S,
    )
    result = parse_gate_output(output.stdout_lines)
    if result is None:
        tail = "\n".join(output.output_lines[-10:])
        result = {"ok": False, "phase": "health", "load_wait_s": None, "decode_tps": None,
                  "completion_tokens": None,
                  "error": f"the gate script printed no result (exit {'0' if status else 'non-zero'}):\n{tail}"}
    elif not status and result.get("ok"):
        result = {**result, "ok": False, "error": "the gate script exited non-zero"}
    return {**result, "decode_floor_tps": settings.decode_floor_tps}


def _journal(host, elevation: Mapping[str, Any]) -> str:
    _, journal = host.run_shell_command(
        f"journalctl -u {ENGINE_UNIT} -n {JOURNAL_LINES} --no-pager -o cat", **elevation,
    )
    return "\n".join("    " + line for line in journal.output_lines) or "    (no journal lines)"


def _keep_result(host, result: Mapping[str, Any], path: Optional[str], elevation: Mapping[str, Any]) -> None:
    """Leave the result on the host (no secret in it) for later reports; best effort."""
    if path:
        text = shlex.quote(json.dumps(dict(result)))
        host.run_shell_command(f"umask 022 && printf '%s\\n' {text} > {shlex.quote(path)}", **elevation)


def rollback_command(settings: Settings, version: str) -> str:
    """Point the ``active`` link back at ``version`` (atomically) and restart the engine."""
    target = shlex.quote(f"{settings.engine_base_dir}/{version}")
    link = shlex.quote(settings.engine_active_link)
    return (f"ln -sfn {target} {link}.rollback && mv -Tf {link}.rollback {link} && "
            f"systemctl restart {ENGINE_UNIT}")


def run_gate(state, host, settings: Settings, key_file: Optional[str],
             script_path: str = GATE_SCRIPT_PATH,
             elevation: Optional[Mapping[str, Any]] = None,
             rollback_to: Optional[str] = None,
             result_path: Optional[str] = None) -> dict[str, Any]:
    """Execution-time half of the operation: run the script, record, or raise OperationError.

    ``elevation``: connector arguments such as ``{"_sudo": True}`` for the gate's commands.
    ``rollback_to``: the engine version that served before this run switched to
    ``settings.engine_version``; when the gate fails, the ``active`` link goes back to it, the
    engine restarts and the gate runs again. The host still fails (the upgrade did), with
    ``rolled back to <version>: <why>``. ``result_path``: file on the host that keeps the last
    result (``HostLayout.last_gate_file``).
    """
    elevation = dict(elevation or {})
    result = _gate_once(host, settings, key_file, script_path, elevation)
    GATE_RESULTS[host.name] = result
    _keep_result(host, result, result_path, elevation)
    if result["ok"]:
        record(host.name, gate=result)
        return result

    journal_text = _journal(host, elevation)
    phase = result.get("phase") or "health"
    failure = (
        f"host {host.name}: the health gate failed in the {phase} phase: {result.get('error')}\n"
        f"  what to do: {_REMEDY.get(phase, _REMEDY['health'])}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{journal_text}"
    )
    if not rollback_to or rollback_to == settings.engine_version:
        record(host.name, gate=result)
        raise OperationError(failure)

    # Blue-green: the previous version's environment is still there; switch back to it.
    new = settings.engine_version
    reason = f"{new} failed the health gate in the {phase} phase: {_first_line(result.get('error'))}"
    click.echo(f"{host.print_prefix}{reason}; rolling back to {rollback_to}", err=True)
    switched, output = host.run_shell_command(rollback_command(settings, rollback_to), **elevation)
    if not switched:
        error = "switching back failed: " + " / ".join(output.output_lines[-5:])
        record(host.name, gate=result, rollback={"from": new, "to": rollback_to, "reason": reason,
                                                 "ok": False, "error": error})
        raise OperationError(f"host {host.name}: rollback to {rollback_to} failed: {error}\n{failure}")
    again = {**_gate_once(host, settings, key_file, script_path, elevation), "rolled_back_from": new}
    GATE_RESULTS[host.name] = again
    _keep_result(host, again, result_path, elevation)
    record(host.name, gate=again, rollback={
        "from": new, "to": rollback_to, "reason": reason, "ok": bool(again["ok"]),
        "error": None if again["ok"] else again.get("error")})
    if again["ok"]:
        raise OperationError(
            f"host {host.name}: rolled back to {rollback_to}: {reason}\n"
            f"  {rollback_to} serves again (health gate passed); {new} stays installed beside it\n"
            f"  what {new} logged:\n{journal_text}"
        )
    raise OperationError(
        f"host {host.name}: rollback to {rollback_to} failed too: the health gate failed in the "
        f"{again.get('phase') or 'health'} phase: {again.get('error')}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{_journal(host, elevation)}\n"
        f"  first failure ({new}): {_first_line(result.get('error'))}"
    )


def _first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0] if lines else ""


def health_gate(settings: Settings, key_file: Optional[str] = None, script_path: str = GATE_SCRIPT_PATH,
                rollback_to: Optional[str] = None, **operation_arguments):
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
    + operation_arguments: ``name=`` and pyinfra's global arguments (``_sudo``, ``_if`` ...)

    Run it as root (``_sudo=True``, or connected as root) so that the script can read the key
    file and the journal; the privilege arguments apply to the gate's commands too. The script
    (stdlib only, run by the target's ``python3``) polls ``/health`` until ``status: ok`` (printing progress), fails at once on
    ``status: error``, then sends a short chat and a streamed chat whose decode tokens/s it
    measures. The result lands in ``GATE_RESULTS[host.name]``. On failure the operation
    raises ``OperationError`` naming the host, the failed phase and the engine's last 30
    journal lines. Never idempotent: it always checks (skip it with ``_if`` when nothing
    changed). When every host of the run is done, the run prints one table
    (``GateReport``): each host's health, decode tok/s, or why it has none.

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
    GateReport.watch(current_host.state)
    LAST_GATES[current_host.name] = _json_or_none(
        current_host.get_fact(FileText, path=HostLayout.of(settings).last_gate_file))
    return _health_gate(settings=settings, key_file=key_file, script_path=script_path,
                        rollback_to=rollback_to, **operation_arguments)


@operation(is_idempotent=False)
def _health_gate(settings: Settings, key_file: Optional[str], script_path: str, rollback_to: Optional[str]):
    """The operation behind ``health_gate`` (see there)."""
    yield from files.put._inner(
        src=str(GATE_SCRIPT_SOURCE),
        dest=script_path,
        user="root",
        group="root",
        mode="755",
        add_deploy_dir=False,
    )
    global_arguments = current_host.current_op_global_arguments or {}
    elevation = {k: global_arguments[k] for k in _ELEVATION_ARGS if global_arguments.get(k)}
    yield FunctionCommand(run_gate, (settings, key_file, script_path, elevation),
                          {"rollback_to": rollback_to, "result_path": HostLayout.of(settings).last_gate_file})


def _json_or_none(text: Optional[str]) -> Optional[dict[str, Any]]:
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class GateReport(BaseStateCallback):
    """Prints the health gate table once every host of the run is done (pyinfra disconnects
    from each host last, failed ones included): a host's gate result, the last gate of a host
    with nothing to prove again, or why a host never reached its gate."""

    def __init__(self) -> None:
        self.failed_ops: dict[str, list[str]] = {}
        self.done: set[str] = set()

    @classmethod
    def watch(cls, state) -> None:
        """Register the report with this run (once)."""
        if not any(isinstance(h, cls) for h in state.callback_handlers):
            state.add_callback_handler(cls())

    def operation_host_error(self, state, host, op_hash, retry_count: int = 0, max_retries: int = 0):
        names = sorted(state.get_op_meta(op_hash).names) or ["an operation"]
        self.failed_ops.setdefault(host.name, []).extend(names)

    def host_disconnect(self, state, host):
        self.done.add(host.name)
        hosts = sorted(h.name for h in state.activated_hosts)
        if set(hosts) <= self.done:
            click.echo("\n" + format_gate_report(self.rows(hosts, {h.name for h in state.active_hosts})),
                       err=True)

    def rows(self, hosts: list[str], active: set[str]) -> dict[str, dict[str, Any]]:
        rows: dict[str, dict[str, Any]] = {}
        for name in hosts:
            if name in GATE_RESULTS:
                rows[name] = GATE_RESULTS[name]
            elif name in active and name in LAST_GATES:
                # Healthy before the run and nothing changed: the gate had nothing to prove.
                rows[name] = {**(LAST_GATES[name] or {}), "ok": True, "checked": False}
            elif name in self.failed_ops:
                rows[name] = {"ok": False, "stopped": "failed at: " + "; ".join(self.failed_ops[name])}
            else:
                rows[name] = {"ok": False, "stopped": "refused at preflight (findings above)"}
        return rows


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def format_gate_report(results: Mapping[str, Mapping[str, Any]], floor_tps: Optional[float] = None) -> str:
    """Per-host table of gate results (``GATE_RESULTS``), flagging decode speeds below the floor.

    Each host's floor is its recorded ``decode_floor_tps``; ``floor_tps`` applies to hosts
    without one. A result with ``"checked": False`` is a host's last gate (marked ``*``); one
    with ``"stopped": REASON`` a host that never reached its gate.
    """
    header = ("host", "health", "load wait", "decode tok/s", "floor", "note")
    rows = []
    failed = below = stopped = 0
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
        rows.append((name, health, _seconds(r.get("load_wait_s")), tps_text,
                     f"{floor:g}" if floor is not None else "-", note))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        return "  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)).rstrip()

    lines = ["== health gate ==", fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [fmt(row) for row in rows]
    serving = len(rows) - failed - stopped
    summary = f"{len(rows)} host(s): {serving} serving, {below} below the decode floor, {failed} failed"
    lines.append(summary + (f", {stopped} stopped before the gate" if stopped else ""))
    if any(r.get("checked") is False and isinstance(r.get("decode_tps"), (int, float)) for r in results.values()):
        lines.append("* tok/s of the host's last health gate (nothing changed, so the gate did not run again)")
    return "\n".join(lines)
