"""One reporting path: a run's results live on one object attached to its pyinfra State
(core/records.RunRecords), never in module globals, and the report takes the preflight's record
of a host instead of reading the host again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pyinfra.api import Config, Inventory, State

from facts.engine import EngineHealthInfo
from freetoken_infra import preflight, rules
from freetoken_infra.core.gate_record import GateResult
from freetoken_infra.core.records import (
    RECORD_ENV,
    Finished,
    HealthSeen,
    Lost,
    Observed,
    Rollback,
    RunRecord,
    RunRecordError,
    RunRecords,
    read_records,
)
from freetoken_infra.core.settings import Settings
from freetoken_infra.report import host_row, print_gate_report, record_host
from operations import health
from tests.unit.test_rules import healthy


def run_state(hosts, **data) -> State:
    """A pyinfra State of its own, as each run of the CLI makes one."""
    return State(Inventory((list(hosts), data)), Config())


class CutHost:
    """A host whose connection is gone: every command raises as a dropped SSH socket does."""

    print_prefix = "[ws1] "

    def __init__(self, name: str) -> None:
        self.name = name

    def run_shell_command(self, command, **arguments):
        raise OSError("Socket is closed")


class ActivatedState:
    """The parts of pyinfra's State the gate table reads once hosts are connected."""

    def __init__(self, state: State, names) -> None:
        self.callback_handlers = state.callback_handlers
        self.add_callback_handler = state.add_callback_handler
        self.activated_hosts = {type("H", (), {"name": n})() for n in names}
        self.active_hosts: set = set()


def test_each_state_has_its_own_records_created_once():
    first, second = run_state(["ws1"]), run_state(["ws1"])
    run = RunRecords.of(first)
    assert RunRecords.of(first) is run and first.callback_handlers == [run]
    assert RunRecords.of(second) is not run


def test_two_runs_in_one_process_do_not_share_gate_results(capsys):
    """The gate result of one run (here, a gate cut off) is not another run's: the second run's
    table says ws1 never reached its gate (module-level results showed the first run's row)."""
    first, second = run_state(["ws1"]), run_state(["ws1"])
    assert health.run_gate(first, CutHost("ws1"), Settings(), None) is False
    assert RunRecords.of(first).gates["ws1"].cut_off is True
    assert RunRecords.of(second).gates == {}
    capsys.readouterr()
    print_gate_report(RunRecords.of(second), ActivatedState(second, ["ws1"]))
    row = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("ws1 "))
    assert "no gate: refused at preflight" in row and "cut off" not in row


def test_two_runs_validate_their_own_settings():
    first = run_state(["ws1"], listen_port=8001)
    second = run_state(["ws1"], listen_port=8002)
    assert preflight.fleet_settings(first)["ws1"].listen_port == 8001
    assert preflight.fleet_settings(second)["ws1"].listen_port == 8002
    assert RunRecords.of(first).settings is preflight.fleet_settings(first)


class NoFactsHost:
    """A host of which the preflight's facts were already gathered: reading one more raises."""

    name = "ws1"

    def get_fact(self, *args, **kwargs):
        raise AssertionError(f"a fact was read after the preflight: {args}")


def test_the_report_takes_the_preflights_record_without_reading_the_host(tmp_path, monkeypatch, capsys):
    record_file = tmp_path / "run.jsonl"
    monkeypatch.setenv(RECORD_ENV, str(record_file))
    serving = EngineHealthInfo(True, "ok", "ready", None, None, "0.2.1", "m", None, None)
    last_gate = GateResult(ok=True, decode_tps=23.9)
    obs = replace(
        healthy(engine=replace(healthy().engine, active="0.2.1")),
        health=serving,
        gate_record=last_gate,
        restart_pending=["/etc/wsl.conf"],
    )
    monkeypatch.setattr(preflight, "observe", lambda host, settings, **kwargs: obs)
    state = run_state(["ws1"])
    pre, ok = preflight.run_preflight(state, NoFactsHost())
    assert ok and pre.observations is obs and RunRecords.of(state).preflight == {"ws1": pre}
    assert "== ws1: preflight ==" in capsys.readouterr().err

    observed = read_records(str(record_file))["ws1"][0].observed
    assert observed is not None and observed.health == HealthSeen("ok", "0.2.1", None)
    assert observed.last_gate == last_gate and observed.restart_pending == ("/etc/wsl.conf",)
    # the rollout's row of an unchanged host: the last gate's tok/s, from the preflight's record
    row = host_row("ws1", [RunRecord("ws1", observed=observed, finished=Finished(failed=False, changes=0))])
    assert (row.health, row.tokens_per_s, row.tokens_per_s_source) == ("ok", 23.9, "last gate")
    assert row.restart_pending is True


