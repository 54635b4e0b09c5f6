"""Rollout planning, the fleet report, the example fleet inventory and the blue-green rollback
of the health gate (the gate script against the engine stand-in; only systemctl is stood in)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from pyinfra.api.exceptions import OperationError
from pyinfra.connectors.util import CommandOutput, OutputLine

from facts.restart import RestartPending, parse_restart_pending_output
from freetoken_infra import rollout as rollout_mod
from freetoken_infra.core import records
from freetoken_infra.core.gate_record import GateResult
from freetoken_infra.core.records import HostRow, HostRowError, RunRecord, RunRecords, read_records
from freetoken_infra.core.settings import Settings
from freetoken_infra.report import format_fleet_report, host_row
from freetoken_infra.rollout import (
    BatchRun,
    RolloutError,
    batch_size,
    batch_stops,
    exit_status,
    load_report,
    parse_batch_sizes,
    parse_only,
    plan_batches,
    pyinfra_argv,
    select_hosts,
)
from operations.health import rollback_command, run_gate
from tests.loopback import free_port, wait_listening
from tests.unit.test_run_records import run_state

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
    assert plan_batches(hosts, ["1", "25%", "100%"]) == [["ws1"], ["ws2", "ws3"], ["ws4", "ws5", "ws6", "ws10", "ws11"]]
    # the last size repeats until every host had its turn
    assert plan_batches(hosts, ["1", "2"]) == [["ws1"], ["ws2", "ws3"], ["ws4", "ws5"], ["ws6", "ws10"], ["ws11"]]
    # a named canary goes first and is the whole first batch; the sizes after the first follow
    assert plan_batches(hosts, ["1", "50%"], canary=["ws5", "ws6"]) == [
        ["ws5", "ws6"],
        ["ws1", "ws2", "ws3", "ws4"],
        ["ws10", "ws11"],
    ]
    assert plan_batches(["a"], ["1", "25%", "100%"]) == [["a"]]
    every = [h for b in plan_batches(hosts, ["1", "25%", "100%"]) for h in b]
    assert sorted(every) == sorted(hosts) and len(every) == len(hosts)
    with pytest.raises(RolloutError) as info:
        plan_batches(hosts, ["1"], canary=["ws99"])
    assert "ws99" in str(info.value)


def test_canary_allows_no_failure_later_batches_their_percentage():
    assert batch_stops(0, 0, 1, 50) is None
    assert "canary" in batch_stops(0, 1, 2, 50)
    assert batch_stops(1, 1, 4, 25) is None  # 25% is allowed
    why = batch_stops(1, 2, 4, 25)  # 50% is not
    assert "batch 2" in why and "2 of 4" in why and "50%" in why
    assert batch_stops(2, 1, 10, 0) is not None  # default: any failure stops


def test_parked_hosts_stop_nothing_but_a_canary_needs_a_host_that_converged():
    # a parked host (unreachable, nothing done) is no failure; percentages are of reached hosts
    assert batch_stops(0, 0, 2, 0, parked=1) is None
    assert batch_stops(1, 0, 4, 0, parked=3) is None
    assert batch_stops(1, 1, 4, 50, parked=2) is None  # 1 of 2 reached = 50%: allowed
    why = batch_stops(1, 1, 4, 40, parked=2)
    assert "1 of 2 reached host(s) failed (50%" in why
    # a canary of parked or refused hosts proved nothing: the rollout stops and says so
    why = batch_stops(0, 0, 1, 0, parked=1)
    assert why == "the canary had no reachable host (1 of 1 parked): it proved nothing"
    assert "refused at preflight" in batch_stops(0, 0, 2, 0, parked=1, ok=0)
    assert batch_stops(0, 0, 2, 0, parked=0, ok=1) is None  # one refused beside one ok


def test_each_batch_runs_the_pyinfra_cli_with_one_limit_per_host():
    argv = pyinfra_argv("inventories/fleet.py", "deploys/freetoken.py", ["ws2", "ws3"], ["engine_version=0.2.2"])
    assert Path(argv[0]).name == "pyinfra"
    assert argv[1:] == [
        "-y",
        "--data",
        "engine_version=0.2.2",
        "inventories/fleet.py",
        "deploys/freetoken.py",
        "--limit",
        "ws2",
        "--limit",
        "ws3",
    ]


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
        "    'rollout_hosts': load_hosts('inventories/fleet.py', {})}))\n"
    )
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


def test_the_rollout_and_the_fleet_load_an_inventory_through_one_function(tmp_path):
    """core.settings.load_inventory_settings: the file as the pyinfra CLI loads it and every
    host's settings, or one error naming the file or the host and field; the rollout and the
    fleet say the same, each as its own error."""
    (tmp_path / "good.py").write_text('hosts = ["@local"]\ngateway = [("gw", {"ssh_hostname": "127.0.0.1"})]\n')
    (tmp_path / "broken.py").write_text("hosts = [\n")
    (tmp_path / "bad.py").write_text('hosts = [("ws1", {"listen_port": 70000})]\n')
    run = _in_subprocess(
        "import json, sys\n"
        "from freetoken_infra.core.settings import InventoryError, load_inventory_settings\n"
        "from freetoken_infra.fleet import Fleet, FleetError\n"
        "from freetoken_infra.rollout import RolloutError, load_hosts\n"
        f"folder = {str(tmp_path)!r}\n"
        "inv, settings = load_inventory_settings(folder + '/good.py')\n"
        "out = {'good': [sorted(h.name for h in inv), sorted(settings)]}\n"
        "for name in ('broken', 'bad'):\n"
        "    said = []\n"
        "    for load, error in ((load_inventory_settings, InventoryError), (load_hosts, RolloutError),\n"
        "                        (Fleet.from_inventory, FleetError)):\n"
        "        try:\n"
        "            load(folder + f'/{name}.py', {})\n"
        "        except error as exc:\n"
        "            said.append(str(exc))\n"
        "    out[name] = said\n"
        "print(json.dumps(out))\n"
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["good"] == [["@local", "gw"], ["@local", "gw"]]
    for name in ("broken", "bad"):
        assert len(out[name]) == 3 and len(set(out[name])) == 1, out[name]
    assert out["broken"][0].startswith(f"{tmp_path}/broken.py: ")
    assert "host ws1: setting 'listen_port' = 70000 is invalid" in out["bad"][0]


def test_a_bad_setting_stops_the_rollout_before_any_host():
    rollout = [sys.executable, "-m", "freetoken_infra.rollout", "inventories/fleet.py"]
    run = subprocess.run(
        rollout + ["--data", "listen_port=70000"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "setting 'listen_port' = 70000 is invalid" in run.stderr and "lab-ws01" in run.stderr
    assert "rollout batch" not in run.stdout  # nothing ran
    run = subprocess.run(rollout + ["--batches", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--batches" in run.stderr


# ---------------------------------------------------------------------------- the report
OBSERVED = {
    "gpu": "NVIDIA GeForce RTX 5060 Ti",
    "vram_mib": 16311,
    "wsl_version": "2.7.13",
    "wsl_kind": "wsl2",
    "engine_active": "0.2.1",
    "engine_version": "0.2.1",
    "model": "nvidia/Qwen3.6-35B-A3B-NVFP4@main",
    "blockers": [],
    "restart_only": False,
    "health": {"status": "ok", "version": "0.2.1", "message": None},
    "last_gate": {"ok": True, "decode_tps": 23.9},
    "restart_pending": [],
}
GATE_OK = {"ok": True, "phase": "done", "decode_tps": 24.2, "version": "0.2.2", "error": None}


def test_row_of_a_converged_host_with_a_gate():
    records = [
        {"host": "ws1", "observed": {**OBSERVED, "engine_version": "0.2.2"}},
        {"host": "ws1", "restart_pending": ["/mnt/c/Users/dev/.wslconfig"]},
        {"host": "ws1", "gate": GATE_OK},
        {"host": "ws1", "finished": {"failed": False, "changes": 4}},
    ]
    row = host_row("ws1", records, batch=1)
    assert row.result == "ok" and row.reason == "4 change(s), upgraded from 0.2.1"
    assert (row.gpu, row.vram_gb, row.wsl_version) == ("NVIDIA GeForce RTX 5060 Ti", 16, "2.7.13")
    assert (row.engine_version, row.health, row.tokens_per_s) == ("0.2.2", "ok", 24.2)
    assert row.tokens_per_s_source == "this run"
    assert row.restart_pending is True and row.restart_pending_files == ("/mnt/c/Users/dev/.wslconfig",)


def test_row_of_an_unchanged_host_uses_the_last_gate():
    row = host_row(
        "ws2", [{"host": "ws2", "observed": OBSERVED}, {"host": "ws2", "finished": {"failed": False, "changes": 0}}]
    )
    assert (row.result, row.reason) == ("ok", "no change")
    assert (row.tokens_per_s, row.tokens_per_s_source) == (23.9, "last gate")
    assert row.restart_pending is False and row.engine_version == "0.2.1"


def test_rows_of_failed_hosts_say_why():
    refused = host_row(
        "ws3",
        [
            {
                "host": "ws3",
                "observed": {**OBSERVED, "blockers": ["wsl_version", "gpu_memory"], "health": None, "last_gate": None},
            },
            {"host": "ws3", "finished": {"failed": True, "changes": 0}},
        ],
    )
    assert refused.result == "refused"
    assert refused.reason == "refused at preflight: wsl_version, gpu_memory"
    # nothing was done on it: no model, health, tok/s or restart of ours to show
    assert (refused.model, refused.health, refused.tokens_per_s) == (None, "-", None)
    assert refused.restart_pending is None and refused.wsl_version == "2.7.13"

    rolled = host_row(
        "ws1",
        [
            {"host": "ws1", "observed": {**OBSERVED, "engine_version": "0.2.3"}},
            {
                "host": "ws1",
                "gate": {**GATE_OK, "version": "0.2.1", "rolled_back_from": "0.2.3"},
                "rollback": {
                    "from": "0.2.3",
                    "to": "0.2.1",
                    "ok": True,
                    "reason": "0.2.3 failed the health gate in the health phase: engine reports error: x",
                },
            },
            {"host": "ws1", "op_error": "Health gate: /health ok, chat completion, decode tok/s"},
            {"host": "ws1", "finished": {"failed": True, "changes": 3}},
        ],
    )
    assert rolled.result == "failed" and rolled.engine_version == "0.2.1" and rolled.health == "ok"
    assert rolled.reason == (
        "rolled back to 0.2.1: 0.2.3 failed the health gate in the health phase: engine reports error: x"
    )

    gate_failed = host_row(
        "ws2",
        [
            {"host": "ws2", "observed": OBSERVED},
            {"host": "ws2", "gate": {"ok": False, "phase": "chat", "error": "HTTP 401\nmore"}},
        ],
    )
    assert gate_failed.reason == "health gate failed in the chat phase: HTTP 401"
    assert gate_failed.health == "failed (chat)"

    op_failed = host_row(
        "ws2",
        [
            {"host": "ws2", "observed": OBSERVED},
            {"host": "ws2", "op_error": "CUDA: toolkit packages"},
            {"host": "ws2", "finished": {"failed": True, "changes": 1}},
        ],
    )
    assert op_failed.reason == "failed at: CUDA: toolkit packages"

    assert host_row("ws9", [], no_result="no result (exit 1)").reason == "no result (exit 1)"
    unreachable = host_row("ws9", [], unreachable="Could not connect (timed out)")
    assert unreachable.result == "parked"
    assert unreachable.reason == "unreachable: Could not connect (timed out)"
    assert unreachable.health == "-" and unreachable.restart_pending is None
    # connected but recorded nothing: a failure, not parked
    assert host_row("ws9", [], no_result="no result (exit 1)").result == "failed"

    skipped = host_row("ws4", [], not_run="rollout stopped: the canary failed")
    assert (skipped.result, skipped.reason) == ("not run", "rollout stopped: the canary failed")


def test_fleet_table_has_every_column_and_a_summary():
    rows = [
        host_row(
            "ws1",
            [
                {"host": "ws1", "observed": OBSERVED},
                {"host": "ws1", "gate": GATE_OK},
                {"host": "ws1", "finished": {"failed": False, "changes": 2}},
            ],
        ),
        host_row(
            "ws2", [{"host": "ws2", "observed": OBSERVED}, {"host": "ws2", "finished": {"failed": False, "changes": 0}}]
        ),
        host_row("ws9", [], unreachable="Could not connect (timed out)"),
        host_row("ws10", [], not_run="rollout stopped: x"),
    ]
    text = format_fleet_report(rows)
    lines = text.splitlines()
    assert lines[0] == "== fleet report =="
    for column in ("host", "GPU", "VRAM", "WSL", "engine", "model", "health", "tok/s", "restart", "result"):
        assert column in lines[1]
    ws1 = next(line for line in lines if line.startswith("ws1 "))
    assert "NVIDIA GeForce RTX 5060 Ti" in ws1 and "16 GB" in ws1 and "2.7.13" in ws1
    assert "24.2" in ws1 and "ok: 2 change(s)" in ws1
    assert "23.9*" in next(line for line in lines if line.startswith("ws2 "))
    assert "parked: unreachable: Could not connect (timed out)" in text
    assert "not run: rollout stopped: x" in text
    assert "4 host(s): 2 ok, 1 parked, 0 refused, 0 failed, 1 not run" in text
    assert text.rstrip().endswith("did not run again)")
    # the --json document is these rows, each one JSON round trip
    assert [HostRow.from_dict(json.loads(json.dumps(r.to_dict()))) for r in rows] == rows


def test_records_round_trip_through_the_file(tmp_path, monkeypatch):
    path = tmp_path / "run.jsonl"
    gate = GateResult.from_dict(GATE_OK)
    records.record("ws1", gate=gate)  # unset: nothing written anywhere
    monkeypatch.setenv(records.RECORD_ENV, str(path))
    records.record("ws1", gate=gate)
    records.record("ws2", op_error="x")
    with path.open("a") as f:
        f.write('{"host": "ws1", "torn')
    assert read_records(str(path)) == {
        "ws1": [RunRecord("ws1", gate=gate)],
        "ws2": [RunRecord("ws2", op_error="x")],
    }


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
    out = subprocess.run(
        ["sh", "-c", RestartPending().command(paths=[str(new), str(old), str(tmp_path / "none")])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert parse_restart_pending_output(out) == [str(new)]


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
            [sys.executable, "-m", "freetoken", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=(workdir / "engine.log").open("w"),
            stderr=subprocess.STDOUT,
        )
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
    settings = Settings(
        engine_version="0.2.3",
        engine_base_dir=str(base),
        listen_port=port,
        health_timeout_s=20,
        model_dir=f"/var/lib/freetoken/models/{MODEL_NAME}",
    )
    yield host, settings, key_file, base
    for e in engines:
        e.stop()


def test_failed_upgrade_rolls_back_and_serves_the_old_version(blue_green, tmp_path, monkeypatch):
    host, settings, key_file, base = blue_green
    record_file = tmp_path / "run.jsonl"
    monkeypatch.setenv(records.RECORD_ENV, str(record_file))
    kept = tmp_path / "last-gate.json"
    state = run_state(["ws1"])
    with pytest.raises(OperationError) as info:
        run_gate(state, host, settings, str(key_file), str(SCRIPT), {}, rollback_to="0.2.1", result_path=str(kept))
    message = str(info.value)
    assert message.startswith(
        "host ws1: rolled back to 0.2.1: 0.2.3 failed the health gate in the health phase: engine reports error: "
    )
    assert "freetoken 0.2.3: scheduler failed after load" in message.splitlines()[0]
    assert "RuntimeError: scheduler failed after load" in message  # what 0.2.3 logged
    assert os.readlink(base / "active") == str(base / "0.2.1")
    assert not (base / "active.rollback").exists()
    assert rollback_command(settings, "0.2.1") in host.commands
    # the old version serves again, proven by the second gate (a real chat and stream)
    assert RunRecords.of(state).gates["ws1"].ok is True and RunRecords.of(state).gates["ws1"].version == "0.2.1"
    assert RunRecords.of(state).gates["ws1"].rolled_back_from == "0.2.3"
    assert json.loads(kept.read_text())["version"] == "0.2.1"
    row = host_row("ws1", read_records(str(record_file))["ws1"])
    assert row.engine_version == "0.2.1" and row.health == "ok" and row.tokens_per_s > 0
    assert row.result == "failed" and row.reason.startswith("rolled back to 0.2.1: 0.2.3 failed")


def test_without_a_previous_version_the_failure_is_plain(blue_green):
    host, settings, key_file, base = blue_green
    with pytest.raises(OperationError) as info:
        run_gate(run_state(["ws1"]), host, settings, str(key_file), str(SCRIPT), {}, rollback_to=None)
    assert "the health gate failed in the health phase" in str(info.value)
    assert "rolled back" not in str(info.value)
    assert os.readlink(base / "active") == str(base / "0.2.3")
    assert not any("ln -sfn" in c for c in host.commands)


# ---------------------------------------------------------------------------- parked, catch-up
def _row(name: str, result: str) -> HostRow:
    if result == "parked":
        return host_row(name, [], unreachable="Could not connect (Connection refused)")
    if result == "refused":
        return host_row(name, [{"host": name, "observed": {**OBSERVED, "blockers": ["wsl_version"]}}])
    failed = result == "failed"
    return host_row(
        name,
        [
            {"host": name, "observed": OBSERVED},
            {"host": name, "op_error": "CUDA: toolkit packages"} if failed else {"host": name},
            {"host": name, "finished": {"failed": failed, "changes": 1}},
        ],
    )


def fake_runner(results: dict[str, str], ran: list[list[str]]):
    def run(index, hosts, inventory, deploy, data, out):
        ran.append(list(hosts))
        return BatchRun(list(hosts), 0, [_row(h, results[h]) for h in hosts])

    return run


def test_a_parked_host_stops_nothing_and_each_batch_ends_with_why(capsys):
    import io

    results = {"ws1": "ok", "ws2": "parked", "ws3": "refused", "ws4": "ok"}
    ran: list[list[str]] = []
    out = io.StringIO()
    rows, stopped = rollout_mod.rollout(
        "inv.py", [["ws1"], ["ws2"], ["ws3", "ws4"]], out=out, run=fake_runner(results, ran)
    )
    assert stopped is None and ran == [["ws1"], ["ws2"], ["ws3", "ws4"]]
    assert [r.result for r in rows] == ["ok", "parked", "refused", "ok"]
    text = out.getvalue()
    assert "--> rollout batch 2 ended: no host ok" in text
    assert (
        "    ws2 parked: unreachable: Could not connect (Connection refused); nothing was done on it "
        "(catch it up when it is back)"
    ) in text
    assert "    ws3 refused: refused at preflight: wsl_version; nothing was changed on it" in text
    assert "--> rollout batch 3 ended: ws4 ok" in text
    assert exit_status(rows, stopped) == rollout_mod.EXIT_PARKED


def test_a_canary_that_reached_no_host_stops_the_rollout():
    import io

    ran: list[list[str]] = []
    out = io.StringIO()
    rows, stopped = rollout_mod.rollout(
        "inv.py", [["ws1"], ["ws2"]], out=out, run=fake_runner({"ws1": "parked", "ws2": "ok"}, ran)
    )
    assert ran == [["ws1"]] and "no reachable host" in stopped
    assert [r.result for r in rows] == ["parked", "not run"]
    assert exit_status(rows, stopped) == rollout_mod.EXIT_STOPPED


def test_exit_status_tells_parked_refused_and_failed_apart():
    status = lambda *results: exit_status([_row(f"h{i}", r) for i, r in enumerate(results)], None)  # noqa: E731
    assert status("ok", "ok") == 0
    assert status("ok", "parked", "refused") == rollout_mod.EXIT_PARKED == 4
    assert status("ok", "refused") == rollout_mod.EXIT_REFUSED == 5
    assert status("ok", "parked", "failed") == rollout_mod.EXIT_FAILED == 1
    assert exit_status([_row("h", "ok")], "the canary failed") == rollout_mod.EXIT_STOPPED


def test_catch_up_selects_the_hosts_of_an_earlier_report(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    doc = {
        "hosts": [
            _row("ws1", "ok").to_dict(),
            _row("ws2", "parked").to_dict(),
            _row("ws3", "refused").to_dict(),
            _row("ws4", "failed").to_dict(),
            host_row("ws5", [], not_run="rollout stopped: x").to_dict(),
        ]
    }
    path = tmp_path / "r.json"
    stamp = rollout_mod.write_report(path, doc)
    loaded_path, loaded = load_report(str(path))
    assert loaded_path == path
    assert {k: v for k, v in loaded.items() if k not in ("signature", "run_id", "created_utc")} == json.loads(
        json.dumps(doc)
    )
    assert (loaded["run_id"], loaded["created_utc"]) == (stamp.run_id, stamp.created_utc)
    hosts = ["ws1", "ws2", "ws3", "ws4", "ws5"]
    assert select_hosts(loaded, parse_only("parked,failed"), hosts, "r.json") == ["ws2", "ws4"]
    assert select_hosts(loaded, parse_only("parked, not-run"), hosts, "r.json") == ["ws2", "ws5"]
    assert select_hosts(loaded, parse_only("refused"), hosts, "r.json") == ["ws3"]
    with pytest.raises(RolloutError) as info:
        select_hosts(loaded, ["parked"], ["ws1"], "r.json")
    assert "ws2 not in the inventory" in str(info.value)
    for bad in ("", "parkd", "ok,broken"):
        with pytest.raises(RolloutError) as info:
            parse_only(bad)
        assert "--only" in str(info.value) and "parked" in str(info.value)
    (tmp_path / "bad.json").write_text("{")
    for source in (str(tmp_path / "bad.json"), str(tmp_path / "none.json")):
        with pytest.raises(RolloutError):
            load_report(source)


def test_every_rollout_writes_its_report_where_from_last_finds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(RolloutError) as info:
        rollout_mod.newest_report()
    assert "no rollout report" in str(info.value)
    first = rollout_mod.default_report_path(now=0)
    assert first == tmp_path / "state" / "freetoken-infra" / "rollouts" / "rollout-19700101T000000Z.json"
    rollout_mod.write_report(first, {"hosts": []})
    second = rollout_mod.default_report_path(now=0)  # same second: a new name, never overwritten
    assert second.name == "rollout-19700101T000000Z-2.json"
    rollout_mod.write_report(second, {"hosts": [_row("ws2", "parked").to_dict()]})
    os.utime(first, (1, 1))
    assert rollout_mod.newest_report() == second
    assert not list(second.parent.glob(".*.tmp"))


def test_the_gateway_weighs_hosts_by_the_newest_signed_measurement_only(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert rollout_mod.measured_decode_tps() == {}  # no rollout yet
    ok1, ok2 = _row("ws1", "ok"), _row("ws2", "ok")
    assert ok1.tokens_per_s is not None
    old, new, forged = (rollout_mod.default_report_path(now=t) for t in (0, 60, 120))
    rollout_mod.write_report(old, {"hosts": [ok1.to_dict(), ok2.to_dict()]})
    newer = {**ok1.to_dict(), "tokens_per_s": 61.5}
    slow_failed = {**_row("ws2", "failed").to_dict(), "tokens_per_s": 5.0}
    rollout_mod.write_report(new, {"hosts": [newer, slow_failed]})
    # the newest file, edited by someone without the key: it steers no weight
    doc = json.loads(new.read_text())
    doc["hosts"][0]["tokens_per_s"] = 250.0
    forged.write_text(json.dumps(doc))
    for i, path in enumerate((old, new, forged)):
        os.utime(path, (i + 1, i + 1))
    # ws1: the newer measurement; ws2: its failed row measures nothing, the older ok row counts
    assert rollout_mod.measured_decode_tps() == {"ws1": 61.5, "ws2": ok2.tokens_per_s}
    # The older report touched to look newest: weighed by its signed time, it
    # stays behind the newer one.
    os.utime(old, (99, 99))
    assert rollout_mod.measured_decode_tps() == {"ws1": 61.5, "ws2": ok2.tokens_per_s}


# ---------------------------------------------------------------------------- crafted reports
HOSTILE_DATA = [
    ["_shell_executable=/tmp/evil"],
    ["ssh_hostname=attacker.example"],
    ["_sudo_user=nobody"],
    ["engine_version=0.2.2", "pip_index_url=http://attacker.example/simple"],
]


def _signed_report(tmp_path, monkeypatch, **extra) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "state" / "r.json"
    rollout_mod.write_report(
        path, {"hosts": [_row("ws2", "parked").to_dict()], "batches_spec": "1", "data": [], **extra}
    )
    return path


@pytest.mark.parametrize("data", HOSTILE_DATA)
def test_a_report_edited_after_the_rollout_wrote_it_is_refused_in_one_line(tmp_path, monkeypatch, capsys, data):
    """Someone who can edit a report file adds --data entries of their choosing: the catch-up
    refuses the report (its signature no longer matches) before any host is loaded or touched."""
    path = _signed_report(tmp_path, monkeypatch)
    doc = json.loads(path.read_text())
    doc["data"] = data
    path.write_text(json.dumps(doc))
    ran = []
    monkeypatch.setattr(rollout_mod, "run_batch", lambda *a, **k: ran.append(a))
    status = rollout_mod.main(["inventories/sim.py", "--from", str(path)])
    err = capsys.readouterr().err
    assert status == rollout_mod.EXIT_USAGE and not ran
    assert len(err.strip().splitlines()) == 1, err
    assert "is not a report this controller's rollout wrote" in err and "nothing was run" in err


def test_a_report_without_a_signature_or_forged_with_another_key_is_refused(tmp_path, monkeypatch):
    path = _signed_report(tmp_path, monkeypatch)
    doc = json.loads(path.read_text())
    forged = {**doc, "data": ["_shell_executable=/tmp/evil"]}
    forged["signature"] = rollout_mod.report_signature(forged, b"a key guessed by the attacker" * 2)
    for hostile in ({k: v for k, v in forged.items() if k != "signature"}, forged):
        path.write_text(json.dumps(hostile))
        with pytest.raises(RolloutError, match="not a report this controller's rollout wrote"):
            load_report(str(path))


def test_the_report_key_is_the_users_alone_and_a_shared_one_is_refused(tmp_path, monkeypatch):
    path = _signed_report(tmp_path, monkeypatch)
    key = rollout_mod.reports_dir() / rollout_mod.REPORT_KEY_NAME
    assert key.stat().st_mode & 0o777 == 0o600 and path.stat().st_mode & 0o077 == 0
    load_report(str(path))  # the rollout's own report: accepted
    key.chmod(0o644)  # others could read it, so anyone could sign
    with pytest.raises(RolloutError, match="is not this user's alone"):
        load_report(str(path))


@pytest.mark.parametrize("data", HOSTILE_DATA[:3])
def test_a_signed_report_still_replays_only_settings(tmp_path, monkeypatch, data):
    """Even a report signed with the key (an older release wrote it) replays no pyinfra argument
    and no connection setting: only --data keys that are settings."""
    path = _signed_report(tmp_path, monkeypatch, data=data)
    _, doc = load_report(str(path))
    with pytest.raises(RolloutError, match="not a setting of this deploy"):
        rollout_mod.replayed_options(doc, str(path))


# ---------------------------------------------------------------------------- replayed reports
def _two_reports(tmp_path, monkeypatch) -> tuple[Path, Path, object, object]:
    """An older and a newer report of this controller, both signed with its key."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    old, new = (rollout_mod.default_report_path(now=t) for t in (0, 60))
    parked = [_row("ws2", "parked").to_dict()]
    old_stamp = rollout_mod.write_report(old, {"hosts": parked, "batches_spec": "1", "data": ["engine_version=0.2.0"]})
    new_stamp = rollout_mod.write_report(new, {"hosts": parked, "batches_spec": "1", "data": ["engine_version=0.2.2"]})
    return old, new, old_stamp, new_stamp


