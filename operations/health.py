"""
The health gate: the last step of a converge, proving the endpoint serves.

A unit that is "active" only means the process runs; FreeToken binds its HTTP port before the
weights load (2-3 min on a cold kernel cache, field report) and may still die after loading.
The gate waits on the engine's own readiness (``/health`` JSON), then sends a real chat and a
timed stream, on the target itself (the engine listens on loopback by default).
"""

from __future__ import annotations

import ipaddress
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import click
from pyinfra import host as current_host
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.operations import files

from facts.files import FileText
from facts.model_manifest import ModelManifest
from freetoken_infra.core.gate_record import (
    CUT_OFF,
    NOT_FINISHED,
    PHASE_STARTED,
    REMEDY,
    Gated,
    GateRecordError,
    GateResult,
    parse_output,
)
from freetoken_infra.core.layout import ENGINE_UNIT, GATE_RECORD_FILE, GATE_RECORD_MODULE, GATE_SCRIPT, HostLayout
from freetoken_infra.core.pyinfra_internals import connection_lost, current_op_elevation
from freetoken_infra.core.records import Lost, Rollback, RunRecords, first_line, lost_line, record
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.text import printable, printable_block

GATE_SCRIPT_SOURCE = Path(__file__).resolve().parent / "scripts" / "health_gate.py"
# The gate result's schema, uploaded beside the script, which imports it (one schema, one home).
GATE_RECORD_SOURCE = Path(__file__).resolve().parents[1] / "freetoken_infra" / "core" / "gate_record.py"
GATE_SCRIPT_PATH = GATE_SCRIPT
JOURNAL_LINES = 30
# Time the chat and the stream may take once /health says ok (cold first requests compile
# kernels), on top of settings.health_timeout_s.
INFERENCE_MARGIN_S = 300


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
    argv = ["python3", script_path, "--url", gate_url(settings), "--timeout", str(settings.health_timeout_s)]
    argv += ["--model", settings.served_model_name]
    if key_file:
        argv += ["--key-file", key_file]
    if expect_version:
        argv += ["--expect-version", expect_version]
    return " ".join(shlex.quote(a) for a in argv)


def rollback_command(settings: Settings, version: str) -> str:
    """Point the ``active`` link back at ``version`` (atomically) and restart the engine."""
    target = shlex.quote(f"{settings.engine_base_dir}/{version}")
    link = shlex.quote(HostLayout.of(settings).engine_active_link)
    return f"ln -sfn {target} {link}.rollback && mv -Tf {link}.rollback {link} && systemctl restart {ENGINE_UNIT}"


@dataclass(frozen=True)
class GateInputs:
    """What one host's gate runs with. ``elevation``: connector arguments for its commands;
    ``rollback_to`` (``plan.rollback_target``): a failed gate switches back to it and gates it,
    and the host still fails (``rolled back to <version>: <why>``); ``record_path``: the host's
    gate record (None: none kept); ``subject`` (``plan.gate_subject``): kept in the record with
    the manifest's hash; ``previous``: the record before this run."""

    settings: Settings
    key_file: str | None
    script_path: str = GATE_SCRIPT_PATH
    elevation: Mapping[str, Any] = field(default_factory=dict)
    rollback_to: str | None = None
    record_path: str | None = None
    subject: Gated | None = None
    previous: GateResult | None = None


