"""Cut or colliding runs on the simulated fleet, all on ws1, in order, sharing the
fleet with each other (each scenario starts from the state the previous one left):

Cuts: a deploy is cut at one point, either by killing the SSH session serving it on the host
(a Wi-Fi drop, a laptop lid) or by killing the controller (SIGKILL, a crash). A watcher on the
host polls every 20 ms for the point (a process, a changed file) and acts at once. Then the
same deploy again must converge ws1 and gate it (or roll back a broken version), and a third
run must change nothing and show the last gate, which is for the version serving. The cut run
itself never prints a Python traceback; a lost connection is one line.

Collisions: two runs started together wait for each other on the host lock (the later one's
wish wins, each report matches what was serving when that run ended), and a lock left by a
killed controller is taken over by the next run at once.

Wrong answers: a version that answers the gate's question wrongly is rolled
back and never reported as passed.

The module leaves ws1 as it found it (0.2.1, nothing to change) for the modules after it.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.client import PYINFRA, ROOT, deploy, grand_total, health

pytestmark = pytest.mark.fleet

HOST = "ws1"
RECORD = "/var/lib/freetoken-deploy/health-gate.json"
STANDIN_CONFIG = "/etc/freetoken-standin.json"
BASE = "/opt/freetoken"

# Runs on the host: waits for a cut point, then (sshd mode) kills every SSH session but its own
# (the deploy's) or (controller mode) prints HIT for the test to kill the controller.
WATCHER = r"""
import os, sys, time, signal
mode, kind, arg = sys.argv[1], sys.argv[2], sys.argv[3]
me = os.getpid()

def stat(pid):
    try:
        text = open("/proc/%d/stat" % pid).read()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], int(text[text.rindex(")") + 2:].split()[1])

def ancestors(pid):
    out = set()
    while pid > 1:
        out.add(pid)
        s = stat(pid)
        if s is None:
            break
        pid = s[1]
    return out

mine = ancestors(me)