def test_an_older_signed_report_put_in_front_is_refused_naming_it_and_both_times(tmp_path, monkeypatch, capsys):
    """The signature proves who wrote a report, not that it is the newest: an older report of
    this controller, its signature valid, touched to look newest (mtime), would replay its --data
    over a later rollout's. Refused in one line naming the report, its time and the newest's."""
    old, new, old_stamp, new_stamp = _two_reports(tmp_path, monkeypatch)
    assert old_stamp.created < new_stamp.created
    future = new.stat().st_mtime + 3600
    os.utime(old, (future, future))  # put in front
    assert rollout_mod.newest_report() == old
    ran = []
    monkeypatch.setattr(rollout_mod, "load_hosts", lambda *a, **k: ran.append(a) or ["ws2"])
    monkeypatch.setattr(rollout_mod, "parse_data", lambda items: {})  # (the real one patches in gevent)
    monkeypatch.setattr(rollout_mod, "gateway_of", lambda *a: None)
    monkeypatch.setattr(rollout_mod, "run_batch", lambda i, h, *a, **k: ran.append(h) or BatchRun(h, 0, []))
    for source in ("last", str(old)):
        status = rollout_mod.main(["inv.py", "--from", source])
        captured = capsys.readouterr()
        assert status == rollout_mod.EXIT_USAGE and not ran
        err = captured.err
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(
            f"rollout: --from {source}: {old} (run {old_stamp.run_id}, created {old_stamp.created_utc})"
        )
        assert f"is older than the newest report this controller applied, {new} " in err
        assert f"(run {new_stamp.run_id}, created {new_stamp.created_utc})" in err and "nothing was run" in err
        assert "0.2.0" not in captured.out  # nothing of it was replayed or printed
    # The same file copied to another name (a backup put back) is the same older report.
    copy = tmp_path / "state" / "freetoken-infra" / "rollouts" / "rollout-29991231T000000Z.json"
    copy.write_bytes(old.read_bytes())
    with pytest.raises(RolloutError, match="is older than the newest report this controller applied"):
        load_report(str(copy))