def test_record_host_needs_no_host(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "run.jsonl"))
    blocked = rules.HostPreflight(Settings(), healthy(), [rules.Finding("wsl2", "block", "WSL1")])
    record_host("ws3", blocked)
    doc = json.loads((tmp_path / "run.jsonl").read_text())
    assert doc["observed"]["blockers"] == ["wsl2"] and doc["observed"]["health"] is None


def test_a_connection_lost_before_any_step_is_said_once_and_shown_in_the_gate_table(capsys):
    """The deploy's fact reads (with the host lock) lost their connection: the line it prints is
    the one a step's loss prints, and the gate table says so (not 'refused at preflight')."""
    state = run_state(["ws1", "ws2"])
    run = RunRecords.of(state)
    line = run.lost_during("ws1", "the host lock and the fact reads (before any change)", say=False)
    assert line == "ws1: connection lost during the host lock and the fact reads (before any change); re-run to finish"
    assert capsys.readouterr().err == ""  # the caller prints it, once
    print_gate_report(run, ActivatedState(state, ["ws1", "ws2"]))
    rows = {line.split()[0]: line for line in capsys.readouterr().err.splitlines() if line.startswith("ws")}
    assert "connection lost during the host lock and the fact reads" in rows["ws1"]
    assert "refused at preflight" in rows["ws2"]


# --------------------------------------------------------------------------- typed records
EVERY_KIND = [
    RunRecord(
        "ws1", observed=Observed(gpu="RTX", vram_mib=16311, blockers=("wsl2",), health=HealthSeen("ok", "0.2.1"))
    ),
    RunRecord(
        "ws1", observed=Observed(last_gate=GateResult(ok=True, decode_tps=23.9), restart_pending=("/etc/wsl.conf",))
    ),
    RunRecord("ws1", gate=GateResult(ok=False, phase="answer", error="wrong answer", decode_floor_tps=5)),
    RunRecord("ws1", rollback=Rollback("0.2.2", "0.2.1", "0.2.2 failed", ok=True)),
    RunRecord("ws1", gate=GateResult(ok=False, phase="cut off", cut_off=True), lost=Lost("the health gate")),
    RunRecord("ws1", unreachable="Could not connect (timed out)"),
    RunRecord("ws1", op_error="CUDA: toolkit packages"),
    RunRecord("ws1", finished=Finished(failed=False, changes=3)),
    RunRecord("ws1", restart_pending=("/mnt/c/Users/a/.wslconfig",)),
]


@pytest.mark.parametrize("entry", EVERY_KIND)
def test_every_run_record_round_trips_through_one_json_line(entry):
    line = entry.to_json()
    assert "\n" not in line and RunRecord.from_json(line) == entry


def test_a_rollback_keeps_its_json_names():
    doc = json.loads(RunRecord("ws1", rollback=Rollback("0.2.2", "0.2.1", "why", ok=False, error="e")).to_json())
    assert doc == {
        "host": "ws1",
        "rollback": {"from": "0.2.2", "to": "0.2.1", "reason": "why", "ok": False, "error": "e"},
    }


@pytest.mark.parametrize(
    "doc, why",
    [
        ({"op_error": "x"}, "host"),
        ({"host": 7}, "host: not str"),
        ({"host": "ws1", "finished": {"failed": "no", "changes": 1}}, "finished: failed: not bool"),
        ({"host": "ws1", "finished": {"failed": False, "changes": True}}, "finished: changes: not int"),
        ({"host": "ws1", "lost": "the gate"}, "lost: not a JSON object"),
        ({"host": "ws1", "restart_pending": "/etc/wsl.conf"}, "restart_pending: not a list"),
        ({"host": "ws1", "observed": {"blockers": [1]}}, "observed: blockers: not str"),
        ({"host": "ws1", "gate": {"ok": "yes"}}, "gate: ok must be true or false"),
        ({"host": "ws1", "observed": {"last_gate": {"ok": True, "decode_tps": "x"}}}, "last_gate: decode_tps must"),
    ],
)
def test_a_malformed_run_record_is_refused_with_its_reason(doc, why):
    with pytest.raises(RunRecordError) as refused:
        RunRecord.from_dict(doc)
    assert why in str(refused.value)


def test_the_record_file_keeps_only_records(tmp_path):
    """A torn last line, or a line that is not a record, is left out of what the report reads."""
    path = tmp_path / "run.jsonl"
    good = RunRecord("ws1", finished=Finished(failed=False, changes=0))
    path.write_text(good.to_json() + '\n{"host": "ws1", "finished": {"failed": "no"}}\n[]\n{"host": "ws2", "to')
    assert read_records(str(path)) == {"ws1": [good]}
