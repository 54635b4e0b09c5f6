"""The simulated fleet itself: real systemd hosts that look like the profiles' WSL2 workstations,
a working apt through the bridge, a fleet lock that hand-run `up`/`down` wait for, and a teardown
that leaves nothing behind (also after a bring-up killed half-way)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fleet import client, harness
from tests.fleet.profiles import PROFILES, profile_for

pytestmark = pytest.mark.fleet

REPO = Path(__file__).resolve().parents[2]

MEMORY_PROBE = r"""
import ctypes as c
l = c.CDLL("libcuda.so.1")
d = c.c_int(); ctx = c.c_void_p(); f = c.c_size_t(); t = c.c_size_t(); p = c.c_ulonglong()
assert l.cuInit(0) == 0 and l.cuDeviceGet(c.byref(d), 0) == 0
assert l.cuCtxCreate_v2(c.byref(ctx), 0, d) == 0
assert l.cuMemGetInfo_v2(c.byref(f), c.byref(t)) == 0
r = l.cuMemAlloc_v2(c.byref(p), c.c_size_t(32 << 20))
s = c.c_char_p(); l.cuGetErrorName(r, c.byref(s))
print(f.value, t.value, s.value.decode())
"""


def test_hosts_run_systemd_and_answer_ssh(sim_fleet):
    assert set(sim_fleet.hosts) == set(harness.host_names(harness.host_count()))
    for name in sim_fleet.hosts:
        r = sim_fleet.run(name, "systemctl is-system-running; ps -p 1 -o comm=; hostname")
        state, pid1, hostname = r.stdout.split()
        assert state in ("running", "degraded") and pid1 == "systemd" and hostname == name
        assert "microsoft-standard-WSL2" in sim_fleet.run(name, "cat /proc/version").stdout


def test_gpu_standins_report_the_profile(sim_fleet):
    for name in sim_fleet.hosts:
        g = profile_for(name).gpu
        r = sim_fleet.run(
            name,
            "/usr/lib/wsl/lib/nvidia-smi --query-gpu=name,compute_cap,"
            "memory.total,driver_version --format=csv,noheader,nounits",
        )
        assert r.stdout == f"{g.name}, {g.compute_cap}, {g.memory_total_mib}, {g.driver_version}\n"
        assert sim_fleet.run(name, "stat -c %t:%T /dev/dxg").stdout.strip() == "a:3f"
        # the engine stand-in's CUDA OOM line names this host's GPU
        standin = json.loads(sim_fleet.run(name, "cat /etc/freetoken-standin.json", check=True).stdout)
        assert standin["gpu_total_mib"] == g.memory_total_mib, name


def test_one_place_decides_the_host_count(monkeypatch):
    monkeypatch.delenv("FREETOKEN_SIM_HOSTS", raising=False)
    assert harness.host_count() == len(PROFILES)
    monkeypatch.setenv("FREETOKEN_SIM_HOSTS", "5")
    assert harness.host_count() == 5 and harness.host_names(5)[-1] == "ws5"
    monkeypatch.setenv("FREETOKEN_SIM_HOSTS", "three")
    with pytest.raises(harness.FleetError, match="FREETOKEN_SIM_HOSTS"):
        harness.host_count()


def test_memory_probe_healthy_on_ws1_locked_on_ws3(sim_fleet):
    ws1 = sim_fleet.run("ws1", f"python3 -c '{MEMORY_PROBE}'", check=True).stdout.split()
    assert ws1[2] == "CUDA_SUCCESS"
    ws3 = sim_fleet.run("ws3", f"python3 -c '{MEMORY_PROBE}'", check=True).stdout.split()
    assert ws3[2] == "CUDA_ERROR_OUT_OF_MEMORY" and int(ws3[0]) > 11 * 1024**3


def test_windows_standins(sim_fleet):
    for name in sim_fleet.hosts:
        p = profile_for(name)
        assert sim_fleet.run(name, "wslinfo --wsl-version").stdout == p.wsl_version + "\n"
        raw = sim_fleet.run(name, "/mnt/c/Windows/System32/wsl.exe --version", binary=True).stdout
        first = raw.decode("utf-16-le").split("\r\n")[0]
        label = "WSL 版本" if p.windows_language == "zh" else "WSL version"
        assert first == f"{label}: {p.wsl_version}.0"
        profile_dir = sim_fleet.run(
            name, "cd /mnt/c && wslpath -u \"$(/mnt/c/Windows/System32/cmd.exe /c echo %UserProfile% | tr -d '\\r')\""
        )
        assert profile_dir.stdout.strip() == f"/mnt/c/Users/{p.windows_user}"
        wslconfig = sim_fleet.run(name, f"cat {profile_dir.stdout.strip()}/.wslconfig").stdout
        assert wslconfig.startswith("# my own settings - keep this comment\n")


def test_apt_works_through_the_bridge_proxy(sim_fleet):
    r = sim_fleet.run(
        "ws2",
        "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q curl && curl --version",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # the hosts reach nothing beyond the bridge
    assert sim_fleet.run("ws2", "ip route").stdout.strip().startswith("10.213.0.0/24")
    assert "default" not in sim_fleet.run("ws2", "ip route").stdout


def test_cuda_repo_standin_installs_toolkit_packages(sim_fleet):
    keyring = sim_fleet.services["cuda_repo"]["keyring_url"]
    r = sim_fleet.run(
        "ws1",
        f'python3 -c "import urllib.request as u; '
        f"u.urlretrieve('{keyring}', '/tmp/k.deb')\" && dpkg -i /tmp/k.deb && "
        "apt-get update -q && apt-get install -y -q cuda-nvcc-13-0 && "
        "/usr/local/cuda/bin/nvcc --version",
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "release 13.0, V13.0.88" in r.stdout
    # The repository's own record (apt-cache show ignores pins, which a converged host has).
    record = sim_fleet.run("ws1", "apt-cache show cuda-13-0").stdout
    assert re.search(r"^Depends:.*cuda-drivers", record, re.M), record


def test_swap_and_snapshot_and_reboot(sim_fleet):
    before = sim_fleet.snapshot("ws3")
    # an idle host: two snapshots agree (nothing in the covered trees changes by itself)
    assert harness.snapshot_diff(before, sim_fleet.snapshot("ws3")) == []
    sim_fleet.set_swap_used("ws3", 3 * 1024**3)
    free_kb = sim_fleet.run("ws3", "awk '/SwapFree/ {print $2}' /proc/meminfo").stdout
    assert int(free_kb) == (PROFILES["ws3"].swap_total_bytes - 3 * 1024**3) // 1024
    sim_fleet.set_swap_used("ws3", 0)
    # a look through the Windows stand-ins (a query) is no change
    sim_fleet.run(
        "ws3",
        "/mnt/c/Windows/System32/wsl.exe --version >/dev/null; /mnt/c/Windows/System32/cmd.exe /c echo %UserProfile% >/dev/null",
        check=True,
    )
    assert harness.snapshot_diff(before, sim_fleet.snapshot("ws3")) == []
    user = PROFILES["ws3"].windows_user
    sim_fleet.run(
        "ws3",
        f"touch /etc/sim-marker && echo '[x]' >> /mnt/c/Users/{user}/.wslconfig && "
        "touch /usr/share/keyrings/sim.gpg /var/cache/sim-marker && mkdir -p /home/u && "
        "/mnt/c/Windows/System32/wsl.exe --shutdown",
        check=True,
    )
    diff = harness.snapshot_diff(before, sim_fleet.snapshot("ws3"))
    for seen in (
        "added /etc/sim-marker",
        f"changed /mnt/c/Users/{user}/.wslconfig",
        "added /usr/share/keyrings/sim.gpg",
        "added /var/cache/sim-marker",
        "added /home/u",
        "windows_calls +wsl.exe --shutdown",
    ):
        assert any(line.startswith(seen) for line in diff), (seen, diff)
    boot_id = sim_fleet.run("ws3", "cat /proc/sys/kernel/random/boot_id").stdout
    pid_before = sim_fleet.state["hosts"]["ws3"]["pid"]
    sim_fleet.reboot("ws3")
    assert sim_fleet.state["hosts"]["ws3"]["pid"] != pid_before
    assert sim_fleet.run("ws3", "cat /etc/sim-marker && systemctl is-system-running").returncode == 0
    del boot_id  # boot_id is the VM's kernel's, shared by all containers


def test_hand_run_down_waits_for_the_sessions_lock(sim_fleet):
    """`python -m tests.fleet down` by hand while this session holds the fleet: it says so and
    waits instead of tearing the session's hosts down."""
    env = {k: v for k, v in os.environ.items() if k != harness.LOCK_FD_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fleet", "down"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(120, proc.kill)  # a hung child ends the read with EOF
    watchdog.start()
    try:
        first = proc.stderr.readline()
        assert "another session holds the simulated fleet" in first, first
        assert proc.poll() is None
        assert sim_fleet.run("ws1", "systemctl is-system-running").stdout.strip() in ("running", "degraded")
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert harness.state_file().exists()


def test_down_leaves_nothing_and_up_recovers_from_a_killed_run(sim_fleet):
    """Tears the session's fleet down and looks for leftovers without trusting the harness's
    records (client.leftovers), kills a bring-up half-way, and checks the next `up` cleans its
    debris and works. Leaves a fresh fleet up for the modules after this one (each converges its
    own); the session's final down is checked the same way by the sim_fleet fixture."""
    pids = [h["pid"] for h in sim_fleet.state["hosts"].values()] + [
        s["pid"] for s in sim_fleet.services.values() if s.get("pid")
    ]
    harness.down()
    assert client.leftovers() == []
    assert not any(harness._alive(p) for p in pids)

    # A bring-up killed half-way (kill -9 after the first host started) leaves debris. The
    # killed `up` is the real CLI, acting under this session's fleet lock, which it inherits.
    env, fds = harness.lock_for_child()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fleet", "up"],
        cwd=REPO,
        env=env,
        pass_fds=fds,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        state = harness.load_state()
        if state and any(h.get("pid") for h in state["hosts"].values()):
            break
        time.sleep(0.1)
    assert proc.poll() is None, f"the CLI's up ended ({proc.returncode}) before a host started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert client.leftovers() != []
    # ... which the next `up` cleans before it works.
    harness.up()
    assert set(json.loads(harness.state_file().read_text())["hosts"]) == set(harness.host_names(harness.host_count()))
    assert sim_fleet.run("ws2", "systemctl is-system-running").stdout.strip() in ("running", "degraded")