def test_a_fresh_report_is_taken_and_what_it_replays_is_printed_before_anything_runs(tmp_path, monkeypatch, capsys):
    old, new, _, new_stamp = _two_reports(tmp_path, monkeypatch)
    assert load_report("last") == (new, json.loads(new.read_text()))
    doc = json.loads(new.read_text())
    doc["data"].append("pip_index_url=http://mirror:s3cret-word@pypi.lan/simple")
    path = tmp_path / "r.json"
    key = rollout_mod.report_key(create=True)
    body = {k: v for k, v in doc.items() if k != "signature"}
    path.write_text(json.dumps({**body, "signature": rollout_mod.report_signature(body, key)}))

    def hosts(*a, **k):
        print("LOADING THE INVENTORY")
        return ["ws2"]

    monkeypatch.setattr(rollout_mod, "load_hosts", hosts)
    # (the real parse_data imports pyinfra's CLI, which patches this process with gevent)
    monkeypatch.setattr(rollout_mod, "parse_data", lambda items: {})
    monkeypatch.setattr(rollout_mod, "gateway_of", lambda *a: None)
    monkeypatch.setattr(rollout_mod, "run_batch", lambda i, h, *a, **k: BatchRun(h, 0, [_row(x, "ok") for x in h]))
    assert rollout_mod.main(["inv.py", "--from", str(path)]) == rollout_mod.EXIT_OK
    out = capsys.readouterr().out
    line = (
        f"--> replaying {path} (run {new_stamp.run_id}, created {new_stamp.created_utc}): --batches 1 "
        "--data engine_version=0.2.2 --data 'pip_index_url=http://mirror:********@pypi.lan/simple'"
    )
    assert line in out and out.index(line) < out.index("LOADING THE INVENTORY") < out.index("--> rollout plan")
    assert "s3cret-word" not in out
    # The catch-up's own report is the newest applied now: the one it replayed is older.
    applied = rollout_mod.newest_applied()
    assert applied is not None and applied.stamp.created > new_stamp.created and applied.report != str(new)
    with pytest.raises(RolloutError, match="is older than the newest report"):
        load_report(str(new))


