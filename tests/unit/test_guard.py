"""The memory guard: the target-side script (run for real, with fake nvidia-smi, journalctl and
systemctl first on PATH), its state fact, and the unit texts the operation writes."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from facts.guard import GuardState, parse_guard_state_output
from freetoken_infra.core.settings import Settings
from tests.unit.fakehost import FakeHost

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "operations" / "scripts" / "guard.py"
FIXTURES = ROOT / "tests" / "fixtures" / "real"

# Swap in kB: 4 GiB total; "low" uses 128 MiB (the fixture), "high" 2.6 GiB.
SWAP_TOTAL_KB = 4194304
SWAP_HIGH_FREE_KB = SWAP_TOTAL_KB - int(2.6 * 1024 * 1024)


def meminfo(swap_free_kb=4063232):
    text = (FIXTURES / "proc-meminfo-wsl-24g.txt").read_text()
    return re.sub(r"SwapFree:\s+\d+ kB", f"SwapFree:       {swap_free_kb} kB", text)


OOM_LINES = (FIXTURES / "pytorch-cuda-oom-lines.txt").read_text().splitlines()


def record(level, message, tag="FrontendAPI", when="2026-12-03|07:41:30"):
    """One log record as FreeToken 0.2.1's utils/logger.py prints it: bold timestamp carrying the
    logger's tag (server/api_server.py: init_logger(__name__, "FrontendAPI")), the level in its
    colour padded to 8. Compared byte for byte with what the real wheel's init_logger printed."""
    colour = {"DEBUG": 36, "INFO": 32, "WARNING": 33, "ERROR": 31}[level]
    return f"\x1b[1m[{when}|{tag}]\x1b[0m \x1b[{colour}m{level:<8}\x1b[0m {message}\n"


def worker_traceback(last_line):
    """A scheduler worker dying of an exception (multiprocessing prints this to stderr)."""
    return (
        "Process freetoken-TP0-scheduler:\nTraceback (most recent call last):\n"
        '  File "/opt/freetoken/0.2.1/lib/python3.12/site-packages/freetoken/scheduler/scheduler.py", '
        "line 318, in run_forever\n    data = self.overlap_loop(data)\n"
        f"{last_line}\n"
    )


WORKER_DIED = record("ERROR", "Backend supervisor: backend worker freetoken-TP0-scheduler exited")


def worker_oom_death(oom_line=OOM_LINES[0]):
    return worker_traceback(oom_line) + WORKER_DIED


FAKE = """#!/bin/sh
echo "$0 $*" >> "{log}"
{body}
"""