class HostGate:
    """One host's gate at execution time: run the script, keep the record on the host, roll back
    a failed upgrade. Its results land on the run's ``RunRecords`` and in the run record file."""

    def __init__(self, run: RunRecords, host, inputs: GateInputs) -> None:
        self.run, self.host, self.inputs = run, host, inputs
        # The host's last passed gate, carried into every record this run writes.
        self.last_passed = inputs.previous.last_passed_gate() if inputs.previous else None
        self.manifest_sha256: str | None = None

    def sh(self, command: str, **arguments: Any):
        """``host.run_shell_command``, raising ``ConnectionLost`` when the connection is gone."""
        host = self.host
        try:
            status, output = host.run_shell_command(command, **self.inputs.elevation, **arguments)
        except Exception as exc:  # paramiko's SSHException, socket errors, EOFError: all mean the same
            if connection_lost(host) or type(exc).__name__ in ("SSHException", "EOFError") or isinstance(exc, OSError):
                raise ConnectionLost(str(exc) or type(exc).__name__) from None
            raise
        if not status and connection_lost(host):
            raise ConnectionLost("the SSH session ended")
        return status, output

    # ------------------------------------------------------------------ the flow
    def run_gate(self) -> GateResult:
        """Gate what this run installed; on failure roll back (when there is a version to go
        back to) and raise ``OperationError`` saying what happened."""
        new, back = self.inputs.settings.engine_version, self.inputs.rollback_to
        if self.inputs.subject is not None:
            self.manifest_sha256 = self.manifest_hash()
        result = self.gate(new)
        if result.ok:
            record(self.host.name, gate=result)
            return result
        journal_text = self.journal()
        phase = result.phase or "health"
        failure = (
            f"host {self.host.name}: the health gate failed in the {printable(phase)} phase: "
            f"{printable_block(result.error)}\n"
            f"  what to do: {REMEDY.get(phase, REMEDY['health'])}\n"
            f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{journal_text}"
        )
        if not back or back == new:
            record(self.host.name, gate=result)
            raise OperationError(failure)
        self.roll_back(result, back, failure, journal_text)

    def roll_back(self, result: GateResult, back: str, failure: str, journal_text: str) -> NoReturn:
        """Blue-green: the previous version's environment is still there; switch back to it and
        gate it. The host still fails (its upgrade did)."""
        name, new = self.host.name, self.inputs.settings.engine_version
        phase, why = printable(result.phase or "health"), printable(first_line(result.error))
        reason = f"{new} failed the health gate in the {phase} phase: {why}"
        click.echo(f"{self.host.print_prefix}{reason}; rolling back to {back}", err=True)
        switched, output = self.sh(rollback_command(self.inputs.settings, back))
        if not switched:
            error = "switching back failed: " + " / ".join(printable(line) for line in output.output_lines[-5:])
            record(name, gate=result, rollback=Rollback(new, back, reason, ok=False, error=error))
            raise OperationError(f"host {name}: rollback to {back} failed: {error}\n{failure}")
        again = self.gate(back, rolled_back_from=new)
        rollback = Rollback(new, back, reason, ok=again.ok, error=None if again.ok else again.error)
        record(name, gate=again, rollback=rollback)
        if again.ok:
            raise OperationError(
                f"host {name}: rolled back to {back}: {reason}\n"
                f"  {back} serves again (health gate passed); {new} stays installed beside it\n"
                f"  what {new} logged:\n{journal_text}"
            )
        raise OperationError(
            f"host {name}: rollback to {back} failed too: the health gate failed in the "
            f"{printable(again.phase or 'health')} phase: {printable_block(again.error)}\n"
            f"  last {JOURNAL_LINES} lines of `journalctl -u {ENGINE_UNIT}`:\n{self.journal()}\n"
            f"  first failure ({new}): {printable(first_line(result.error))}"
        )

    def gate(self, version: str, rolled_back_from: str | None = None) -> GateResult:
        """Gate ``version`` once. Before the script runs, the record says the gate did not
        finish: a run cut off from here on leaves no passed gate for what is installed now, so
        the next run gates again."""
        started = GateResult(ok=False, phase=PHASE_STARTED, error=NOT_FINISHED, rolled_back_from=rolled_back_from)
        self.keep(started, version)
        result = replace(self.once(version), rolled_back_from=rolled_back_from)
        self.run.gates[self.host.name] = result
        self.keep(result, version)
        return result

    def cut_off(self, exc: ConnectionLost) -> bool:
        """The connection dropped: one line, a result that says so, the operation fails (False)."""
        step, floor, error = "the health gate", self.inputs.settings.decode_floor_tps, f"connection lost ({exc})"
        cut = GateResult(ok=False, phase=CUT_OFF, cut_off=True, error=error, decode_floor_tps=floor)
        self.run.gates[self.host.name] = cut
        record(self.host.name, gate=cut, lost=Lost(step))
        click.echo(lost_line(self.host.name, step), err=True)
        return False

    # ------------------------------------------------------------------ the commands
    def once(self, version: str) -> GateResult:
        """Run the gate script once; its result (a failed one when it printed none)."""
        settings = self.inputs.settings
        command = gate_command(settings, self.inputs.key_file, self.inputs.script_path, version)
        click.echo(
            f"{self.host.print_prefix}health gate: {gate_url(settings)} "
            f"(model {settings.served_model_name}, up to {settings.health_timeout_s} s)",
            err=True,
        )
        # print_output streams the script's progress lines as they come, prefixed with the host.
        status, output = self.sh(command, print_output=True, _timeout=settings.health_timeout_s + INFERENCE_MARGIN_S)
        try:
            result = parse_output(output.stdout_lines)
        except GateRecordError as exc:
            result = GateResult(ok=False, phase="health", error=f"{exc}")
        if result is None:
            tail = "\n".join(output.output_lines[-10:])
            error = f"the gate script printed no result (exit {'0' if status else 'non-zero'}):\n{tail}"
            result = GateResult(ok=False, phase="health", error=error)
        elif not status and result.ok:
            result = replace(result, ok=False, error="the gate script exited non-zero")
        # Only the script's own fields count; what the controller adds comes from here.
        return replace(result.script_part(), decode_floor_tps=settings.decode_floor_tps)

    def journal(self) -> str:
        _, journal = self.sh(f"journalctl -u {ENGINE_UNIT} -n {JOURNAL_LINES} --no-pager -o cat")
        # Engine text: escaped, so its lines cannot drive the operator's terminal.
        return "\n".join("    " + printable(line) for line in journal.output_lines) or "    (no journal lines)"

    def manifest_hash(self) -> str | None:
        """The model manifest's sha256, from the bytes the ``ModelManifest`` fact's command reads
        (the download's user's folder: no link followed, no FIFO opened, a cap); None when there
        is none or it was refused."""
        fact = ModelManifest()
        status, output = self.sh(fact.command(self.inputs.settings.model_dir))
        return fact.process(list(output.stdout_lines)).sha256 if status else None

    def keep(self, result: GateResult, version: str) -> None:
        """Leave the gate record on the host (no secret in it; root's directory), written beside
        and renamed into place, so that a cut run leaves the old record or the new one, never
        half. It says what was gated and keeps the host's last passed gate."""
        subject = self.inputs.subject
        gated = replace(subject, engine_version=version, manifest_sha256=self.manifest_sha256) if subject else None
        doc = replace(result, gated=gated, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if doc.ok:
            self.last_passed = doc.passed_part()
        path = self.inputs.record_path
        if path:
            text = shlex.quote(replace(doc, last_passed=self.last_passed).to_json())
            target, tmp = shlex.quote(path), shlex.quote(f"{path}.tmp")
            folder = shlex.quote(path.rsplit("/", 1)[0] or "/")
            self.sh(f"umask 022 && mkdir -p {folder} && printf '%s\\n' {text} > {tmp} && mv -f {tmp} {target}")


def run_gate(
    state,
    host,
    settings: Settings,
    key_file: str | None,
    script_path: str = GATE_SCRIPT_PATH,
    elevation: Mapping[str, Any] | None = None,
    rollback_to: str | None = None,
    result_path: str | None = None,
    subject: Gated | None = None,
    previous: GateResult | None = None,
) -> GateResult | bool:
    """Execution-time half of the operation (``HostGate`` with these ``GateInputs``): run the
    script, record, or raise OperationError; False (no traceback) when the connection drops."""
    inputs = GateInputs(
        settings, key_file, script_path, dict(elevation or {}), rollback_to, result_path, subject, previous
    )
    gate = HostGate(RunRecords.of(state), host, inputs)
    try:
        return gate.run_gate()
    except ConnectionLost as exc:
        return gate.cut_off(exc)


def gate_record(settings: Settings, record_path: str = GATE_RECORD_FILE) -> GateResult | None:
    """The host's gate record as it was before this run; None when there is none or it is not
    a gate record (said in one line; this run's gate writes a new one)."""
    text = current_host.get_fact(FileText, path=record_path)
    if not text:
        return None
    try:
        return GateResult.from_json(text, f"the gate record {record_path}")
    except GateRecordError as exc:
        click.echo(f"{current_host.print_prefix}{printable(exc)}; the gate runs and writes a new one", err=True)
        return None


def health_gate(
    settings: Settings,
    key_file: str | None = None,
    script_path: str = GATE_SCRIPT_PATH,
    rollback_to: str | None = None,
    subject: Gated | None = None,
    record_path: str = GATE_RECORD_FILE,
    **operation_arguments,
):
    """
    Wait until the FreeToken engine serves, then prove it with a chat and a timed stream.

    + settings: the host's ``Settings`` (``listen_host``/``listen_port``: the URL, loopback when
      listening everywhere; ``health_timeout_s``; ``served_model_name``; ``decode_floor_tps``)
    + key_file: the service's env-style key file on the target; ``None``: the engine has no key
    + script_path: where the gate script (and its schema, beside it) is uploaded on the target
    + rollback_to, subject, record_path: see ``GateInputs``
    + operation_arguments: ``name=`` and pyinfra's global arguments (``_sudo``, ``_if`` ...)

    Run it as root (the key file, the journal). The script (stdlib only) polls ``/health``
    until ``status: ok``, fails on ``status: error`` or another engine version, asks a question
    with one right answer and times a streamed chat's decode tokens/s. The result lands in
    ``RunRecords.gates``; a failure raises ``OperationError`` naming the host, the phase and the
    engine's last 30 journal lines. Never idempotent: skip it with ``_if``. The host's previous
    record lands in ``RunRecords.last_gates`` (the gate table shows a skipped host too).
    """
    # Here, at prepare time: a gate skipped with `_if` never runs, and the table shows every host.
    previous = gate_record(settings, record_path)
    RunRecords.of(current_host.state).last_gates[current_host.name] = previous
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
    subject: Gated | None,
    previous: GateResult | None,
    record_path: str,
):
    """The operation behind ``health_gate`` (see there): the script and its schema, then the
    gate itself (``run_gate``, at execution time)."""
    module = f"{script_path.rsplit('/', 1)[0]}/{GATE_RECORD_MODULE.rsplit('/', 1)[1]}"
    for src, dest, mode in ((GATE_SCRIPT_SOURCE, script_path, "755"), (GATE_RECORD_SOURCE, module, "644")):
        yield from files.put._inner(src=str(src), dest=dest, user="root", group="root", mode=mode, add_deploy_dir=False)
    elevation = current_op_elevation(current_host)
    yield FunctionCommand(
        run_gate,
        (settings, key_file, script_path, elevation),
        {"rollback_to": rollback_to, "result_path": record_path, "subject": subject, "previous": previous},
    )