def test_a_tampered_time_or_run_id_fails_the_signature(tmp_path, monkeypatch):
    """The run id and the time are signed content: moving a report's time forward breaks it."""
    old, new, old_stamp, new_stamp = _two_reports(tmp_path, monkeypatch)
    for field, value in (("created_utc", "2999-01-01T00:00:00.000000Z"), ("run_id", new_stamp.run_id)):
        doc = json.loads(old.read_text())
        doc[field] = value
        old.write_text(json.dumps(doc))
        with pytest.raises(RolloutError, match="is not a report this controller's rollout wrote"):
            load_report(str(old))
    # A report signed before the stamp existed cannot be told fresh: refused, saying so.
    key = rollout_mod.report_key(create=True)
    bare = {"hosts": [_row("ws2", "parked").to_dict()], "batches_spec": "1", "data": []}
    old.write_text(json.dumps({**bare, "signature": rollout_mod.report_signature(bare, key)}))
    with pytest.raises(RolloutError, match="carries no signed run id and creation time"):
        load_report(str(old))


def test_the_applied_record_is_the_users_alone_and_never_moves_back(tmp_path, monkeypatch):
    old, new, old_stamp, new_stamp = _two_reports(tmp_path, monkeypatch)
    record = rollout_mod.reports_dir() / rollout_mod.APPLIED_NAME
    assert record.stat().st_mode & 0o777 == 0o600
    applied = rollout_mod.newest_applied()
    assert applied == rollout_mod.Applied(new_stamp, str(new.absolute()))
    rollout_mod.note_applied(old_stamp, old)  # an older stamp never moves it back
    assert rollout_mod.newest_applied() == applied

    # A clock set back: the next report is still stamped after the newest applied one.
    class SetBack(datetime):
        @classmethod
        def now(cls, tz=None):
            return old_stamp.created

    monkeypatch.setattr(rollout_mod, "datetime", SetBack)
    later = rollout_mod.write_report(tmp_path / "later.json", {"hosts": []})
    assert later.created > new_stamp.created
    record.chmod(0o644)
    with pytest.raises(RolloutError, match="is not this user's alone"):
        load_report(str(tmp_path / "later.json"))
    record.chmod(0o600)
    record.write_text("{")
    with pytest.raises(RolloutError, match="is damaged; remove it"):
        rollout_mod.newest_applied()