def procs():
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in mine:
            try:
                yield int(name), open("/proc/%s/cmdline" % name, "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                pass

start = os.stat(arg).st_mtime_ns if kind == "changed" and os.path.exists(arg) else None
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    if kind == "proc":
        hit = any(arg in cmd for _, cmd in procs())
    elif kind == "changed":
        hit = os.path.exists(arg) and os.stat(arg).st_mtime_ns != start
    else:  # exists
        hit = os.path.exists(arg)
    if hit:
        if mode == "sshd":
            for pid, _ in list(procs()):
                s = stat(pid)
                if s and s[0].startswith("sshd") and s[1] != 1:  # sessions, not the listener
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
        print("HIT", flush=True)
        sys.exit(0)
    time.sleep(0.02)
print("MISSED", flush=True)
sys.exit(1)
"""


def start_deploy(*extra: str) -> tuple[subprocess.Popen, Path]:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"cut-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(
        [PYINFRA, "-y", "--limit", HOST, *extra, "inventories/sim.py", "deploys/freetoken.py"],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    return proc, log


def cut(fleet, mode: str, kind: str, arg: str, *extra: str) -> str:
    """Run the deploy with ``extra``, cut it when the watcher sees ``kind``/``arg``; its output."""
    watcher = subprocess.Popen(
        fleet.ssh_argv(HOST) + ["python3", "-", mode, kind, shlex.quote(arg)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher.stdin.write(WATCHER)
    watcher.stdin.close()
    time.sleep(1.0)  # the watcher runs before the deploy starts
    proc, log = start_deploy(*extra)
    try:
        # Wait for the watcher's word, but not past the deploy's end (a cut point that never comes).
        ready, _, _ = select.select([watcher.stdout], [], [], 0)
        while not ready and proc.poll() is None:
            ready, _, _ = select.select([watcher.stdout], [], [], 0.5)
        line = watcher.stdout.readline().strip() if ready else "the deploy ended first"
        assert line == "HIT", f"the cut point {kind} {arg} never came: {line}\n{log.read_text()[-5000:]}"
        if mode == "controller":
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.kill()
    out = log.read_text()
    log.unlink()
    print(f"--- cut run ({mode} at {kind} {arg}) ---\n{out[-8000:]}")
    assert proc.returncode != 0, "the cut run succeeded: the cut came too late"
    assert "Traceback" not in out, out[-8000:]
    return out


def gate_row(out: str) -> dict[str, str]:
    lines = out[out.rindex("== health gate ==") :].splitlines()
    header = re.split(r"\s{2,}", lines[1].strip())
    for line in lines[3:]:
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == HOST:
            return dict(zip(header, cells, strict=False))
    raise AssertionError(f"no {HOST} row:\n{lines}")


def gate_json(out: str) -> dict:
    """The gate script's final JSON line in a run's output (after the host prefix)."""
    lines = [line[line.index("{") :] for line in out.splitlines() if '{"ok": ' in line]
    assert lines, out[-5000:]
    return json.loads(lines[-1])


def record(fleet) -> dict:
    return json.loads(fleet.run(HOST, f"cat {RECORD}", check=True).stdout)


def assert_nothing_half_done(fleet) -> None:
    """No half-built venv in use, no link or file left beside its target, active names a whole
    environment."""
    active = fleet.run(HOST, f"readlink {BASE}/active", check=True).stdout.strip()
    assert fleet.run(HOST, f"test -f {active}/.freetoken-infra-complete").returncode == 0, active
    leftovers = fleet.run(
        HOST, f"ls -d {BASE}/active.* /etc/systemd/system/freetoken.service.new /etc/freetoken/*.new 2>/dev/null"
    ).stdout.split()
    assert leftovers == [], leftovers


def converges(fleet, *extra: str, version: str, ok: bool = True) -> None:
    """The run after a cut converges and gates; the third changes nothing and shows the gate
    of the version serving."""
    again = deploy("--limit", HOST, *extra)
    out = again.stdout + again.stderr
    assert (again.returncode == 0) is ok, out[-8000:]
    row = gate_row(out)
    assert row["health"] == "ok" and "not re-checked" not in row.get("note", ""), row  # it gated
    assert health(fleet, HOST)["version"] == version
    rec = record(fleet)
    assert rec["ok"] and rec["version"] == version and rec["gated"]["engine_version"] == version, rec
    assert_nothing_half_done(fleet)
    third_extra = extra if ok else ("--data", f"engine_version={version}")
    third = deploy("--limit", HOST, *third_extra)
    out = third.stdout + third.stderr
    assert third.returncode == 0, out[-8000:]
    _, changed, errors, _ = grand_total(third)
    assert (changed, errors) == ("-", "-"), out[-8000:]
    row = gate_row(out)
    assert row["health"] == "ok" and "not re-checked" in row["note"], row
    assert float(row["decode tok/s"].rstrip("*")) == pytest.approx(rec["decode_tps"], abs=0.05)
    assert health(fleet, HOST)["version"] == version


@pytest.fixture(scope="module")
def ws1(sim_fleet):
    t0 = time.monotonic()
    first = deploy("--limit", HOST)
    assert first.returncode == 0, (first.stdout + first.stderr)[-8000:]
    yield sim_fleet
    print(f"\ntest_interrupted: {time.monotonic() - t0:.0f} s for the module (after the fleet was up)")


def test_cut_during_engine_install_by_killing_the_controller(ws1):
    # 0.2.2 is installed from nothing (modules before this one may have left its environment).
    assert ws1.run(HOST, f"readlink {BASE}/active", check=True).stdout.strip() == f"{BASE}/0.2.1"
    ws1.run(HOST, f"rm -rf {BASE}/0.2.2", check=True)
    cut(ws1, "controller", "proc", "pip install --progress-bar off freetoken", "--data", "engine_version=0.2.2")
    assert ws1.run(HOST, f"readlink {BASE}/active", check=True).stdout.strip() == f"{BASE}/0.2.1"
    converges(ws1, "--data", "engine_version=0.2.2", version="0.2.2")


def test_cut_during_the_gate_by_killing_the_ssh_session(ws1):
    out = cut(ws1, "sshd", "proc", "health_gate.py --url", "--data", "engine_version=0.2.1")
    assert f"{HOST}: connection lost during the health gate; re-run to finish" in out.splitlines()
    row = gate_row(out)
    assert row["health"] == "cut off" and "connection lost" in row["note"] and "FAILED" not in out, row
    # the record does not vouch for what is installed now
    assert not record(ws1)["ok"]
    converges(ws1, "--data", "engine_version=0.2.1", version="0.2.1")


def test_cut_during_the_restart_by_killing_the_ssh_session(ws1):
    out = cut(ws1, "sshd", "proc", "restart freetoken.service", "--data", "engine_version=0.2.2")
    assert re.search(rf"^{HOST}: connection lost during .+; re-run to finish$", out, re.M), out[-3000:]
    converges(ws1, "--data", "engine_version=0.2.2", version="0.2.2")


def test_cut_after_the_environment_changed_by_killing_the_controller(ws1):
    """The engine's environment is rewritten, the controller dies before the restart: the next
    run has nothing to write, but its last gate was not for this environment, so it restarts the
    engine and gates it."""
    data = ("--data", "engine_version=0.2.1", "--data", "log_level=DEBUG")
    cut(ws1, "controller", "changed", "/etc/freetoken/engine.env", *data)
    converges(ws1, *data, version="0.2.1")
    main_pid = "$(systemctl show -p MainPID --value freetoken.service)"
    env = ws1.run(HOST, f"tr '\\0' '\\n' < /proc/{main_pid}/environ", check=True).stdout
    assert "LOG_LEVEL=DEBUG" in env.splitlines()  # the engine serving runs with it


def test_cut_during_the_rollback_by_killing_the_controller(ws1):
    """0.2.3 is broken: its gate fails, the rollback to 0.2.1 starts and the controller dies.
    The next run tries 0.2.3 again and rolls back again; ws1 serves 0.2.1, gated."""
    cut(ws1, "controller", "proc", "active.rollback", "--data", "engine_version=0.2.3")
    converges(ws1, "--data", "engine_version=0.2.3", version="0.2.1", ok=False)


def test_cut_while_reading_facts_by_killing_the_ssh_session(ws1):
    """Cut before any step, while the host lock and the facts travel in one command."""
    out = cut(ws1, "sshd", "proc", "@@ftbatch", "--data", "engine_version=0.2.2")
    lost = f"{HOST}: connection lost during the host lock and the fact reads (before any change); re-run to finish"
    assert lost in out.splitlines() and "stopped:" not in out, out[-3000:]
    converges(ws1, "--data", "engine_version=0.2.2", version="0.2.2")


def test_cut_during_the_model_wait_by_killing_the_controller(ws1):
    """An upgrade that also has to fetch the model again (its folder is gone): the controller
    dies while it waits for the download unit, which goes on by itself. The next run waits for
    it (or finds it done), switches to the new version and gates it."""
    from freetoken_infra.core.layout import HostLayout
    from freetoken_infra.core.settings import Settings

    settings = Settings()
    ws1.run(HOST, f"rm -rf {shlex.quote(settings.model_dir)}", check=True)
    status = HostLayout.of(settings).fetch_status_file
    out = cut(ws1, "controller", "changed", status, "--data", "engine_version=0.2.1")
    assert "model: fetching" in out, out[-3000:]
    converges(ws1, "--data", "engine_version=0.2.1", version="0.2.1")
    assert ws1.run(HOST, f"test -f {shlex.quote(settings.model_dir)}/config.json").returncode == 0


def test_two_runs_at_once_the_later_one_waits_and_wins(ws1):
    first, first_log = start_deploy("--data", "engine_version=0.2.2")
    # The second starts once the first holds ws1 (a second or so): which run is the later one
    # is then certain.
    deadline = time.monotonic() + 120
    while ws1.run(HOST, f"test -e {harness_lock()}").returncode != 0:
        assert time.monotonic() < deadline and first.poll() is None, first_log.read_text()[-5000:]
        time.sleep(0.2)
    # root's alone: the engine's user cannot read who runs what
    assert ws1.run(HOST, f"stat -c %a {harness_lock()}").stdout.strip() == "600"
    second, second_log = start_deploy()  # the fleet's version, 0.2.1
    assert first.wait(timeout=900) == 0, first_log.read_text()[-8000:]
    assert second.wait(timeout=900) == 0, second_log.read_text()[-8000:]
    out1, out2 = first_log.read_text(), second_log.read_text()
    print(out1[-6000:], out2[-6000:], sep="\n--- second ---\n")
    waiting = [line for line in out2.splitlines() if "waiting for the host lock, held by" in line]
    assert waiting and "engine_version=0.2.2" in waiting[0] and "since" in waiting[0], out2[-6000:]
    # each report matches what was serving when its run ended; the later run's wish stands
    assert gate_row(out1)["health"] == "ok" and gate_json(out1)["version"] == "0.2.2"
    assert gate_row(out2)["health"] == "ok" and gate_json(out2)["version"] == "0.2.1"
    assert health(ws1, HOST)["version"] == "0.2.1" and record(ws1)["version"] == "0.2.1"
    assert ws1.run(HOST, f"test -e {harness_lock()}").returncode != 0  # released


def harness_lock() -> str:
    from freetoken_infra.core.layout import HOST_LOCK_FILE

    return HOST_LOCK_FILE


def test_a_lock_left_by_a_killed_controller_does_not_block_the_next_run(ws1):
    cut(ws1, "controller", "exists", harness_lock())
    assert ws1.run(HOST, f"test -e {harness_lock()}").returncode == 0  # left behind
    doctor = subprocess.run(
        [PYINFRA, "-y", "--limit", HOST, "inventories/sim.py", "deploys/doctor.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    assert f"[{HOST}] deploy lock: left by " in doctor.stdout + doctor.stderr, doctor.stderr[-3000:]
    t0 = time.monotonic()
    again = deploy("--limit", HOST)
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "took over the host lock (holder gone)" in out, out[-8000:]
    assert "waiting for the host lock" not in out
    assert grand_total(again)[1:3] == ("-", "-"), out[-5000:]
    print(f"run after the killed one: {time.monotonic() - t0:.0f} s")


def test_a_version_that_answers_wrongly_is_rolled_back_and_never_passes(ws1):
    config = json.loads(ws1.run(HOST, f"cat {STANDIN_CONFIG}", check=True).stdout)
    ws1.run(HOST, f"printf '%s' '{json.dumps({**config, 'wrong_answers': ['0.2.2']})}' > {STANDIN_CONFIG}", check=True)
    try:
        run = deploy("--limit", HOST, "--data", "engine_version=0.2.2")
        out = run.stdout + run.stderr
        assert run.returncode != 0
        assert "rolled back to 0.2.1: 0.2.2 failed the health gate in the answer phase: wrong answer" in out
        assert health(ws1, HOST)["version"] == "0.2.1"
        rec = record(ws1)
        assert rec["ok"] and rec["version"] == "0.2.1" and rec["rolled_back_from"] == "0.2.2", rec
    finally:
        ws1.run(HOST, f"printf '%s' '{json.dumps(config)}' > {STANDIN_CONFIG}", check=True)
    back = deploy("--limit", HOST)  # the fleet's version: nothing to change, ws1 left as found
    assert back.returncode == 0 and grand_total(back)[1:3] == ("-", "-"), (back.stdout + back.stderr)[-5000:]
