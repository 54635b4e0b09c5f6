"""bench/converge.py's own parts, against today's code: the pyinfra and project functions its
hook wraps (renamed or re-shaped, the hook would go on counting nothing), the deploy's lines it
counts the fast check's answers by, and its arithmetic of a run's phases (the bench itself needs
the simulated fleet)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from bench import converge as bench

ROOT = Path(__file__).resolve().parents[2]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_what_the_hook_wraps_is_there_with_the_arguments_it_passes():
    from pyinfra.api import facts as api_facts
    from pyinfra.api import operations as api_ops
    from pyinfra.api.state import State, StateOperationMeta
    from pyinfra.connectors.ssh import SSHConnector

    from facts import batch
    from operations import host_lock

    assert _params(api_facts._get_fact)[:5] == ["state", "host", "cls", "args", "kwargs"]
    assert _params(api_ops._run_host_op) == ["state", "host", "op_hash"]
    assert _params(State.get_op_meta) == ["self", "op_hash"]
    assert isinstance(StateOperationMeta((1,)).names, set)  # joined into the operation's label
    for method in ("connect", "run_shell_command", "put_file", "get_file"):
        assert callable(getattr(SSHConnector, method)), method
    assert _params(host_lock.take)[:2] == ["state", "host"] and "unchanged_if" in _params(host_lock.take)
    assert _params(batch.run_batch) == ["state", "host", "requests", "first"]
    assert _params(batch.batch_command)[:2] == ["commands", "first"]


def _product_sources() -> str:
    return "\n".join(
        p.read_text(encoding="utf-8")
        for top in ("deploys", "freetoken_infra", "operations")
        for p in sorted((ROOT / top).rglob("*.py"))
    )


def test_the_fast_checks_answers_are_counted_by_the_lines_the_deploy_prints(capsys):
    """The two lines a host answered by its record prints (a converge's, a refusal's), as the
    deploy prints them (its plan's notices, report.announce), and lines that are not answers."""
    from freetoken_infra import plan, report
    from freetoken_infra.core.records import Unchanged

    class State:  # what RunRecords.of needs of pyinfra's State
        callback_handlers: list = []

        def add_callback_handler(self, handler):
            self.callback_handlers.append(handler)

    state = State()
    for answered in (Unchanged("ws1", 41), Unchanged("ws3", 12, (("wsl_version", "WSL 2.6.1", "wsl.exe --update"),))):
        p = plan.converge_plan(answered, render=None)  # type: ignore[arg-type]
        report.announce(state, answered.host_name, p.notices, p.answered)
    printed = capsys.readouterr().err
    run = bench.Run((), 1.0, 0, "", [], 1.0, 0.0, {})
    run.output = "\n".join(
        [
            *printed.splitlines(),
            "    [ws2] Loaded fact facts.engine.EngineInstall",
            "--> Preparing operations...",
            "    unchanged since its last converge (no host name: not a host's line)",
        ]
    )
    assert len(printed.splitlines()) == 2 and bench.answered_from_record(run) == 2


def test_covered_counts_overlapping_calls_once():
    calls = [{"t0": 0.0, "dt": 2.0}, {"t0": 1.0, "dt": 2.0}, {"t0": 5.0, "dt": 1.0}, {"t0": 5.2, "dt": 0.3}]
    assert bench.covered(calls) == pytest.approx(4.0)
    assert bench.covered([]) == 0.0


def test_the_phases_of_a_run():
    calls = [
        {"host": "ws1", "call": "connect", "kind": "other", "label": "", "t0": 1.0, "dt": 0.5},
        {"host": "ws1", "call": "run_shell_command", "kind": "fact", "label": "f", "t0": 1.5, "dt": 1.0},
        {"host": "ws2", "call": "run_shell_command", "kind": "fact", "label": "f", "t0": 2.0, "dt": 1.0},
        {"host": "ws1", "call": "run_shell_command", "kind": "operation", "label": "o", "t0": 4.0, "dt": 2.0},
    ]
    run = bench.Run((), 9.0, 0, "", calls, 8.0, 3.0, {"ws1": 1.0, "ws2": 0.5})
    p = bench.phases(run)
    assert p["start-up"] == 1.0 and p["connect"] == 0.5 and p["facts"] == pytest.approx(1.5)
    assert p["operations"] == 2.0 and p["rest"] == pytest.approx(8.0 - 1.0 - 4.0)
    assert (p["controller CPU"], p["hosts' CPU"]) == (3.0, 1.5)
    assert bench.host_span(run, "ws1") == pytest.approx(5.0) and bench.host_span(run, "ws9") is None
    assert sum(bench.remote_commands(run, "ws1").values()) == 2  # connect is not a command
    assert run.hosts() == ["ws1", "ws2"]


def test_the_sizes_and_limits_of_a_run():
    assert bench.parse_sizes(None, 12) == [1, 3, 6, 12] and bench.parse_sizes(None, 3) == [1, 2, 3]
    assert bench.parse_sizes("12,3", 12) == [1, 3, 12]
    for bad in ("0", "13", "a,b"):
        with pytest.raises(SystemExit):
            bench.parse_sizes(bad, 12)
    assert bench.limit_for(12, 12) == () and bench.limit_for(2, 12) == ("ws1", "ws2")
    assert bench.size_label(1, 12) == "1 host (ws1)"
    assert bench.size_label(3, 12) == "3 hosts (--limit ws1..ws3; includes ws3, refused at preflight by design)"