def test_data_given_to_the_rollout_is_settings_only():
    assert rollout_mod.parse_data([]) == {}
    for item in ("_shell_executable=/tmp/x", "ssh_hostname=h", "_sudo=true", "_temp_dir=/tmp"):
        with pytest.raises(RolloutError, match="not a setting"):
            rollout_mod.parse_data(["engine_version=0.2.2", item])


def test_a_replayed_value_is_validated_like_the_inventorys(tmp_path, monkeypatch):
    """pip_index_url is a setting: a signed report may carry it, and its value goes through the
    same validation as the inventory's (a bad URL stops the catch-up, naming host and field)."""
    path = _signed_report(tmp_path, monkeypatch, data=["pip_index_url=not a url"])
    inv = tmp_path / "inv.py"
    inv.write_text('hosts = ["ws2"]\n')
    run = _run_rollout([str(inv), "--from", str(path)], tmp_path)
    assert run.returncode == rollout_mod.EXIT_USAGE
    assert "pip_index_url" in run.stderr and "ws2" in run.stderr and "rollout batch" not in run.stdout


# ---------------------------------------------------------------------------- the CLI on this machine
def _run_rollout(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "freetoken_infra.rollout", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=600,
    )
    print(run.stdout[-8000:], run.stderr[-3000:], sep="\n")
    return run


