"""Rollout planning, the fleet report, the example fleet inventory and the blue-green rollback
of the health gate (the gate script against the engine stand-in; only systemctl is stood in)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import CommandOutput, OutputLine

from facts.engine import EngineInstallInfo
from facts.restart import RestartPending, parse_restart_pending_output
from freetoken_infra import report
from freetoken_infra.report import format_fleet_report, host_row, read_records
from freetoken_infra.rollout import (
    RolloutError, batch_size, batch_stops, connect_errors, parse_batch_sizes, plan_batches, pyinfra_argv,
)
from freetoken_infra.core.settings import Settings
from operations import engine
from operations.health import GATE_RESULTS, rollback_command, run_gate
from tests.loopback import free_port, wait_listening

ROOT = Path(__file__).resolve().parents[2]
ENGINE_SRC = ROOT / "tests" / "fleet" / "standins" / "engine"
SCRIPT = ROOT / "operations" / "scripts" / "health_gate.py"
MODEL_NAME = "Qwen3.6-35B-A3B-NVFP4-nvidia"
KEY = "ft-rollout-key-31f0c2"


# ---------------------------------------------------------------------------- planning
def test_batch_sizes_parse_counts_and_percentages():
    assert parse_batch_sizes("1, 25%,100%") == ["1", "25%", "100%"]
    for bad in ("", "0", "x", "150%", "0%", "1,,-2"):
        with pytest.raises(RolloutError) as info:
            parse_batch_sizes(bad)
        assert "--batches" in str(info.value)
    assert batch_size("25%", 3) == 1 and batch_size("25%", 5) == 2 and batch_size("1%", 500) == 5
    assert batch_size("100%", 7) == 7 and batch_size("3", 7) == 3


def test_plan_canary_then_batches_in_natural_name_order():
    hosts = ["ws10", "ws2", "ws1", "ws3", "ws11", "ws4", "ws5", "ws6"]
    assert plan_batches(hosts, ["1", "25%", "100%"]) == [
        ["ws1"], ["ws2", "ws3"], ["ws4", "ws5", "ws6", "ws10", "ws11"]]
    # the last size repeats until every host had its turn
    assert plan_batches(hosts, ["1", "2"]) == [
        ["ws1"], ["ws2", "ws3"], ["ws4", "ws5"], ["ws6", "ws10"], ["ws11"]]
    # a named canary goes first and is the whole first batch; the sizes after the first follow
    assert plan_batches(hosts, ["1", "50%"], canary=["ws5", "ws6"]) == [
        ["ws5", "ws6"], ["ws1", "ws2", "ws3", "ws4"], ["ws10", "ws11"]]
    assert plan_batches(["a"], ["1", "25%", "100%"]) == [["a"]]
    every = [h for b in plan_batches(hosts, ["1", "25%", "100%"]) for h in b]
    assert sorted(every) == sorted(hosts) and len(every) == len(hosts)
    with pytest.raises(RolloutError) as info:
        plan_batches(hosts, ["1"], canary=["ws99"])
    assert "ws99" in str(info.value)


def test_canary_allows_no_failure_later_batches_their_percentage():
    assert batch_stops(0, 0, 1, 50) is None
    assert "canary" in batch_stops(0, 1, 2, 50)
    assert batch_stops(1, 1, 4, 25) is None          # 25% is allowed
    why = batch_stops(1, 2, 4, 25)                     # 50% is not
    assert "batch 2" in why and "2 of 4" in why and "50%" in why
    assert batch_stops(2, 1, 10, 0) is not None        # default: any failure stops


def test_each_batch_runs_the_pyinfra_cli_with_one_limit_per_host():
    argv = pyinfra_argv("inventories/fleet.py", "deploys/freetoken.py", ["ws2", "ws3"], ["engine_version=0.2.2"])
    assert Path(argv[0]).name == "pyinfra"
    assert argv[1:] == ["-y", "--data", "engine_version=0.2.2", "inventories/fleet.py", "deploys/freetoken.py",
                        "--limit", "ws2", "--limit", "ws3"]


def test_connect_errors_are_read_per_host_from_pyinfra_output():
    out = ("\x1b[1m[ws1]\x1b[0m Connected\n"
           "[ws9] \x1b[31mCould not connect (No route to host)\x1b[0m\n"
           "[ws2] Connected\n")
    assert connect_errors(out, ["ws1", "ws2", "ws9"]) == {"ws9": "Could not connect (No route to host)"}


# ---------------------------------------------------------------------------- inventories
def _in_subprocess(code: str) -> subprocess.CompletedProcess:
    """Importing pyinfra_cli monkey-patches the process (gevent), so it runs in its own."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_example_fleet_inventory_loads_and_every_host_validates():
    """inventories/fleet.py as the pyinfra CLI loads it (group_data included)."""
    run = _in_subprocess(
        "import json\n"
        "from pyinfra.api import State\n"
        "from pyinfra.context import ctx_state\n"
        "from pyinfra_cli.inventory import make_inventory\n"
        "from freetoken_infra.rollout import load_hosts\n"
        "from freetoken_infra.core.settings import validate_inventory\n"
        "with ctx_state.use(State()):\n"
        "    inventory = make_inventory('inventories/fleet.py', cwd='.')\n"
        "settings = validate_inventory(inventory)\n"
        "print(json.dumps({'hosts': {h.name: {'groups': sorted(h.groups), 'ssh': h.data.get('ssh_hostname'),\n"
        "    'class': settings[h.name].hardware_profile, 'floor': settings[h.name].decode_floor_tps,\n"
        "    'wslconfig': settings[h.name].wslconfig_values()} for h in inventory},\n"
        "    'rollout_hosts': load_hosts('inventories/fleet.py', {})}))\n")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout.splitlines()[-1])
    hosts = doc["hosts"]
    assert len(hosts) >= 3
    assert {h["class"] for h in hosts.values()} == {"rtx5060ti_16gb", "rtx5090_32gb"}
    for name, h in hosts.items():
        assert h["ssh"], name
        assert h["wslconfig"]["networkingMode"] == "mirrored"
        # each host's group is its hardware class, whose group_data file applied
        assert h["class"] in h["groups"] and (ROOT / "group_data" / f"{h['class']}.py").exists()
        assert h["floor"] is not None  # set only by the class's group_data
    assert doc["rollout_hosts"] == list(hosts)


