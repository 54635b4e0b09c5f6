"""The run record: what a deploy run saw and did, per host, as JSON lines.

The deploy appends records to the file named by $FREETOKEN_RUN_RECORD (set by the rollout;
nothing is recorded without it): what the facts saw at preflight, the health gate's result, a
rollback, failed operations, and at disconnect whether pyinfra failed the host and how many
operations changed something. The operations write it, the report and the rollout read it:
one structured path, no console text scraped.

Within the run, the same results live on one object attached to the run's pyinfra State
(``RunRecords``), never in module globals.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import click
from pyinfra.api.state import BaseStateCallback

from freetoken_infra.core.pyinfra_internals import changed_operations, connection_lost, is_active, reached_host_names

RECORD_ENV = "FREETOKEN_RUN_RECORD"


def record(host_name: str, **fields: Any) -> None:
    """Append one record for `host_name` to $FREETOKEN_RUN_RECORD (no-op when unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"host": host_name, **fields}, default=str)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def read_records(path: str) -> dict[str, list[dict[str, Any]]]:
    """The records of one deploy run, by host (a torn last line is ignored)."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return by_host
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("host"), str):
            by_host.setdefault(doc["host"], []).append(doc)
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
    host of the run is done, the functions in ``at_end`` run (the health gate's table).
    """

    def __init__(self) -> None:
        self.settings: dict[str, Any] | None = None  # host name -> Settings (preflight.fleet_settings)
        self.preflight: dict[str, Any] = {}  # host name -> rules.HostPreflight
        self.summary_printed = False
        self.gates: dict[str, dict[str, Any]] = {}  # host name -> this run's gate result
        self.last_gates: dict[str, dict[str, Any] | None] = {}  # host name -> its previous gate record
        self.failed_ops: dict[str, list[str]] = {}
        self.lost: dict[str, str] = {}  # host name -> the step during which its connection dropped
        self.done: set[str] = set()
        self.at_end: list[Callable[[RunRecords, Any], None]] = []

    @classmethod
    def of(cls, state: Any) -> RunRecords:
        """This run's records (created and registered on the first call)."""
        for handler in state.callback_handlers:
            if isinstance(handler, cls):
                return handler
        run = cls()
        state.add_callback_handler(run)
        return run

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
        if (
            self.at_end
            and connection_lost(host)
            and not self.gates.get(host.name, {}).get("cut_off")
            and host.name not in self.lost
        ):
            self.lost_during(host.name, "; ".join(names))

    def lost_during(self, host_name: str, step: str, say: bool = True) -> str:
        """The host's connection dropped during ``step``: kept for the gate table, written for
        the fleet report, and (``say``) printed as its one line. Returns that line."""
        self.lost[host_name] = step
        record(host_name, lost={"step": step})
        line = lost_line(host_name, step)
        if say:
            click.echo(line, err=True)
        return line

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        if self.preflight:
            changes = changed_operations(state, host)
            record(host.name, finished={"failed": not is_active(state, host), "changes": changes})
        self.done.add(host.name)
        if reached_host_names(state) <= self.done:
            for report in self.at_end:
                report(self, state)