def test_rollout_here_parks_an_unreachable_host_refuses_this_one_and_catches_up(tmp_path):
    """The real rollout CLI on this machine (not WSL: refused at preflight, nothing changed) and a
    host nothing answers for (127.0.0.1 on a closed port: parked); the report is written without
    --json, and the catch-up from it runs the parked host only."""
    from tests.loopback import free_port

    inv = tmp_path / "inventory.py"
    inv.write_text(
        'hosts = ["@local", ("ghost", {"ssh_hostname": "127.0.0.1", '
        f'"ssh_port": {free_port()}, "ssh_user": "nobody"}})]\n'
    )
    # one batch: a canary of a refused host alone would stop the rollout (it proved nothing)
    run = _run_rollout([str(inv), "--batches", "2"], tmp_path)
    out = run.stdout
    assert run.returncode == 4, out + run.stderr
    assert "pyinfra error" not in out and "Traceback" not in out + run.stderr
    reports = list((tmp_path / "state" / "freetoken-infra" / "rollouts").glob("rollout-*.json"))
    assert len(reports) == 1 and f"report: {reports[0]}" in out
    doc = json.loads(reports[0].read_text())
    r = {row["host"]: row for row in doc["hosts"]}
    assert r["@local"]["result"] == "refused" and "wsl2" in r["@local"]["reason"]
    assert r["ghost"]["result"] == "parked" and r["ghost"]["reason"].startswith("unreachable: ")
    assert doc["exit_status"] == 4 and doc["batches_spec"] == "2" and doc["stopped"] is None
    table = out[out.index("== fleet report ==") :]
    local = next(line for line in table.splitlines() if line.startswith("@local "))
    # nothing was done on either host: the columns of what the deploy does say "-"
    cells = local.split("  refused:")[0].split()
    assert cells[-4:] == ["-", "-", "-", "-"], local  # model, health, tok/s, restart
    assert "2 host(s): 0 ok, 1 parked, 1 refused, 0 failed, 0 not run" in table
    assert "    @local refused: refused at preflight: " in out
    assert "    ghost parked: unreachable: " in out
    assert f"--only parked,failed --from {reports[0]}" in out
    assert out.rstrip().endswith(
        "exit status 4: every reached host converged or was refused; some hosts are parked (unreachable)"
    )

    again = _run_rollout([str(inv), "--only", "parked,failed", "--from", "last"], tmp_path)
    assert again.returncode == 4, again.stdout + again.stderr
    assert f"--> catch-up of {reports[0]}: ghost (parked or failed there)" in again.stdout
    assert "--> rollout plan: canary: ghost" in again.stdout
    later = max(
        (tmp_path / "state" / "freetoken-infra" / "rollouts").glob("rollout-*.json"), key=lambda p: p.stat().st_mtime
    )
    assert [row["host"] for row in json.loads(later.read_text())["hosts"]] == ["ghost"]
    assert "--limit @local" not in again.stdout

    bad = _run_rollout([str(inv), "--only", "parked"], tmp_path)
    assert bad.returncode == 2 and "--only needs --from" in bad.stderr


