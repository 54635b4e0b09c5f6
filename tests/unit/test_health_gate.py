"""The health gate, against the FreeToken engine stand-in on loopback.

The gate script runs as it does on a target (a separate python process, stdlib only); the
operation's execution-time half runs with a host double whose shell is this machine's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import CommandOutput, OutputLine

from freetoken_infra import plan
from freetoken_infra.core.gate_record import CUT_OFF, Gated, GateRecordError, GateResult
from freetoken_infra.core.records import RunRecords
from freetoken_infra.core.settings import Settings
from freetoken_infra.report import format_gate_report, print_gate_report
from operations import health
from operations.health import gate_command, gate_url, run_gate
from tests.loopback import free_port, wait_listening

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SRC = ROOT / "tests" / "fleet" / "standins" / "engine"
SCRIPT = ROOT / "operations" / "scripts" / "health_gate.py"
MODEL_NAME = "Qwen3.6-35B-A3B-NVFP4-nvidia"
KEY = "ft-test-key-5d1c0a9e7b"
PACE = 30.0  # tokens/s of the stand-in


class StandinEngine:
    def __init__(self, workdir: Path, model: Path, **config):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port(with_next=True)
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = workdir / "standin.json"
        cfg.write_text(
            json.dumps({"tokens_per_s": PACE, "load_seconds": 3, "error_exit_delay_s": 10, "broken": False, **config})
        )
        env = dict(os.environ, PYTHONPATH=str(ENGINE_SRC), FREETOKEN_STANDIN_CONFIG=str(cfg), FREETOKEN_API_KEY=KEY)
        self.log = workdir / "engine.log"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "freetoken",
                "--model-path",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait_bound(self) -> None:
        wait_listening(self.port, self.proc, "engine stand-in", self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture()
def engine_factory(tmp_path, model_dir):
    started = []

    def start(**config) -> StandinEngine:
        e = StandinEngine(tmp_path / f"engine{len(started)}", model_dir, **config)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def ready_engine(tmp_path_factory, model_dir):
    """One loaded engine shared by the tests that do not watch loading."""
    e = StandinEngine(tmp_path_factory.mktemp("ready"), model_dir, load_seconds=0.5)
    e.wait_bound()
    yield e
    e.stop()


@pytest.fixture()
def key_file(tmp_path) -> Path:
    f = tmp_path / "api.env"
    f.write_text(f"# written by the deploy\nFREETOKEN_API_KEY={KEY}\n")
    f.chmod(0o600)
    return f


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, elapsed: float):
        self.rc = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.elapsed = elapsed
        self.lines = proc.stdout.splitlines()
        self.result = GateResult.from_json(self.lines[-1])  # the schema the controller reads


def run_script(url: str, *extra: str, timeout: float = 30) -> Run:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--url", url, "--timeout", str(timeout), "--model", MODEL_NAME, *extra],
        capture_output=True,
        text=True,
        timeout=timeout + 120,
        env={k: v for k, v in os.environ.items() if k != "FREETOKEN_API_KEY"},
    )
    return Run(proc, time.monotonic() - t0)


def assert_key_hidden(run: Run) -> None:
    assert KEY not in run.stdout
    assert KEY not in run.stderr


# ---------------------------------------------------------------------------- the script
def test_passes_after_loading_with_progress(engine_factory, key_file, tmp_path):
    engine = engine_factory(load_seconds=4)
    out = tmp_path / "gate.json"
    run = run_script(engine.url, "--key-file", str(key_file), "--json-out", str(out))
    assert run.rc == 0, run.stdout + run.stderr
    r = run.result
    assert r.ok is True and r.phase == "done" and r.error is None
    assert r.load_wait_s >= 1.0
    progress = [line for line in run.lines if line.startswith("loading: ")]
    assert progress, run.stdout
    assert any("%" in line and "MB)" in line for line in progress), progress
    # At most one progress line per 2 s of the wait the script itself measured (not one per
    # poll): a bound that grows with a slow machine's longer wait instead of a fixed count.
    assert len(progress) <= r.load_wait_s / 2 + 1, (progress, r.load_wait_s)
    assert GateResult.from_json(out.read_text()) == r
    assert_key_hidden(run)


def test_decode_speed_matches_engine_pace(ready_engine, key_file):
    run = run_script(ready_engine.url, "--key-file", str(key_file), "--max-tokens", "48")
    assert run.rc == 0, run.stdout + run.stderr
    r = run.result
    assert r.completion_tokens == 48
    # A check of the measurement's units, not of this machine's speed (a stall on a shared
    # machine can skew a paced rate by 2x either way): tokens per second, not per millisecond,
    # per character or per chunk of several tokens, so within an order of magnitude of the pace.
    assert PACE / 10 <= r.decode_tps <= PACE * 10, r
    assert_key_hidden(run)


def test_wrong_key_fails_in_chat_with_401(ready_engine, tmp_path):
    wrong = tmp_path / "wrong.env"
    wrong.write_text('export FREETOKEN_API_KEY="not-the-key"\n')
    run = run_script(ready_engine.url, "--key-file", str(wrong))
    assert run.rc == 1
    assert run.result.ok is False
    assert run.result.phase == "chat"
    assert "401" in run.result.error
    assert "not-the-key" not in run.stdout + run.stderr


def test_no_key_file_sends_no_key(ready_engine):
    run = run_script(ready_engine.url)
    assert run.result.phase == "chat" and "401" in run.result.error


def test_key_file_without_key_fails_before_any_request(ready_engine, tmp_path):
    f = tmp_path / "empty.env"
    f.write_text("OTHER=1\n")
    run = run_script(ready_engine.url, "--key-file", str(f))
    assert run.rc == 1
    assert "FREETOKEN_API_KEY" in run.result.error


def test_broken_engine_fails_with_its_health_message(engine_factory, key_file):
    engine = engine_factory(load_seconds=1, broken=True)
    run = run_script(engine.url, "--key-file", str(key_file))
    assert run.rc == 1
    r = run.result
    assert r.ok is False and r.phase == "health"
    # It fails on the error status, not by waiting out the timeout ("not ready after 30 s").
    assert "scheduler failed after load" in r.error and "not ready after" not in r.error, r
    assert_key_hidden(run)


def test_nothing_listening_fails_after_the_timeout(key_file):
    port = free_port(with_next=True)
    run = run_script(f"http://127.0.0.1:{port}", "--key-file", str(key_file), timeout=2)
    assert run.rc == 1
    r = run.result
    assert r.ok is False and r.phase == "health"
    assert "not ready after 2 s" in r.error and "connection refused" in r.error
    assert run.elapsed >= 2.0  # it waited its timeout (a slow machine only waits longer)
    assert any(line.startswith("waiting: connection refused") for line in run.lines)


# ---------------------------------------------------------------------------- the operation
class LocalHost:
    """Just enough of a pyinfra Host: a name, a prefix and a shell (this machine's)."""

    def __init__(self, name: str, journal: list[str]):
        self.name = name
        self.print_prefix = f"[{name}] "
        self.journal = journal
        self.commands: list[tuple[str, dict]] = []

    def run_shell_command(self, command, print_output=False, **arguments):
        self.commands.append((str(command), arguments))
        if str(command).startswith("journalctl "):
            return True, CommandOutput([OutputLine("stdout", line) for line in self.journal])
        proc = subprocess.run(str(command), shell=True, capture_output=True, text=True)
        lines = [OutputLine("stdout", line) for line in proc.stdout.splitlines()]
        lines += [OutputLine("stderr", line) for line in proc.stderr.splitlines()]
        if print_output:
            for line in lines:
                print(self.print_prefix + line.line)
        return proc.returncode == 0, CommandOutput(lines)


def settings_for(port: int, **extra) -> Settings:
    return Settings(listen_port=port, model_dir=f"/var/lib/freetoken/models/{MODEL_NAME}", **extra)


def test_run_gate_records_the_result(ready_engine, key_file, capsys):
    state = _State([], set())
    host = LocalHost("ws1", journal=[])
    settings = settings_for(ready_engine.port, health_timeout_s=30, decode_floor_tps=5)
    result = run_gate(state, host, settings, str(key_file), str(SCRIPT), {"_sudo": True})
    assert result.ok is True
    assert RunRecords.of(state).gates["ws1"].decode_tps > 0
    assert RunRecords.of(state).gates["ws1"].decode_floor_tps == 5
    assert host.commands[0][1]["_sudo"] is True  # the operation's privileges reach the script
    assert not any(c.startswith("journalctl") for c, _ in host.commands)
    out = capsys.readouterr().out
    assert "[ws1] chat ok" in out
    assert KEY not in out and all(KEY not in c for c, _ in host.commands)


def test_run_gate_failure_names_host_phase_and_journal(key_file):
    state = _State([], set())
    host = LocalHost("ws2", journal=["Loading experts: 50% (4/9 MiB)", "RuntimeError: boom"])
    settings = settings_for(free_port(with_next=True), health_timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(OperationError) as info:
        run_gate(state, host, settings, str(key_file), str(SCRIPT))
    assert time.monotonic() - t0 >= 10
    message = str(info.value)
    assert "ws2" in message and "health phase" in message
    assert "RuntimeError: boom" in message and "journalctl -u freetoken.service" in message
    assert RunRecords.of(state).gates["ws2"].ok is False
    assert host.commands[-1][0] == "journalctl -u freetoken.service -n 30 --no-pager -o cat"


def test_gate_url_and_command():
    assert gate_url(settings_for(8000)) == "http://127.0.0.1:8000"
    assert gate_url(settings_for(8000, listen_host="0.0.0.0")) == "http://127.0.0.1:8000"
    assert gate_url(settings_for(8000, listen_host="::")) == "http://[::1]:8000"
    cmd = gate_command(settings_for(8000, health_timeout_s=900), "/etc/freetoken/api.env")
    assert cmd == (
        f"python3 {health.GATE_SCRIPT_PATH} --url http://127.0.0.1:8000 --timeout 900 "
        f"--model {MODEL_NAME} --key-file /etc/freetoken/api.env"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the operation uploads the script owned by root")
def test_operation_in_a_local_deploy(ready_engine, key_file, tmp_path):
    deploy = tmp_path / "deploy.py"
    deploy.write_text(
        "from pyinfra.operations import python\n"
        "from freetoken_infra.core.settings import Settings\n"
        "from pyinfra import state\n"
        "from freetoken_infra.core.records import RunRecords\n"
        "from freetoken_infra.report import print_gate_report_if_gated\n"
        "from operations.health import health_gate\n"
        "RunRecords.of(state).when_done(print_gate_report_if_gated)  # as the preflight does\n"
        f"s = Settings(listen_port={ready_engine.port}, model_dir='/srv/models/{MODEL_NAME}',\n"
        f"             health_timeout_s=30, decode_floor_tps=1000, state_dir={str(tmp_path)!r})\n"
        f"health_gate(name='gate', settings=s, key_file={str(key_file)!r},\n"
        f"            script_path={str(tmp_path / 'lib' / 'health_gate.py')!r},\n"
        f"            record_path={str(tmp_path / 'state' / 'health-gate.json')!r})\n"
    )
    pyinfra = Path(sys.executable).with_name("pyinfra")
    proc = subprocess.run(
        [str(pyinfra), "-y", "@local", str(deploy)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (tmp_path / "lib" / "health_gate.py").read_text() == SCRIPT.read_text()
    assert (tmp_path / "lib" / "gate_record.py").read_text() == health.GATE_RECORD_SOURCE.read_text()
    assert json.loads((tmp_path / "state" / "health-gate.json").read_text())["ok"] is True
    assert "[@local] stream ok" in out
    # The table comes once the run is over, after pyinfra's results.
    table = out[out.index("== health gate ==") :]
    assert out.index("--> Results:") < out.index("== health gate ==")
    row = next(line for line in table.splitlines() if line.startswith("@local "))
    host_, health_, _, tps, floor, note = re.split(r"\s{2,}", row)
    assert health_ == "ok" and float(tps) > 0 and floor == "1000" and note == "below floor"
    assert KEY not in out


# ---------------------------------------------------------------------------- the report
def test_report_flags_below_floor_and_failures():
    results = {
        "ws-fast": GateResult(
            ok=True,
            phase="done",
            load_wait_s=34.2,
            decode_tps=23.7,
            completion_tokens=64,
            error=None,
            decode_floor_tps=20.0,
        ),
        "ws-slow": GateResult(
            ok=True,
            phase="done",
            load_wait_s=41.0,
            decode_tps=12.5,
            completion_tokens=64,
            error=None,
            decode_floor_tps=20.0,
        ),
        "ws-dead": GateResult(
            ok=False,
            phase="health",
            load_wait_s=None,
            decode_tps=None,
            completion_tokens=None,
            error="engine reports error: worker died\nmore",
            decode_floor_tps=None,
        ),
        "ws-nofloor": GateResult(
            ok=True,
            phase="done",
            load_wait_s=30.0,
            decode_tps=3.0,
            completion_tokens=64,
            error=None,
            decode_floor_tps=None,
        ),
    }
    report = format_gate_report(results)
    rows = {line.split()[0]: line for line in report.splitlines()[3:-1]}
    assert "below floor" in rows["ws-slow"] and "12.5" in rows["ws-slow"]
    assert "below floor" not in rows["ws-fast"] and "23.7" in rows["ws-fast"]
    assert "below floor" not in rows["ws-nofloor"]
    assert "FAILED in health: engine reports error: worker died" in rows["ws-dead"]
    assert "more" not in rows["ws-dead"]
    assert report.splitlines()[-1] == "4 host(s): 3 serving, 1 below the decode floor, 1 failed"
    # A fleet-wide floor applies to hosts that recorded none.
    assert "below floor" in format_gate_report({"ws-nofloor": results["ws-nofloor"]}, floor_tps=5)


class _Op:
    def __init__(self, names):
        self.names = names


class _State:
    """What the run's records (RunRecords) read of pyinfra's State."""

    def __init__(self, activated, active):
        self.callback_handlers = []
        self.activated_hosts = {LocalHost(n, journal=[]) for n in activated}
        self.active_hosts = {h for h in self.activated_hosts if h.name in active}

    def add_callback_handler(self, handler):
        self.callback_handlers.append(handler)

    def get_op_meta(self, op_hash):
        return _Op({op_hash})

    def host(self, name):
        return next(h for h in self.activated_hosts if h.name == name)


def test_gate_report_prints_once_every_host_is_done(capsys):
    state = _State(["ws1", "ws2", "ws3", "ws4"], active={"ws1", "ws2"})
    report = RunRecords.of(state)
    report.when_done(print_gate_report)
    report.when_done(print_gate_report)
    assert state.callback_handlers == [report] and report.at_end == [print_gate_report]
    report.gates["ws1"] = GateResult(ok=True, phase="done", load_wait_s=3.0, decode_tps=29.6)
    report.last_gates["ws2"] = GateResult(ok=True, decode_tps=24.4, load_wait_s=2.0)
    report.operation_host_error(state, state.host("ws4"), "CUDA: toolkit packages")
    for name in ("ws1", "ws2", "ws3"):
        report.host_disconnect(state, state.host(name))
    assert "health gate" not in capsys.readouterr().err  # ws4 is not done yet
    report.host_disconnect(state, state.host("ws4"))
    table = capsys.readouterr().err
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("ws")}
    assert rows["ws1"].split()[1] == "ok" and "29.6" in rows["ws1"]
    assert "24.4*" in rows["ws2"] and "not re-checked" in rows["ws2"]
    assert "no gate: refused at preflight" in rows["ws3"] and rows["ws3"].split()[1] == "-"
    assert "no gate: failed at: CUDA: toolkit packages" in rows["ws4"]
    assert "4 host(s): 2 serving, 0 below the decode floor, 0 failed, 2 stopped before the gate" in table


# ---------------------------------------------------------------------------- the answer, the version
def test_the_gate_asks_a_question_with_one_right_answer(ready_engine, key_file):
    run = run_script(ready_engine.url, "--key-file", str(key_file))
    assert run.rc == 0, run.stdout + run.stderr
    r = run.result
    a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", r.question).groups())
    assert r.answer == str(a + b), r


def test_a_wrong_answer_fails_the_gate_in_the_answer_phase(engine_factory, key_file):
    engine = engine_factory(load_seconds=0.5, wrong_answers=True)
    run = run_script(engine.url, "--key-file", str(key_file))
    assert run.rc == 1, run.stdout
    r = run.result
    assert r.ok is False and r.phase == "answer", r
    assert r.error.startswith("wrong answer: asked 'What is "), r
    a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", r.question).groups())
    assert r.answer == str(a + b + 1) and f"expected {a + b}," in r.error, r
    assert r.decode_tps is None  # nothing after a wrong answer counts


def test_wrong_answers_can_apply_to_one_engine_version_only(engine_factory, key_file):
    engine = engine_factory(load_seconds=0.5, wrong_answers=["0.2.2"])  # the stand-in is 0.2.1
    assert run_script(engine.url, "--key-file", str(key_file)).result.ok is True


@pytest.mark.parametrize(
    "text, ok",
    [
        ("42", True),
        ("17 + 25 = 42", True),
        ("The answer is **42**.", True),
        (" 42\n", True),
        ("43", False),
        ("42 or 43", False),
        ("forty-two", False),
        ("", False),
        ("4 2", False),
    ],
)
def test_check_answer_takes_the_last_number(text, ok):
    gate = _gate_module()
    if ok:
        gate.check_answer("What is 17 + 25?", 42, text)
    else:
        with pytest.raises(gate.GateFailure, match="wrong answer"):
            gate.check_answer("What is 17 + 25?", 42, text)


def _gate_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("health_gate_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_engine_other_than_the_one_installed_fails_in_the_version_phase(ready_engine, key_file):
    run = run_script(ready_engine.url, "--key-file", str(key_file), "--expect-version", "0.2.2")
    assert run.rc == 1
    r = run.result
    assert r.phase == "version" and r.version == "0.2.1", r
    assert "reports version 0.2.1, not 0.2.2 that this run installed" in r.error, r
    same = run_script(ready_engine.url, "--key-file", str(key_file), "--expect-version", "0.2.1")
    assert same.result.ok is True, same.result


# ---------------------------------------------------------------------------- what a gate gated
SUBJECT = Gated(
    engine_version="0.2.1",
    unit_sha256="u1",
    environment_sha256="e1",
    model="nvidia/Qwen3.6-35B-A3B-NVFP4@main",
    launch=("python", "-m", "freetoken"),
)


def test_the_record_says_what_was_gated_and_a_later_run_skips_only_on_a_match(ready_engine, key_file, tmp_path):
    state = _State([], set())
    record_file = tmp_path / "deploy-state" / "health-gate.json"
    settings = settings_for(ready_engine.port, health_timeout_s=30)
    previous = GateResult(ok=True, phase="done", version="0.2.0", gated=replace(SUBJECT, engine_version="0.2.0"))
    result = run_gate(
        state,
        LocalHost("ws1", journal=[]),
        settings,
        str(key_file),
        str(SCRIPT),
        result_path=str(record_file),
        subject=SUBJECT,
        previous=previous,
    )
    assert result.ok is True
    raw = json.loads(record_file.read_text())
    assert raw["gated"] == {**SUBJECT.to_dict(), "manifest_sha256": None}  # no manifest in this test
    assert raw["last_passed"]["last_passed"] is None
    doc = GateResult.from_json(record_file.read_text())
    assert doc.ok is True and doc.version == "0.2.1" and doc.question
    assert doc.last_passed is not None and doc.last_passed.version == "0.2.1" and doc.last_passed.last_passed is None

    assert plan.why_gate(doc, SUBJECT, None, "0.2.1") is None
    assert "another unit_sha256" in plan.why_gate(doc, replace(SUBJECT, unit_sha256="u2"), None, "0.2.1")
    assert "another manifest_sha256" in plan.why_gate(doc, SUBJECT, "f00d", "0.2.1")
    why = plan.why_gate
    assert "another engine_version" in why(doc, replace(SUBJECT, engine_version="0.2.2"), None, "0.2.2")
    assert "serving reports version 0.2.2" in why(doc, SUBJECT, None, "0.2.2")
    assert why(None, SUBJECT, None, "0.2.1") == "no gate record on the host"
    assert "did not pass (started)" in why(replace(doc, ok=False, phase="started"), SUBJECT, None, "0.2.1")
    assert "does not say what it gated" in why(GateResult(ok=True, decode_tps=23.5), SUBJECT, None, "0.2.1")


def test_a_failed_gate_keeps_the_last_passed_one_for_the_rollback_target(engine_factory, key_file, tmp_path):
    state = _State([], set())
    engine = engine_factory(load_seconds=0.5, wrong_answers=True)
    record_file = tmp_path / "health-gate.json"
    passed = GateResult(ok=True, phase="done", version="0.2.1", gated=SUBJECT)
    settings = settings_for(engine.port, health_timeout_s=30, engine_version="0.2.1")
    with pytest.raises(OperationError, match="failed in the answer phase: wrong answer"):
        run_gate(
            state,
            LocalHost("ws1", journal=[]),
            settings,
            str(key_file),
            str(SCRIPT),
            result_path=str(record_file),
            subject=SUBJECT,
            previous=passed,
        )
    doc = GateResult.from_json(record_file.read_text())
    assert doc.ok is False and doc.phase == "answer" and doc.last_passed == passed

    class Installed:
        def __init__(self, active, versions):
            self.active, self.versions = active, {v: v for v in versions}

    upgrade = Settings(engine_version="0.2.2")
    # the run that switched: active is still the old version
    assert plan.rollback_target(Installed("0.2.1", ["0.2.1", "0.2.2"]), upgrade, None) == "0.2.1"
    # a run cut after the switch left active on 0.2.2: the last passed gate names 0.2.1
    cut = GateResult(ok=False, phase="started", last_passed=passed)
    assert plan.rollback_target(Installed("0.2.2", ["0.2.1", "0.2.2"]), upgrade, cut) == "0.2.1"
    assert plan.rollback_target(Installed("0.2.2", ["0.2.2"]), upgrade, cut) is None  # not installed
    assert plan.rollback_target(Installed("0.2.2", ["0.2.1", "0.2.2"]), upgrade, None) is None


class LostHost(LocalHost):
    """The SSH session ends while the gate script runs."""

    def run_shell_command(self, command, print_output=False, **arguments):
        if "health_gate" in str(command):
            from paramiko import SSHException

            raise SSHException("SSH session not active")
        return super().run_shell_command(command, print_output=print_output, **arguments)


def test_a_lost_connection_is_one_line_and_the_table_says_cut_off(key_file, tmp_path, capsys):
    state = _State([], set())
    settings = settings_for(free_port(with_next=True), health_timeout_s=10)
    status = run_gate(
        state, LostHost("ws1", journal=[]), settings, str(key_file), str(SCRIPT), subject=SUBJECT, previous=None
    )
    assert status is False  # the operation fails without a traceback
    err = capsys.readouterr().err
    assert "ws1: connection lost during the health gate; re-run to finish" in err.splitlines()
    assert "Traceback" not in err
    assert RunRecords.of(state).gates["ws1"].cut_off is True
    table = format_gate_report(RunRecords.of(state).gates)
    row = next(line for line in table.splitlines() if line.startswith("ws1 "))
    assert row.split()[1:3] == ["cut", "off"] and "gate cut off: connection lost; re-run to finish" in row
    assert "FAILED" not in table
    assert table.splitlines()[-1] == "1 host(s): 0 serving, 0 below the decode floor, 0 failed, 1 cut off"


def test_the_fleet_report_says_a_host_lost_its_connection():
    from freetoken_infra.report import host_row

    observed = {
        "engine_active": "0.2.1",
        "engine_version": "0.2.2",
        "blockers": [],
        "restart_only": False,
        "health": {"status": "ok", "version": "0.2.1"},
        "last_gate": {"ok": True, "decode_tps": 23.5},
    }
    cut = {"ok": False, "phase": CUT_OFF, "cut_off": True, "error": "connection lost (x)"}
    row = host_row(
        "ws1",
        [
            {"host": "ws1", "observed": observed},
            {"host": "ws1", "gate": cut, "lost": {"step": "the health gate"}},
            {"host": "ws1", "op_error": "Health gate"},
            {"host": "ws1", "finished": {"failed": True, "changes": 5}},
        ],
    )
    assert row.result == "failed"
    assert row.reason == "connection lost during the health gate; re-run to finish"
    assert row.health == "cut off" and row.tokens_per_s is None  # not the last gate's 23.5
    other = host_row(
        "ws1",
        [
            {"host": "ws1", "observed": observed},
            {"host": "ws1", "lost": {"step": "Service: restart"}},
            {"host": "ws1", "finished": {"failed": True, "changes": 3}},
        ],
    )
    assert other.reason == "connection lost during Service: restart; re-run to finish"


# ---------------------------------------------------------------------------- untrusted records
# A gate result and a gate record come from the host: text its root, or anyone who can make the
# script print, shaped. The schema checks every field and refuses what it is not.
FORGED = [
    ("not json", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"phase": "done"}', "ok must be true or false"),
    ('{"ok": "yes"}', "ok must be true or false"),
    ('{"ok": 1}', "ok must be true or false"),
    ('{"ok": true, "decode_tps": "fast"}', "decode_tps must be int or float, not str"),
    ('{"ok": true, "decode_tps": true}', "decode_tps must be int or float, not a boolean"),
    ('{"ok": true, "decode_tps": NaN}', "decode_tps must be a finite number"),
    ('{"ok": true, "load_wait_s": Infinity}', "load_wait_s must be a finite number"),
    ('{"ok": true, "completion_tokens": 1.5}', "completion_tokens must be int, not float"),
    ('{"ok": false, "error": {"x": 1}}', "error must be str, not dict"),
    ('{"ok": true, "cut_off": "no"}', "cut_off must be bool, not str"),
    ('{"ok": true, "gated": ["engine_version"]}', "gated: not a JSON object"),
    ('{"ok": true, "gated": {"launch": ["python", 3]}}', "launch must be a list of strings"),
    ('{"ok": true, "gated": {"engine_version": 2}}', "engine_version must be str, not int"),
    ('{"ok": false, "last_passed": {"ok": "yes"}}', "last_passed: ok must be true or false"),
    ('{"ok": false, "last_passed": {"ok": true, "last_passed": {"ok": true}}}', "holds no last passed gate"),
    ('{"ok": true, "error": "' + "x" * (1 << 20) + '"}', "more than a gate record holds"),
]


@pytest.mark.parametrize("text, why", FORGED, ids=[w for _, w in FORGED])
def test_a_forged_or_malformed_gate_record_is_refused_with_its_reason(text, why):
    with pytest.raises(GateRecordError) as refused:
        GateResult.from_json(text)
    assert why in str(refused.value)
    assert len(str(refused.value)) < 300  # the reason, not the text it refused


def test_a_gate_record_round_trips_and_ignores_unknown_fields():
    record = GateResult(
        ok=False,
        phase="answer",
        error="wrong answer",
        decode_floor_tps=5,
        rolled_back_from="0.2.2",
        gated=SUBJECT,
        at="2026-01-01T00:00:00Z",
        last_passed=GateResult(ok=True, phase="done", decode_tps=23.5, completion_tokens=64, gated=SUBJECT),
    )
    assert GateResult.from_json(record.to_json()) == record
    doc = json.loads(record.to_json())
    assert GateResult.from_json(json.dumps({**doc, "from_a_later_version": [1]})) == record


def test_a_forged_script_result_fails_the_gate_with_a_clear_error(key_file, tmp_path):
    """A host whose gate prints a result that is not one (here ``ok`` is a string, which a
    truthiness check took for a pass) fails its gate saying why, without a traceback."""
    script = tmp_path / "forged_gate.py"
    script.write_text('print(\'{"ok": "yes", "phase": "done", "decode_tps": 99.0}\')\n')
    state = _State([], set())
    with pytest.raises(OperationError) as failure:
        run_gate(state, LocalHost("ws1", journal=[]), settings_for(8000), str(key_file), str(script))
    message = str(failure.value)
    assert "the health gate failed in the health phase" in message
    assert "the gate script's result: ok must be true or false" in message
    assert RunRecords.of(state).gates["ws1"].ok is False


def test_a_script_result_cannot_claim_what_the_controller_records(key_file, tmp_path):
    """The script reports what it measured; whether the gate was cut off, rolled back or what
    it gated is the controller's to say: a result claiming them is stripped of the claims."""
    forged = GateResult(
        ok=True,
        phase="done",
        decode_tps=30.0,
        cut_off=True,
        rolled_back_from="0.1.0",
        gated=SUBJECT,
        decode_floor_tps=0,
    )
    script = tmp_path / "claiming_gate.py"
    script.write_text(f"print({forged.to_json()!r})\n")
    state = _State([], set())
    result = run_gate(state, LocalHost("ws1", journal=[]), settings_for(8000, decode_floor_tps=7), None, str(script))
    assert isinstance(result, GateResult) and result.ok is True and result.decode_tps == 30.0
    assert (result.cut_off, result.rolled_back_from, result.gated, result.decode_floor_tps) == (False, None, None, 7)


def test_a_forged_record_on_the_host_is_no_record(capsys):
    """The record left on the host before this run (read at prepare time) is refused with one
    line when it is not a gate record: the gate runs again and writes a new one."""
    from tests.unit.fakehost import FakeHost

    path = "/var/lib/freetoken/deploy-state/health-gate.json"
    host = FakeHost(files={path: '{"ok": true, "gated": {"engine_version": ["0.2.1"]}}'})
    seen = []

    def read(settings):  # run inside the fake host's pyinfra context, as the deploy's prepare step
        seen.append(health.gate_record(settings, path))
        yield from ()

    host.yielded(type("Op", (), {"_inner": staticmethod(read)}), Settings())
    assert seen == [None]
    assert f"the gate record {path}: gated: engine_version must be str" in capsys.readouterr().err


def test_the_script_runs_with_only_its_schema_beside_it(tmp_path):
    """As uploaded (``/usr/local/lib/freetoken/``): the script and ``gate_record.py`` in one
    folder, run by a bare ``python3 -I`` (no checkout, no site packages) from elsewhere."""
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(SCRIPT, lib / "health_gate.py")
    shutil.copy(health.GATE_RECORD_SOURCE, lib / "gate_record.py")
    port = free_port(with_next=True)
    argv = [sys.executable, "-I", "-S", str(lib / "health_gate.py"), "--url", f"http://127.0.0.1:{port}"]
    proc = subprocess.run(
        [*argv, "--timeout", "0.5", "--model", MODEL_NAME], capture_output=True, text=True, cwd="/", timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    result = GateResult.from_json(proc.stdout.splitlines()[-1])
    assert result.ok is False and result.phase == "health" and "not ready after" in (result.error or "")