class Target:
    """A temporary 'host': fake tools on PATH, a meminfo file, state and metrics paths."""

    def __init__(self, tmp_path: Path):
        self.dir = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "calls.log"
        self.log.write_text("")
        self.meminfo = tmp_path / "meminfo"
        self.meminfo.write_text(meminfo())
        self.journal = tmp_path / "journal.txt"
        self.journal.write_text("Loading experts 33%\n")
        self.engine_state = tmp_path / "engine-state"
        self.engine_state.write_text("active\n")
        self.state_file = tmp_path / "state" / "guard-state.json"
        self.textfile = tmp_path / "state" / "metrics" / "freetoken.prom"
        self.fake("journalctl", f'cat "{self.journal}"; echo "-- cursor: s=abc;i=42"')
        self.fake(
            "systemctl",
            (
                f'case "$1" in is-active) cat "{self.engine_state}"; '
                f'grep -q "^active" "{self.engine_state}";; '
                f'stop) echo inactive > "{self.engine_state}";; esac'
            ),
        )
        # The real query answers "index, memory.used, memory.total" (MiB).
        self.fake(
            "nvidia-smi", f'awk -F\', \' \'{{print $1", "$5", "$4}}\' "{FIXTURES / "nvidia-smi-query-5060ti.csv"}"'
        )

    def fake(self, name, body):
        path = self.bin / name
        path.write_text(FAKE.format(log=self.log, body=body))
        path.chmod(0o755)

    def run(self, *extra, swap_limit="2.0"):
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "LC_ALL": "C"}
        return subprocess.run(
            [
                sys.executable,
                str(SCRIPT),
                "--swap-limit-gb",
                swap_limit,
                "--state-file",
                str(self.state_file),
                "--textfile",
                str(self.textfile),
                "--meminfo",
                str(self.meminfo),
                *extra,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    def calls(self, tool):
        return [
            line.split(" ", 1)[1] if " " in line else ""
            for line in self.log.read_text().splitlines()
            if line.split(" ", 1)[0].endswith("/" + tool)
        ]

    def metrics(self):
        return parse_textfile(self.textfile.read_text())


# A strict reader of Prometheus' text exposition format, as node_exporter's textfile
# collector expects it: HELP and TYPE before a metric's samples, each metric once.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf'^({_NAME})(\{{(?:[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*")(?:,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*")*\}})? (\S+)$'
)


def parse_textfile(text):
    assert text.endswith("\n"), "the file must end with a newline"
    helped, typed, seen_samples = set(), {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            assert re.fullmatch(_NAME, name) and name not in helped, line
            helped.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("gauge", "counter", "untyped") and name not in typed, line
            assert name not in seen_samples, f"TYPE after samples: {line}"
            typed[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            name, labels, value = match.group(1), match.group(2) or "", match.group(3)
            assert name in typed and name in helped, f"sample without HELP/TYPE: {line}"
            float(value)
            assert labels not in seen_samples.setdefault(name, {}), f"duplicate sample: {line}"
            seen_samples[name][labels] = float(value)
    return seen_samples


EXPECTED_METRICS = {
    "freetoken_guard_ram_total_bytes",
    "freetoken_guard_ram_available_bytes",
    "freetoken_guard_swap_total_bytes",
    "freetoken_guard_swap_used_bytes",
    "freetoken_guard_gpu_memory_used_bytes",
    "freetoken_guard_gpu_memory_total_bytes",
    "freetoken_guard_tripped",
    "freetoken_guard_last_run_timestamp_seconds",
}


@pytest.fixture
def target(tmp_path):
    return Target(tmp_path)


def test_swap_below_limit_changes_nothing(target):
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    assert "stop" not in " ".join(target.calls("systemctl"))
    assert not target.state_file.exists()
    assert proc.stdout == ""
    m = target.metrics()
    assert set(m) == EXPECTED_METRICS
    assert m["freetoken_guard_ram_total_bytes"][""] == 24567892 * 1024
    assert m["freetoken_guard_swap_used_bytes"][""] == (4194304 - 4063232) * 1024
    assert m["freetoken_guard_gpu_memory_used_bytes"]['{gpu="0"}'] == 1043 * 1024 * 1024
    assert m["freetoken_guard_gpu_memory_total_bytes"]['{gpu="0"}'] == 16311 * 1024 * 1024
    assert m["freetoken_guard_tripped"][""] == 0
    assert oct(target.textfile.stat().st_mode & 0o777) == "0o644"
    # No temp files left beside the metrics (the collector would read them).
    assert [p.name for p in target.textfile.parent.iterdir()] == ["freetoken.prom"]


def test_swap_above_limit_stops_the_engine(target):
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    assert "stop freetoken.service" in target.calls("systemctl")
    assert proc.stdout.strip() == "freetoken-guard: stopped freetoken.service: swap 2.6 GB > 2.0 GB"
    state = json.loads(target.state_file.read_text())
    assert state["tripped"] is True
    assert state["reason"] == "swap 2.6 GB > 2.0 GB"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", state["time"])
    assert state["samples"]["swap_used_bytes"] == (SWAP_TOTAL_KB - SWAP_HIGH_FREE_KB) * 1024
    assert state["samples"]["gpus"][0]["index"] == "0"
    assert target.metrics()["freetoken_guard_tripped"][""] == 1


def test_swap_limit_argument_is_honoured(target):
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    proc = target.run(swap_limit="3.0")
    assert proc.returncode == 0, proc.stderr
    assert not target.state_file.exists()


def test_oom_line_in_journal_stops_the_engine(target):
    # A scheduler worker's OOM while serving: its traceback, then the supervisor's death record.
    target.journal.write_text("Loading experts 100%\n" + worker_oom_death())
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    assert "stop freetoken.service" in target.calls("systemctl")
    state = json.loads(target.state_file.read_text())
    assert state["tripped"] is True
    assert "CUDA out of memory in the engine's journal" in state["reason"]
    assert "Tried to allocate 22.78 GiB" in state["reason"]
    # 1 GB of 16 GB used: the fake OOM of old WSL (pitfall 4B) is named.
    assert "pitfall 4B" in state["reason"]
    assert proc.stdout.startswith("freetoken-guard: stopped freetoken.service: CUDA out of memory")
    # The journal call asks for the engine unit, plain messages, no pager.
    (journal_call,) = target.calls("journalctl")
    assert "-u freetoken.service -o cat --no-pager" in journal_call
    assert "--since @" in journal_call


def test_text_the_engine_logs_for_requests_and_replies_stops_nothing(target):
    """FreeToken logs request and model text (DEBUG "Received generate request",
    WARNING "Failed to parse JSON part: <model output>"), with its newlines, so any line without
    the engine's own ERROR record shape - however it reads - is somebody's text."""
    forged_record = (
        "[2026-12-03|07:41:30|FrontendAPI] ERROR    Backend supervisor: OutOfMemoryError: "
        "CUDA out of memory. Tried to allocate 2.00 GiB."
    )
    target.journal.write_text(
        record("DEBUG", "Received generate request {'text': 'say CUDA out of memory'}")
        + record("WARNING", "Failed to parse JSON part: CUDA out of memory. Tried to allocate 1 GiB")
        + worker_traceback(OOM_LINES[1])  # a reply that prints a whole traceback
        + "RuntimeError: CUDA error: out of memory\n"
        + "CUDA out of memory\n"
        + forged_record
        + "\n"
        + record("INFO", "Backend supervisor: OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB")
        # an ERROR record of another logger: a cache rebuild that ran out rolls back and serves on
        + record(
            "ERROR",
            "cache rebuild failed: OutOfMemoryError('CUDA out of memory. Tried to allocate "
            "2.00 GiB.') — rolling back to the previous geometry",
            tag="core|rank=0",
        )
    )
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    assert "stop freetoken.service" not in target.calls("systemctl")
    assert not target.state_file.exists() and proc.stdout == ""
    # Nothing the engine logged is held for a later death.
    position = target.state_file.parent / "guard-journal.json"
    assert json.loads(position.read_text())["pending_oom"] is None
    target.journal.write_text(WORKER_DIED)
    target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")


def test_an_oom_traceback_seen_long_ago_is_forgotten(target):
    target.journal.write_text(worker_traceback(OOM_LINES[0]))
    target.run()
    position = target.state_file.parent / "guard-journal.json"
    saved = json.loads(position.read_text())
    assert saved["pending_oom"]["line"] == OOM_LINES[0] and saved["pending_oom"]["worker"] == "freetoken-TP0-scheduler"
    saved["pending_oom"]["time"] -= 600
    position.write_text(json.dumps(saved))
    target.journal.write_text(WORKER_DIED)
    target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")


# The real texts of a CUDA OOM in torch 2.11 on an H200 (tests/fixtures/real/README.md): the
# uncaught torch.AcceleratorError's traceback (its message goes on for four more lines), and the
# text of the caching allocator's torch.OutOfMemoryError.
H200 = (FIXTURES / "torch-2.11-cuda-oom-h200.txt").read_text().splitlines()
H200_TRACEBACK = H200[H200.index("Traceback (most recent call last):") :][:8]  # to the blank line
H200_ALLOCATOR_TEXT = next(line for line in H200 if line.startswith("FIRST_OOM_TEXT ")).split(" ", 1)[1]
H200_ACCELERATOR_TEXT = json.loads(next(line for line in H200 if line.startswith("TEXT ")).split(" ", 1)[1])


def test_the_h200_fixture_is_what_these_tests_read():
    assert H200_TRACEBACK[2] == "torch.AcceleratorError: CUDA error: out of memory" and H200_TRACEBACK[-1] == ""
    assert H200_ACCELERATOR_TEXT.startswith("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'")
    assert H200_ALLOCATOR_TEXT.startswith("CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity")


def test_a_worker_dying_of_torch_2_11s_accelerator_oom_stops_the_engine(target):
    """The traceback's end as torch 2.11 prints it (the scheduler worker's, as
    multiprocessing frames it), then the supervisor's record of that worker's death."""
    block = "Process freetoken-TP0-scheduler:\n" + "\n".join(H200_TRACEBACK) + "\n"
    target.journal.write_text(block + WORKER_DIED)
    proc = target.run()
    assert "stop freetoken.service" in target.calls("systemctl"), proc.stdout
    reason = json.loads(target.state_file.read_text())["reason"]
    assert "torch.AcceleratorError: CUDA error: out of memory" in reason and "exited" in reason


@pytest.mark.parametrize(
    "reason",
    [f"AcceleratorError: {H200_ACCELERATOR_TEXT}", f"OutOfMemoryError: {H200_ALLOCATOR_TEXT}"],
    ids=["AcceleratorError", "OutOfMemoryError"],
)
def test_the_supervisors_record_of_torch_2_11s_oom_during_load_stops_the_engine(target, reason):
    """server/launch.py pushes "<type name>: <str(exc)>"; the AcceleratorError's text goes on
    over four more lines, which the journal holds as lines of their own."""
    target.journal.write_text(record("ERROR", f"Backend supervisor: {reason.rstrip()}"))
    proc = target.run()
    assert "stop freetoken.service" in target.calls("systemctl"), proc.stdout
    assert reason.split("\n")[0][:40] in json.loads(target.state_file.read_text())["reason"]


@pytest.mark.parametrize(
    "logged",
    [
        # a reply the engine logs (WARNING "Failed to parse JSON part: <model output>"), its
        # newlines kept: the OOM line is a line of that record's message
        record("WARNING", "Failed to parse JSON part: here is my log:") + OOM_LINES[0] + "\n",
        record("WARNING", "Failed to parse JSON part: see") + "\n".join(H200_TRACEBACK) + "\n",
        record("DEBUG", "Received generate request {'text': '") + "Traceback (most recent call last):\n"
        '  File "x", line 1\ntorch.AcceleratorError: CUDA error: out of memory\n\'}\n',
        # a worker's OOM traceback that another of the engine's records follows: not its last word
        worker_traceback(OOM_LINES[0]) + record("INFO", "Prefill batch: 1 request"),
    ],
    ids=["logged-allocator-line", "logged-accelerator-traceback", "logged-request", "not-the-last-word"],
)
@pytest.mark.parametrize("runs", [1, 2])
def test_a_logged_oom_followed_by_an_unrelated_death_is_not_an_oom_stop(target, logged, runs):
    """The attack: OOM-shaped text the engine only logged, then a scheduler
    worker dies of something else (killed: no traceback of its own), in the same guard run or the
    next one. The old guard held the line for 120 s and pinned it on that death."""
    died = record("ERROR", "Backend supervisor: backend worker freetoken-TP0-scheduler exited")
    if runs == 1:
        target.journal.write_text(logged + died)
        target.run()
    else:
        target.journal.write_text(logged)
        target.run()
        target.journal.write_text(died)
        target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")
    assert not target.state_file.exists()


def test_another_workers_death_is_not_pinned_on_an_oom_traceback(target):
    target.journal.write_text(
        worker_traceback(OOM_LINES[0])
        + record("ERROR", "Backend supervisor: backend worker freetoken-TP1-scheduler exited")
    )
    target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")


@pytest.mark.parametrize("oom_line", OOM_LINES + ["RuntimeError: CUDA error: out of memory"])
def test_a_worker_dying_of_oom_stops_the_engine(target, oom_line):
    target.journal.write_text(worker_oom_death(oom_line))
    target.run()
    assert "stop freetoken.service" in target.calls("systemctl")
    assert oom_line.split(": ", 1)[1][:30] in json.loads(target.state_file.read_text())["reason"]


def test_a_worker_dying_of_something_else_stops_nothing(target):
    target.journal.write_text(
        worker_traceback("RuntimeError: CUDA error: an illegal memory access was encountered") + WORKER_DIED
    )
    target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")


def test_the_oom_traceback_and_the_death_record_may_fall_in_two_runs(target):
    target.journal.write_text(worker_traceback(OOM_LINES[0]))
    target.run()
    assert "stop freetoken.service" not in target.calls("systemctl")
    target.journal.write_text(WORKER_DIED)
    target.run()
    assert "stop freetoken.service" in target.calls("systemctl")


@pytest.mark.parametrize("tag", ["FrontendAPI", "pid=4242|FrontendAPI"])
def test_an_oom_while_loading_stops_the_engine(target, tag):
    # server/launch.py pushes "<type>: <message>" of the startup exception to the supervisor.
    reason = "OutOfMemoryError: " + OOM_LINES[0].split(": ", 1)[1]
    target.journal.write_text(record("ERROR", f"Backend supervisor: {reason}", tag=tag))
    target.run()
    assert "stop freetoken.service" in target.calls("systemctl")


def test_journal_is_read_from_where_the_last_run_stopped(target):
    target.run()
    target.journal.write_text(record("ERROR", "Backend supervisor: RuntimeError: CUDA error: out of memory"))
    target.run()
    first, second = target.calls("journalctl")
    assert "--since @" in first
    assert "--after-cursor=s=abc;i=42" in second
    assert json.loads(target.state_file.read_text())["reason"].startswith("CUDA out of memory")


def test_tripped_state_is_left_alone_when_all_is_well(target):
    target.state_file.parent.mkdir(parents=True)
    old = {"tripped": True, "reason": "swap 3.1 GB > 2.0 GB", "time": "2025-01-01T00:00:00+00:00"}
    target.state_file.write_text(json.dumps(old))
    target.engine_state.write_text("inactive\n")
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    assert json.loads(target.state_file.read_text()) == old
    assert target.metrics()["freetoken_guard_tripped"][""] == 1
    assert "stop freetoken.service" not in target.calls("systemctl")


def test_stopped_engine_is_not_stopped_again(target):
    # Swap pages linger after the engine stops: no repeated stop and log line every 30 s.
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    target.run()
    proc = target.run()
    assert proc.stdout == ""
    assert target.calls("systemctl").count("stop freetoken.service") == 1


def test_nvidia_smi_missing_still_samples_memory(target):
    if shutil.which("nvidia-smi", path="/usr/bin:/bin") or os.path.exists("/usr/lib/wsl/lib/nvidia-smi"):
        pytest.skip("this machine has a real nvidia-smi")
    (target.bin / "nvidia-smi").unlink()
    proc = target.run()
    assert proc.returncode == 0, proc.stderr
    m = target.metrics()
    assert m["freetoken_guard_ram_total_bytes"][""] > 0
    assert m.get("freetoken_guard_gpu_memory_used_bytes", {}) == {}


def test_nvidia_smi_failing_and_na_values(target):
    target.fake("nvidia-smi", "echo 'NVIDIA-SMI has failed'; exit 9")
    assert target.run().returncode == 0
    assert target.metrics().get("freetoken_guard_gpu_memory_used_bytes", {}) == {}
    target.fake("nvidia-smi", "echo '0, [N/A], 16311'")
    assert target.run().returncode == 0
    m = target.metrics()
    assert m.get("freetoken_guard_gpu_memory_used_bytes", {}) == {}
    assert m["freetoken_guard_gpu_memory_total_bytes"]['{gpu="0"}'] == 16311 * 1024 * 1024


def test_failed_stop_is_reported(target):
    target.fake("systemctl", 'case "$1" in is-active) echo active;; stop) echo "Access denied" >&2; exit 1;; esac')
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    proc = target.run()
    assert proc.returncode == 1
    assert "FAILED to stop freetoken.service" in proc.stdout
    assert "Access denied" in json.loads(target.state_file.read_text())["reason"]


def test_other_unit(target):
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    target.run("--unit", "engine-b.service")
    assert "stop engine-b.service" in target.calls("systemctl")
    assert any("-u engine-b.service" in c for c in target.calls("journalctl"))


def test_metrics_parser_rejects_bad_files():
    with pytest.raises(AssertionError):
        parse_textfile("freetoken_guard_tripped 1\n")  # no HELP/TYPE
    with pytest.raises(AssertionError):
        parse_textfile("# HELP a x\n# TYPE a gauge\na 1")  # no final newline
    with pytest.raises(AssertionError):
        parse_textfile("# HELP a x\n# TYPE a gauge\na{gpu=0} 1\n")  # unquoted label


# --------------------------------------------------------------------------- fact


def run_fact(tmp_path, state_file):
    fact = GuardState()
    command = fact.command(str(state_file))
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


def test_fact_missing_file(tmp_path):
    assert run_fact(tmp_path, tmp_path / "guard-state.json") is None
    assert GuardState.default() is None


def test_fact_reads_the_script_state(target):
    target.meminfo.write_text(meminfo(SWAP_HIGH_FREE_KB))
    target.run()
    state = run_fact(target.dir, target.state_file)
    assert state["tripped"] is True
    assert state["reason"] == "swap 2.6 GB > 2.0 GB"
    assert state["time"]


def test_fact_broken_json(tmp_path):
    path = tmp_path / "guard-state.json"
    path.write_bytes(b'{"tripped": tru\xff')
    state = run_fact(tmp_path, path)
    assert state["tripped"] is False
    assert "not valid JSON" in state["error"]


def test_fact_path_with_spaces_and_not_a_dict(tmp_path):
    path = tmp_path / "a dir" / "state.json"
    path.parent.mkdir()
    path.write_text("[1, 2]")
    state = run_fact(tmp_path, path)
    assert state["tripped"] is False and "error" in state


def test_fact_process_outputs():
    assert parse_guard_state_output(["@@ft:missing"]) is None
    assert parse_guard_state_output([]) == {"tripped": False, "error": "no output from the state probe"}
    unreadable = parse_guard_state_output(["@@ft:unreadable /var/lib/freetoken-deploy/guard-state.json"])
    assert unreadable["tripped"] is False and "not readable" in unreadable["error"]
    ok = parse_guard_state_output(["@@ft:state", "eyJ0cmlwcGVkIjogZmFsc2V9"])  # {"tripped": false}
    assert ok == {"tripped": False}


# --------------------------------------------------------------------------- units


def test_service_unit():
    from freetoken_infra.core.layout import GUARD_SCRIPT
    from operations.guard import guard_service_unit

    # Settings refuse such a path; the unit escapes it all the same.
    settings = Settings.model_construct(
        **{**Settings().model_dump(), "guard_swap_limit_gb": 3.5, "state_dir": "/srv/ft state"}
    )
    unit = guard_service_unit(settings)
    assert "Type=oneshot" in unit
    assert "User=" not in unit  # root: it must be able to stop the engine
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith(f"ExecStart=/usr/bin/python3 {GUARD_SCRIPT} ")
    assert "--unit freetoken.service" in exec_start
    assert "--swap-limit-gb 3.5" in exec_start
    # The guard is root: it writes only in root's own folder, never in the engine's state_dir.
    assert "--state-file /var/lib/freetoken-deploy/guard-state.json" in exec_start
    assert "--textfile /var/lib/freetoken-deploy/metrics/freetoken.prom" in exec_start
    assert "ReadWritePaths=-/var/lib/freetoken-deploy" in unit
    assert "/srv/ft state" not in unit


def test_service_unit_never_names_the_engines_state_dir():
    from operations.guard import guard_service_unit

    odd = Settings.model_construct(**{**Settings().model_dump(), "state_dir": "/srv/100%$x"})
    unit = guard_service_unit(odd)
    assert "/srv/100" not in unit


def test_timer_unit():
    from operations.guard import guard_timer_unit

    unit = guard_timer_unit(Settings(guard_interval_s=45))
    lines = unit.splitlines()
    for expected in (
        "OnBootSec=60",
        "OnUnitActiveSec=45s",
        "AccuracySec=1s",
        "Unit=freetoken-guard.service",
        "WantedBy=timers.target",
    ):
        assert expected in lines
    assert lines.index("[Install]") > lines.index("[Timer]")


def test_default_paths():
    from operations.guard import guard_state_file, guard_textfile

    settings = Settings()
    assert guard_state_file(settings) == "/var/lib/freetoken-deploy/guard-state.json"
    assert guard_textfile(settings) == "/var/lib/freetoken-deploy/metrics/freetoken.prom"


# --------------------------------------------------------------------------- operation
# The operation's generator with the host's facts stubbed: what it would run on a bare host,
# on a converged one, after a settings change, and when disabled. (The fleet tests run it
# for real over SSH.)


TIMER = "freetoken-guard.timer"


def guard_host(files=None, timer_on=False) -> FakeHost:
    """The guard's host: its files (path -> (text, mode)), the timer running and enabled or not."""
    on = {TIMER} if timer_on else set()
    return FakeHost(files=files, dirs={"/usr/local/lib/freetoken"}, running=on, enabled=on)


def converged_files(settings):
    from freetoken_infra.core.layout import GUARD_SCRIPT, HOSTIO_MODULE
    from operations.guard import guard_service_unit, guard_timer_unit

    return {
        GUARD_SCRIPT: (SCRIPT.read_text(), 755),
        HOSTIO_MODULE: ((ROOT / "freetoken_infra" / "core" / "hostio.py").read_text(), 644),
        "/etc/systemd/system/freetoken-guard.service": (guard_service_unit(settings), 644),
        "/etc/systemd/system/freetoken-guard.timer": (guard_timer_unit(settings), 644),
        "/var/lib/freetoken-deploy/metrics/freetoken.prom": ("", 644),
    }


def test_operation_on_a_bare_host():
    from operations.guard import guard

    cmds = guard_host().commands(guard, Settings())
    assert "upload /usr/local/lib/freetoken/guard.py" in cmds
    assert "upload /usr/local/lib/freetoken/hostio.py" in cmds  # the guard imports it from its folder
    assert "upload /etc/systemd/system/freetoken-guard.service" in cmds
    assert "upload /etc/systemd/system/freetoken-guard.timer" in cmds
    assert "mkdir -p /var/lib/freetoken-deploy/metrics" in cmds
    assert cmds[-3:] == ["systemctl daemon-reload", f"systemctl start {TIMER}", f"systemctl enable {TIMER}"]


def test_operation_is_idempotent():
    from operations.guard import guard

    settings = Settings()
    assert guard_host(converged_files(settings), timer_on=True).commands(guard, settings) == []


def test_operation_interval_change_reloads_and_restarts_the_timer():
    from operations.guard import guard

    host = guard_host(converged_files(Settings()), timer_on=True)
    cmds = host.commands(guard, Settings(guard_interval_s=60))
    assert cmds == [
        "upload /etc/systemd/system/freetoken-guard.timer",
        "chown root:root /etc/systemd/system/freetoken-guard.timer",
        "chmod 644 /etc/systemd/system/freetoken-guard.timer",
        "systemctl daemon-reload",
        f"systemctl restart {TIMER}",
    ]


def test_operation_swap_limit_change_only_reloads():
    from operations.guard import guard

    host = guard_host(converged_files(Settings()), timer_on=True)
    cmds = host.commands(guard, Settings(guard_swap_limit_gb=3))
    assert "upload /etc/systemd/system/freetoken-guard.service" in cmds
    assert cmds[-1] == "systemctl daemon-reload"


def test_operation_disabled():
    from operations.guard import guard

    settings = Settings(guard_enabled=False)
    cmds = guard_host(converged_files(Settings()), timer_on=True).commands(guard, settings)
    assert cmds == [f"systemctl stop {TIMER}", f"systemctl disable {TIMER}"]
    assert guard_host().commands(guard, settings) == []


def test_clear_guard_state():
    from operations.guard import clear_guard_state

    settings = Settings()
    assert guard_host().commands(clear_guard_state, settings) == []
    state = {"/var/lib/freetoken-deploy/guard-state.json": ("{}", 644)}
    assert guard_host(state).commands(clear_guard_state, settings) == [
        "rm -f /var/lib/freetoken-deploy/guard-state.json"
    ]