def test_a_refused_last_host_ends_with_a_plain_line_not_a_pyinfra_error(tmp_path, first_local_run):
    """The deploy on this machine (not WSL): its only host stops at preflight, and the run ends
    with one plain line of why and exit status 1, not ``pyinfra error in .../preflight.py``; so
    does the re-run its refusal's record answers."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def last_line() -> str:
        run = subprocess.run(
            [str(Path(sys.executable).with_name("pyinfra")), "-y", "@local", "deploys/freetoken.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=600,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 1, out
        assert "pyinfra error" not in out and "Traceback" not in out and "preflight.py" not in out, out
        # the last line but pyinfra's own "Disconnecting" (stdout and stderr interleave either way)
        return [line for line in out.splitlines() if line.strip() and "Disconnecting" not in line][-1]

    last = last_line()
    assert last.startswith(
        "--> no host left to go on: the last one, @local, stopped at preflight (preflight blockers: wsl2"
    ), last
    assert last.endswith("nothing was changed on any host; the findings above say what to do")
    assert last_line() == (
        "--> no host left to go on: the last one, @local, stopped at preflight (preflight blockers: wsl2 "
        "(unchanged since its last full read)); nothing was changed on any host; the remedies above; once "
        "they are done, the next run reads every fact"
    )


# ---------------------------------------------------------------------------- preview (--dry --diff)
PREVIEW_DEPLOY = """
import os
from freetoken_infra.core.settings import Settings
from operations import service, windows
settings = Settings(config_dir=os.environ["FT_CONFIG_DIR"], api_key_source="env:FT_PREVIEW_KEY")
windows.ini_values(name="wslconfig", path=os.environ["FT_WSLCONFIG"], section="wsl2",
                   values=settings.wslconfig_values())
