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
from pyinfra.operations import files

from freetoken_infra.settings import Settings

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
# Written as each host's gate runs; a deploy prints format_gate_report(GATE_RESULTS) at the end.
GATE_RESULTS: dict[str, dict[str, Any]] = {}

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


def run_gate(state, host, settings: Settings, key_file: Optional[str],
             script_path: str = GATE_SCRIPT_PATH,
             elevation: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """Execution-time half of the operation: run the script, record, or raise OperationError.

    ``elevation``: connector arguments such as ``{"_sudo": True}`` for the gate's commands.
    """
    elevation = dict(elevation or {})
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
    result = {**result, "decode_floor_tps": settings.decode_floor_tps}
    GATE_RESULTS[host.name] = result
    if result["ok"]:
        return result

    _, journal = host.run_shell_command(
        f"journalctl -u {ENGINE_UNIT} -n {JOURNAL_LINES} --no-pager -o cat", **elevation,
    )
    journal_text = "\n".join("    " + line for line in journal.output_lines) or "    (no journal lines)"
    phase = result.get("phase") or "health"
    raise OperationError(
        f"host {host.name}: the health gate failed in the {phase} phase: {result.get('error')}\n"
        f"  what to do: {_REMEDY.get(phase, _REMEDY['health'])}\n"
        f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{journal_text}"
    )


@operation(is_idempotent=False)
def health_gate(settings: Settings, key_file: Optional[str] = None, script_path: str = GATE_SCRIPT_PATH):
    """
    Wait until the FreeToken engine serves, then prove it with a chat and a timed stream.

    + settings: the host's ``Settings``; uses ``listen_host``/``listen_port`` (the URL,
      loopback when listening on all addresses), ``health_timeout_s`` (how long loading may
      take), ``served_model_name`` and ``decode_floor_tps`` (recorded for the report)
    + key_file: env-style file on the target with ``FREETOKEN_API_KEY=...`` (the service's
      key); ``None`` when the engine runs without a key
    + script_path: where the gate script is uploaded on the target

    Run it as root (``_sudo=True``, or connected as root) so that the script can read the key
    file and the journal; the privilege arguments apply to the gate's commands too. The script
    (stdlib only, run by the target's ``python3``) polls ``/health`` until ``status: ok`` (printing progress), fails at once on
    ``status: error``, then sends a short chat and a streamed chat whose decode tokens/s it
    measures. The result lands in ``GATE_RESULTS[host.name]``. On failure the operation
    raises ``OperationError`` naming the host, the failed phase and the engine's last 30
    journal lines. Never idempotent: it always checks.

    **Example:**

    .. code:: python

        import click
        from pyinfra.operations import python

        from operations.health import GATE_RESULTS, format_gate_report, health_gate

        health_gate(
            name="Health gate: the endpoint loads and serves",
            settings=settings,
            key_file="/etc/freetoken/api.env",
            _sudo=True,
        )
        # Last op of the deploy: every host's gate has run (or failed) by then.
        python.call(
            name="Health gate report",
            function=lambda: click.echo(format_gate_report(GATE_RESULTS)),
            _run_once=True,
        )
    """
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
    yield FunctionCommand(run_gate, (settings, key_file, script_path, elevation), {})


def _seconds(value: Any) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def format_gate_report(results: Mapping[str, Mapping[str, Any]], floor_tps: Optional[float] = None) -> str:
    """Per-host table of gate results (``GATE_RESULTS``), flagging decode speeds below the floor.

    Each host's floor is its recorded ``decode_floor_tps``; ``floor_tps`` applies to hosts
    without one.
    """
    header = ("host", "ok", "load wait", "decode tok/s", "floor", "note")
    rows = []
    failed = below = 0
    for name in sorted(results):
        r = results[name]
        floor = r.get("decode_floor_tps")
        floor = floor_tps if floor is None else floor
        tps = r.get("decode_tps")
        note = ""
        if not r.get("ok"):
            failed += 1
            error = str(r.get("error") or "").splitlines()
            note = f"FAILED in {r.get('phase') or '?'}: {error[0] if error else ''}"
        elif floor is not None and (tps is None or tps < floor):
            below += 1
            note = "below floor" if tps is not None else "below floor (not measured)"
        rows.append((name, "yes" if r.get("ok") else "NO", _seconds(r.get("load_wait_s")),
                     f"{tps:.1f}" if isinstance(tps, (int, float)) else "-",
                     f"{floor:g}" if floor is not None else "-", note))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        return "  ".join(f"{str(c):<{w}}" for c, w in zip(row, widths)).rstrip()

    lines = ["== health gate ==", fmt(header), "-" * (sum(widths) + 2 * (len(widths) - 1))]
    lines += [fmt(row) for row in rows]
    ok = len(rows) - failed
    lines.append(f"{len(rows)} host(s): {ok} serving, {below} below the decode floor, {failed} failed")
    return "\n".join(lines)