def test_a_bad_setting_stops_the_rollout_before_any_host():
    rollout = [sys.executable, "-m", "freetoken_infra.rollout", "inventories/fleet.py"]
    run = subprocess.run(rollout + ["--data", "listen_port=70000"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "setting 'listen_port' = 70000 is invalid" in run.stderr and "lab-ws01" in run.stderr
    assert "rollout batch" not in run.stdout  # nothing ran
    run = subprocess.run(rollout + ["--batches", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--batches" in run.stderr


# ---------------------------------------------------------------------------- the report
OBSERVED = {"gpu": "NVIDIA GeForce RTX 5060 Ti", "vram_mib": 16311, "wsl_version": "2.7.13",
            "wsl_kind": "wsl2", "engine_active": "0.2.1", "engine_version": "0.2.1",
            "model": "nvidia/Qwen3.6-35B-A3B-NVFP4@main", "blockers": [], "restart_only": False,
            "health": {"status": "ok", "version": "0.2.1", "message": None},
            "last_gate": {"ok": True, "decode_tps": 23.9}, "restart_pending": []}
GATE_OK = {"ok": True, "phase": "done", "decode_tps": 24.2, "version": "0.2.2", "error": None}


def test_row_of_a_converged_host_with_a_gate():
    records = [{"host": "ws1", "observed": {**OBSERVED, "engine_version": "0.2.2"}},
               {"host": "ws1", "restart_pending": ["/mnt/c/Users/dev/.wslconfig"]},
               {"host": "ws1", "gate": GATE_OK},
               {"host": "ws1", "finished": {"failed": False, "changes": 4}}]
    row = host_row("ws1", records, batch=1)
    assert row["result"] == "ok" and row["reason"] == "4 change(s), upgraded from 0.2.1"
    assert (row["gpu"], row["vram_gb"], row["wsl_version"]) == ("NVIDIA GeForce RTX 5060 Ti", 16, "2.7.13")
    assert (row["engine_version"], row["health"], row["tokens_per_s"]) == ("0.2.2", "ok", 24.2)
    assert row["tokens_per_s_source"] == "this run"
    assert row["restart_pending"] is True and row["restart_pending_files"] == ["/mnt/c/Users/dev/.wslconfig"]


def test_row_of_an_unchanged_host_uses_the_last_gate():
    row = host_row("ws2", [{"host": "ws2", "observed": OBSERVED},
                           {"host": "ws2", "finished": {"failed": False, "changes": 0}}])
    assert (row["result"], row["reason"]) == ("ok", "no change")
    assert (row["tokens_per_s"], row["tokens_per_s_source"]) == (23.9, "last gate")
    assert row["restart_pending"] is False and row["engine_version"] == "0.2.1"


def test_rows_of_failed_hosts_say_why():
    refused = host_row("ws3", [{"host": "ws3", "observed": {
        **OBSERVED, "blockers": ["wsl_version", "gpu_memory"], "health": None, "last_gate": None}},
        {"host": "ws3", "finished": {"failed": True, "changes": 0}}])
    assert refused["result"] == "failed"
    assert refused["reason"] == "refused at preflight: wsl_version, gpu_memory"

    rolled = host_row("ws1", [
        {"host": "ws1", "observed": {**OBSERVED, "engine_version": "0.2.3"}},
        {"host": "ws1", "gate": {**GATE_OK, "version": "0.2.1", "rolled_back_from": "0.2.3"},
         "rollback": {"from": "0.2.3", "to": "0.2.1", "ok": True,
                      "reason": "0.2.3 failed the health gate in the health phase: engine reports error: x"}},
        {"host": "ws1", "op_error": "Health gate: /health ok, chat completion, decode tok/s"},
        {"host": "ws1", "finished": {"failed": True, "changes": 3}}])
    assert rolled["result"] == "failed" and rolled["engine_version"] == "0.2.1" and rolled["health"] == "ok"
    assert rolled["reason"] == ("rolled back to 0.2.1: 0.2.3 failed the health gate in the health phase: "
                                "engine reports error: x")

    gate_failed = host_row("ws2", [{"host": "ws2", "observed": OBSERVED},
                                   {"host": "ws2", "gate": {"ok": False, "phase": "chat",
                                                            "error": "HTTP 401\nmore"}}])
    assert gate_failed["reason"] == "health gate failed in the chat phase: HTTP 401"
    assert gate_failed["health"] == "failed (chat)"

    op_failed = host_row("ws2", [{"host": "ws2", "observed": OBSERVED},
                                 {"host": "ws2", "op_error": "CUDA: toolkit packages"},
                                 {"host": "ws2", "finished": {"failed": True, "changes": 1}}])
    assert op_failed["reason"] == "failed at: CUDA: toolkit packages"

    assert host_row("ws9", [], no_result="no result (exit 1)")["reason"] == "no result (exit 1)"
    unreachable = host_row("ws9", [], unreachable="Could not connect (timed out)")
    assert unreachable["result"] == "failed"
    assert unreachable["reason"] == "unreachable: Could not connect (timed out)"
    assert unreachable["health"] == "-" and unreachable["restart_pending"] is None

    skipped = host_row("ws4", [], not_run="rollout stopped: the canary failed")
    assert (skipped["result"], skipped["reason"]) == ("not run", "rollout stopped: the canary failed")


def test_fleet_table_has_every_column_and_a_summary():
    rows = [host_row("ws1", [{"host": "ws1", "observed": OBSERVED}, {"host": "ws1", "gate": GATE_OK},
                             {"host": "ws1", "finished": {"failed": False, "changes": 2}}]),
            host_row("ws2", [{"host": "ws2", "observed": OBSERVED},
                             {"host": "ws2", "finished": {"failed": False, "changes": 0}}]),
            host_row("ws9", [], unreachable="Could not connect (timed out)"),
            host_row("ws10", [], not_run="rollout stopped: x")]
    text = format_fleet_report(rows)
    lines = text.splitlines()
    assert lines[0] == "== fleet report =="
    for column in ("host", "GPU", "VRAM", "WSL", "engine", "model", "health", "tok/s", "restart", "result"):
        assert column in lines[1]
    ws1 = next(line for line in lines if line.startswith("ws1 "))
    assert "NVIDIA GeForce RTX 5060 Ti" in ws1 and "16 GB" in ws1 and "2.7.13" in ws1
    assert "24.2" in ws1 and "ok: 2 change(s)" in ws1
    assert "23.9*" in next(line for line in lines if line.startswith("ws2 "))
    assert "failed: unreachable: Could not connect (timed out)" in text
    assert "not run: rollout stopped: x" in text
    assert "4 host(s): 2 ok, 1 failed, 1 not run" in text
    assert text.rstrip().endswith("did not run again)")
    json.dumps(rows)  # the --json document is these rows


def test_records_round_trip_through_the_file(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    report.record("ws1", gate=GATE_OK)  # unset: nothing written anywhere
    monkeypatch.setenv(report.RECORD_ENV, str(path))
    report.record("ws1", gate=GATE_OK)
    report.record("ws2", op_error="x")
    with path.open("a") as f:
        f.write('{"host": "ws1", "torn')
    assert read_records(str(path)) == {"ws1": [{"host": "ws1", "gate": GATE_OK}],
                                       "ws2": [{"host": "ws2", "op_error": "x"}]}


def test_restart_pending_fact_parses_and_quotes():
    cmd = RestartPending().command(paths=["/mnt/c/Users/a b/.wslconfig", "/etc/wsl.conf"])
    assert "'/mnt/c/Users/a b/.wslconfig'" in cmd and "/proc/1/stat" in cmd
    assert parse_restart_pending_output(["@@ft:newer /etc/wsl.conf", "noise"]) == ["/etc/wsl.conf"]


def test_restart_pending_command_on_this_machine(tmp_path):
    """Run the fact's command here: a file touched now is newer than PID 1, an old one is not."""
    new, old = tmp_path / "new.conf", tmp_path / "old.conf"
    new.write_text("x")
    old.write_text("x")
    os.utime(old, (0, 0))
    out = subprocess.run(["sh", "-c", RestartPending().command(paths=[str(new), str(old), str(tmp_path / "none")])],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert parse_restart_pending_output(out) == [str(new)]


# ---------------------------------------------------------------------------- rollback
def test_previous_version_only_for_an_installed_other_version():
    s = Settings(engine_version="0.2.3")
    info = lambda active, versions: EngineInstallInfo("/opt/freetoken", versions, active)  # noqa: E731
    assert engine.previous_version(info("0.2.1", {"0.2.1": "0.2.1", "0.2.3": "0.2.3"}), s) == "0.2.1"
    assert engine.previous_version(info("0.2.3", {"0.2.3": "0.2.3"}), s) is None        # same version
    assert engine.previous_version(info(None, {}), s) is None                            # first install
    assert engine.previous_version(info("0.2.1", {"0.2.1": None}), s) is None            # broken venv


class Engine:
    """The engine stand-in on a fixed port; `broken` builds it like the 0.2.3 wheel."""

    def __init__(self, workdir: Path, model: Path, port: int, version: str, broken: bool):
        workdir.mkdir(parents=True, exist_ok=True)
        pkg = workdir / "pkg"
        shutil.copytree(ENGINE_SRC / "freetoken", pkg / "freetoken")
        (pkg / "freetoken" / "version.py").write_text(f'__version__ = "{version}"\nBROKEN = {broken!r}\n')
        cfg = workdir / "standin.json"
        cfg.write_text(json.dumps({"tokens_per_s": 40.0, "load_seconds": 0.5, "error_exit_delay_s": 30}))
        env = dict(os.environ, PYTHONPATH=str(pkg), FREETOKEN_STANDIN_CONFIG=str(cfg), FREETOKEN_API_KEY=KEY)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "freetoken", "--model-path", str(model), "--host", "127.0.0.1",
             "--port", str(port)], env=env, stdout=(workdir / "engine.log").open("w"), stderr=subprocess.STDOUT)
        wait_listening(port, self.proc, "engine stand-in", workdir / "engine.log")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class BlueGreenHost:
    """A pyinfra Host stand-in: commands run in this machine's shell, except `systemctl restart
    freetoken.service`, which restarts the engine stand-in from whatever `active` points at."""

    def __init__(self, name: str, base: Path, start_engine):
        self.name = name
        self.print_prefix = f"[{name}] "
        self.base = base
        self.start_engine = start_engine
        self.commands: list[str] = []
        self.engine = start_engine(os.readlink(base / "active").rsplit("/", 1)[1])

    def run_shell_command(self, command, print_output=False, **arguments):
        command = str(command)
        self.commands.append(command)
        if command.startswith("journalctl "):
            return True, CommandOutput([OutputLine("stdout", "RuntimeError: scheduler failed after load")])
        restart = "systemctl restart freetoken.service"
        proc = subprocess.run(command.replace(restart, "true"), shell=True, capture_output=True, text=True)
        if proc.returncode == 0 and restart in command:
            self.engine.stop()
            self.engine = self.start_engine(os.readlink(self.base / "active").rsplit("/", 1)[1])
        lines = [OutputLine("stdout", line) for line in proc.stdout.splitlines()]
        lines += [OutputLine("stderr", line) for line in proc.stderr.splitlines()]
        return proc.returncode == 0, CommandOutput(lines)


@pytest.fixture()
def blue_green(tmp_path, model_dir):
    """/opt/freetoken-like tree with 0.2.1 and 0.2.3 side by side, `active` on 0.2.3 (just
    switched by the deploy), the engine stand-in serving from it."""
    base = tmp_path / "opt"
    for v in ("0.2.1", "0.2.3"):
        (base / v).mkdir(parents=True)
    os.symlink(str(base / "0.2.3"), base / "active")
    key_file = tmp_path / "api.env"
    key_file.write_text(f"FREETOKEN_API_KEY={KEY}\n")
    port = free_port(with_next=True)
    engines = []

    def start(version):
        e = Engine(tmp_path / f"engine{len(engines)}", model_dir, port, version, broken=version == "0.2.3")
        engines.append(e)
        return e

    host = BlueGreenHost("ws1", base, start)
    settings = Settings(engine_version="0.2.3", engine_base_dir=str(base), listen_port=port,
                        health_timeout_s=20, model_dir=f"/var/lib/freetoken/models/{MODEL_NAME}")
    yield host, settings, key_file, base
    for e in engines:
        e.stop()


def test_failed_upgrade_rolls_back_and_serves_the_old_version(blue_green, tmp_path, monkeypatch):
    host, settings, key_file, base = blue_green
    record_file = tmp_path / "run.jsonl"
    monkeypatch.setenv(report.RECORD_ENV, str(record_file))
    kept = tmp_path / "last-gate.json"
    GATE_RESULTS.clear()
    with pytest.raises(OperationError) as info:
        run_gate(None, host, settings, str(key_file), str(SCRIPT), {}, rollback_to="0.2.1",
                 result_path=str(kept))
    message = str(info.value)
    assert message.startswith("host ws1: rolled back to 0.2.1: 0.2.3 failed the health gate in the health phase: "
                              "engine reports error: ")
    assert "freetoken 0.2.3: scheduler failed after load" in message.splitlines()[0]
    assert "RuntimeError: scheduler failed after load" in message  # what 0.2.3 logged
    assert os.readlink(base / "active") == str(base / "0.2.1")
    assert not (base / "active.rollback").exists()
    assert rollback_command(settings, "0.2.1") in host.commands
    # the old version serves again, proven by the second gate (a real chat and stream)
    assert GATE_RESULTS["ws1"]["ok"] is True and GATE_RESULTS["ws1"]["version"] == "0.2.1"
    assert GATE_RESULTS["ws1"]["rolled_back_from"] == "0.2.3"
    assert json.loads(kept.read_text())["version"] == "0.2.1"
    row = host_row("ws1", read_records(str(record_file))["ws1"])
    assert row["engine_version"] == "0.2.1" and row["health"] == "ok" and row["tokens_per_s"] > 0
    assert row["result"] == "failed" and row["reason"].startswith("rolled back to 0.2.1: 0.2.3 failed")


def test_without_a_previous_version_the_failure_is_plain(blue_green):
    host, settings, key_file, base = blue_green
    with pytest.raises(OperationError) as info:
        run_gate(None, host, settings, str(key_file), str(SCRIPT), {}, rollback_to=None)
    assert "the health gate failed in the health phase" in str(info.value)
    assert "rolled back" not in str(info.value)
    assert os.readlink(base / "active") == str(base / "0.2.3")
    assert not any("ln -sfn" in c for c in host.commands)