service.api_key(name="key", settings=settings)
"""


def test_dry_diff_shows_the_changed_wslconfig_line_and_never_a_secret(tmp_path):
    """``pyinfra --dry --diff`` on this machine: a UTF-16 .wslconfig (as Notepad writes it) whose
    memory differs shows exactly that line; the API key file that would change shows that it
    changes, masked; nothing is written."""
    from operations.windows import merge_ini

    wanted = Settings().wslconfig_values()
    wslconfig = tmp_path / ".wslconfig"
    wslconfig.write_bytes(
        merge_ini(b"\xff\xfe" + "# mine\r\n[wsl2]\r\n".encode("utf-16-le"), "wsl2", {**wanted, "memory": "16GB"})
    )
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    (config_dir / "api-key.env").write_text("FREETOKEN_API_KEY=old-secret-7d1e\n")
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (wslconfig, config_dir / "api-key.env")}
    deploy = tmp_path / "preview.py"
    deploy.write_text(PREVIEW_DEPLOY)
    env = {
        **os.environ,
        "FT_CONFIG_DIR": str(config_dir),
        "FT_WSLCONFIG": str(wslconfig),
        "FT_PREVIEW_KEY": "new-secret-51ab",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    run = subprocess.run(
        [str(Path(sys.executable).with_name("pyinfra")), "--dry", "--diff", "@local", str(deploy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=env,
        timeout=300,
    )
    out = re.sub(r"\x1b\[[0-9;]*m", "", run.stdout + run.stderr)
    print(out)
    assert run.returncode == 0, out
    assert f"Will modify {wslconfig}" in out
    changed = [line.strip() for line in out.splitlines() if re.match(r"\s+[-+] ", line)]
    assert changed == [
        "- memory=16GB",
        "+ memory=24GB",
        "- FREETOKEN_API_KEY=********",
        "+ FREETOKEN_API_KEY=******** (changed)",
    ], changed
    assert "secret-7d1e" not in out and "secret-51ab" not in out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in before} == before


def test_environment_lines_are_masked_but_a_change_still_shows():
    from operations.preview import mask_env_lines

    text = "HF_TOKEN=hf_abc\nPIP_INDEX_URL=https://me:pw123@mirror.lan/simple\nLOG_LEVEL=info\n"
    assert mask_env_lines(text) == [
        "HF_TOKEN=********\n",
        "PIP_INDEX_URL=https://me:********@mirror.lan/simple\n",
        "LOG_LEVEL=info\n",
    ]
    assert mask_env_lines("HF_TOKEN=b\nAPI_KEY=k\n", before="HF_TOKEN=a\n") == [
        "HF_TOKEN=******** (changed)\n",
        "API_KEY=******** (new)\n",
    ]
    assert mask_env_lines("HF_TOKEN=a\n", before="HF_TOKEN=a\n") == ["HF_TOKEN=********\n"]


def test_a_run_that_reaches_no_host_says_so_plainly(tmp_path):
    """pyinfra could connect to none of the run's hosts (a batch of PCs that are off): one plain
    line and exit status 1, not ``pyinfra error in .../config.py line N: No hosts remaining!``."""
    from tests.loopback import free_port

    inv = tmp_path / "inventory.py"
    inv.write_text(
        f'hosts = [("ghost", {{"ssh_hostname": "127.0.0.1", "ssh_port": {free_port()}, "ssh_user": "nobody"}})]\n'
    )
    run = subprocess.run(
        [str(Path(sys.executable).with_name("pyinfra")), "-y", str(inv), "deploys/freetoken.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "pyinfra error" not in out and "Traceback" not in out, out
    assert "--> no host could be reached (ghost; pyinfra's errors are above); nothing was done on any host" in out, out


def test_an_unreachable_host_is_parked_from_the_structured_record(tmp_path, monkeypatch):
    """config.py registers the run's records (RunRecords) before pyinfra connects: under
    $FREETOKEN_RUN_RECORD pyinfra's connection error is a record, so the row needs no console
    text to be parked."""
    monkeypatch.setenv(records.RECORD_ENV, str(tmp_path / "run.jsonl"))
    RunRecords().host_connect_error(
        None, type("H", (), {"name": "ws2"})(), OSError("Could not connect (timed out)\nmore")
    )
    by_host = read_records(str(tmp_path / "run.jsonl"))
    assert by_host == {"ws2": [RunRecord("ws2", unreachable="Could not connect (timed out)")]}
    row = host_row("ws2", by_host["ws2"])
    assert (row.result, row.reason) == ("parked", "unreachable: Could not connect (timed out)")
    assert row.restart_pending is None and row.health == "-"


# ---------------------------------------------------------------------------- the typed row
# A report file as the rollout wrote it before the row was typed (made by host_row and main's
# document at 007e02b, unsigned), and the fleet table that code printed for its rows.
TODAYS_REPORT = ROOT / "tests" / "fixtures" / "rollout_report.json"
TODAYS_TABLE = ROOT / "tests" / "fixtures" / "rollout_report_table.txt"


def test_a_report_written_in_todays_format_still_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    doc = json.loads(TODAYS_REPORT.read_text())
    path = tmp_path / "r.json"
    key = rollout_mod.report_key(create=True)
    # the fields added when reports were signed
    stamped = {**doc, "run_id": "0f" * 16, "created_utc": "2026-12-03T08:15:02.000000Z"}
    path.write_text(json.dumps({**stamped, "signature": rollout_mod.report_signature(stamped, key)}, indent=1))
    _, loaded = load_report(str(path))
    rows = rollout_mod.report_rows(loaded, "r.json")
    # the same table, byte for byte, and the same JSON keys, in the same order, written back
    assert format_fleet_report(rows) + "\n" == TODAYS_TABLE.read_text()
    assert [r.to_dict() for r in rows] == doc["hosts"]
    assert [list(r.to_dict()) for r in rows] == [list(h) for h in doc["hosts"]]
    assert rows[0].restart_pending_files == ("/mnt/c/Users/dev/.wslconfig",) and rows[0].tokens_per_s == 24.2
    assert rows[4] == HostRow(
        host="ws9", batch=2, health="-", result="parked", reason="unreachable: Could not connect (timed out)"
    )
    hosts = ["ws1", "ws2", "ws3", "ws4", "ws9", "ws10"]
    assert select_hosts(loaded, parse_only("parked,failed"), hosts, "r.json") == ["ws4", "ws9"]
    assert select_hosts(loaded, parse_only("not-run"), hosts, "r.json") == ["ws10"]


def test_every_row_round_trips_through_the_report_document():
    rows = [_row("ws1", "ok"), _row("ws2", "parked"), _row("ws3", "refused"), _row("ws4", "failed")]
    rows.append(host_row("ws5", [], not_run="rollout stopped: x"))
    for row in rows:
        assert HostRow.from_dict(json.loads(json.dumps(row.to_dict()))) == row


GOOD_ROW = json.loads(TODAYS_REPORT.read_text())["hosts"][0]


@pytest.mark.parametrize(
    "change, why",
    [
        ({"host": 7}, "host row: host: not str"),
        ({"host": None}, "host row: host: not str"),
        ({"result": None}, "host row: result: not str"),
        ({"result": "fine"}, 'host row: result: "fine" is not one of ok, parked, refused, failed, not run'),
        ({"reason": ["x"]}, "host row: reason: not str"),
        ({"batch": "1"}, "host row: batch: not int"),
        ({"vram_gb": True}, "host row: vram_gb: not int"),
        ({"vram_gb": 15.9}, "host row: vram_gb: not int"),
        ({"tokens_per_s": "24.2"}, "host row: tokens_per_s: not float"),
        ({"tokens_per_s": float("nan")}, "host row: tokens_per_s: not a finite number"),
        ({"restart_pending": "yes"}, "host row: restart_pending: not bool"),
        ({"restart_pending_files": "/etc/wsl.conf"}, "host row: restart_pending_files: not a list"),
        ({"restart_pending_files": [1]}, "host row: restart_pending_files: not str"),
        ({"changes": 1.5}, "host row: changes: not int"),
        ({"engine_version": {"v": 1}}, "host row: engine_version: not str"),
    ],
)
def test_a_malformed_row_is_refused_naming_its_field(change, why):
    with pytest.raises(HostRowError) as refused:
        HostRow.from_dict(json.loads(json.dumps({**GOOD_ROW, **change})))
    assert str(refused.value) == why


def test_a_row_without_host_or_result_or_not_an_object_is_refused():
    for missing in ("host", "result"):
        with pytest.raises(HostRowError, match=f"^host row: {missing}: missing$"):
            HostRow.from_dict({k: v for k, v in GOOD_ROW.items() if k != missing})
    with pytest.raises(HostRowError, match="^hosts\\[3\\]: not a JSON object$"):
        HostRow.from_dict("ws1", "hosts[3]")


def test_a_signed_report_with_a_forged_row_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Strict although signed: a row the rollout did not write stops the catch-up before any
    inventory is loaded or host touched, in one line naming the row and its field."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = tmp_path / "state" / "r.json"
    forged = {**_row("ws2", "parked").to_dict(), "restart_pending_files": "\x1b]0;evil\x07"}
    rollout_mod.write_report(path, {"hosts": [_row("ws1", "ok").to_dict(), forged], "batches_spec": "1", "data": []})
    loaded = []
    monkeypatch.setattr(rollout_mod, "load_hosts", lambda *a, **k: loaded.append(a) or ["ws1", "ws2"])
    monkeypatch.setattr(rollout_mod, "run_batch", lambda *a, **k: loaded.append(a))
    status = rollout_mod.main(["inv.py", "--from", str(path)])
    err = capsys.readouterr().err
    assert status == rollout_mod.EXIT_USAGE and not loaded
    assert err == (
        f"rollout: --from {path}: not a rollout report's host row: hosts[1]: restart_pending_files: "
        "not a list; nothing was run\n"
    )


def test_a_batch_pyinfra_failed_is_failed_although_every_host_said_ok(tmp_path, monkeypatch):
    """pyinfra exits non-zero while each host's record says ok: every row of the batch fails,
    with pyinfra's exit status as its reason (the typed rows are replaced, not edited)."""
    script = (
        "import json, os\n"
        "with open(os.environ['FREETOKEN_RUN_RECORD'], 'a') as f:\n"
        "    for h in ('ws1', 'ws2'):\n"
        f"        f.write(json.dumps({{'host': h, 'observed': {OBSERVED!r}}}) + '\\n')\n"
        "        f.write(json.dumps({'host': h, 'finished': {'failed': False, 'changes': 0}}) + '\\n')\n"
        "raise SystemExit(1)\n"
    )
    monkeypatch.setattr(rollout_mod, "pyinfra_argv", lambda *a: [sys.executable, "-c", script])
    import io

    batch = rollout_mod.run_batch(0, ["ws1", "ws2"], "inv.py", "deploy.py", [], out=io.StringIO())
    assert batch.returncode == 1
    assert [(r.host, r.result, r.reason) for r in batch.rows] == [
        ("ws1", "failed", "pyinfra exited 1 (see the log above)"),
        ("ws2", "failed", "pyinfra exited 1 (see the log above)"),
    ]
    assert all(r.batch == 1 and r.tokens_per_s == 23.9 for r in batch.rows)
