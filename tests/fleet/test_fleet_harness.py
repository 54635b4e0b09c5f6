"""The simulated fleet itself: real systemd hosts that look like the profiles' WSL2 workstations,
a working apt through the bridge, and a teardown that leaves nothing behind (also after a
bring-up killed half-way)."""
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.profiles import BRIDGE_NAME, PROFILES

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
    assert sorted(sim_fleet.hosts) == ["ws1", "ws2", "ws3"]
    for name in sim_fleet.hosts:
        r = sim_fleet.run(name, "systemctl is-system-running; ps -p 1 -o comm=; hostname")
        state, pid1, hostname = r.stdout.split()
        assert state in ("running", "degraded") and pid1 == "systemd" and hostname == name
        assert "microsoft-standard-WSL2" in sim_fleet.run(name, "cat /proc/version").stdout


def test_gpu_standins_report_the_profile(sim_fleet):
    for name in sim_fleet.hosts:
        g = PROFILES[name].gpu
        r = sim_fleet.run(name, "/usr/lib/wsl/lib/nvidia-smi --query-gpu=name,compute_cap,"
                                "memory.total,driver_version --format=csv,noheader,nounits")
        assert r.stdout == f"{g.name}, {g.compute_cap}, {g.memory_total_mib}, {g.driver_version}\n"
        assert sim_fleet.run(name, "stat -c %t:%T /dev/dxg").stdout.strip() == "a:3f"


def test_memory_probe_healthy_on_ws1_locked_on_ws3(sim_fleet):
    ws1 = sim_fleet.run("ws1", f"python3 -c '{MEMORY_PROBE}'", check=True).stdout.split()
    assert ws1[2] == "CUDA_SUCCESS"
    ws3 = sim_fleet.run("ws3", f"python3 -c '{MEMORY_PROBE}'", check=True).stdout.split()
    assert ws3[2] == "CUDA_ERROR_OUT_OF_MEMORY" and int(ws3[0]) > 11 * 1024 ** 3


def test_windows_standins(sim_fleet):
    for name in sim_fleet.hosts:
        p = PROFILES[name]
        assert sim_fleet.run(name, "wslinfo --wsl-version").stdout == p.wsl_version + "\n"
        raw = sim_fleet.run(name, "wsl.exe --version", binary=True).stdout
        first = raw.decode("utf-16-le").split("\r\n")[0]
        label = "WSL 版本" if p.windows_language == "zh" else "WSL version"
        assert first == f"{label}: {p.wsl_version}.0"
        profile_dir = sim_fleet.run(
            name, "cd /mnt/c && wslpath -u \"$(cmd.exe /c echo %UserProfile% | tr -d '\\r')\"")
        assert profile_dir.stdout.strip() == f"/mnt/c/Users/{p.windows_user}"
        wslconfig = sim_fleet.run(name, f"cat {profile_dir.stdout.strip()}/.wslconfig").stdout
        assert wslconfig.startswith("# my own settings - keep this comment\n")


def test_apt_works_through_the_bridge_proxy(sim_fleet):
    r = sim_fleet.run("ws2", "apt-get update -q && DEBIAN_FRONTEND=noninteractive "
                             "apt-get install -y -q curl && curl --version", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # the hosts reach nothing beyond the bridge
    assert sim_fleet.run("ws2", "ip route").stdout.strip().startswith("10.213.0.0/24")
    assert "default" not in sim_fleet.run("ws2", "ip route").stdout


def test_cuda_repo_standin_installs_toolkit_packages(sim_fleet):
    keyring = sim_fleet.services["cuda_repo"]["keyring_url"]
    r = sim_fleet.run("ws1", f"python3 -c \"import urllib.request as u; "
                             f"u.urlretrieve('{keyring}', '/tmp/k.deb')\" && dpkg -i /tmp/k.deb && "
                             "apt-get update -q && apt-get install -y -q cuda-nvcc-13-0 && "
                             "/usr/local/cuda/bin/nvcc --version", timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "release 13.0, V13.0.88" in r.stdout
    # The repository's own record (apt-cache show ignores pins, which a converged host has).
    record = sim_fleet.run("ws1", "apt-cache show cuda-13-0").stdout
    assert re.search(r"^Depends:.*cuda-drivers", record, re.M), record


def test_swap_and_snapshot_and_reboot(sim_fleet):
    before = sim_fleet.snapshot("ws3")
    sim_fleet.set_swap_used("ws3", 3 * 1024 ** 3)
    free_kb = sim_fleet.run("ws3", "awk '/SwapFree/ {print $2}' /proc/meminfo").stdout
    assert int(free_kb) == (PROFILES["ws3"].swap_total_bytes - 3 * 1024 ** 3) // 1024
    sim_fleet.set_swap_used("ws3", 0)
    assert harness.snapshot_diff(before, sim_fleet.snapshot("ws3")) == []
    sim_fleet.run("ws3", "touch /etc/sim-marker")
    assert "added /etc/sim-marker" in harness.snapshot_diff(before, sim_fleet.snapshot("ws3"))
    boot_id = sim_fleet.run("ws3", "cat /proc/sys/kernel/random/boot_id").stdout
    pid_before = sim_fleet.state["hosts"]["ws3"]["pid"]
    sim_fleet.reboot("ws3")
    assert sim_fleet.state["hosts"]["ws3"]["pid"] != pid_before
    assert sim_fleet.run("ws3", "cat /etc/sim-marker && systemctl is-system-running").returncode == 0
    del boot_id  # boot_id is the VM's kernel's, shared by all containers


def _leftovers() -> list[str]:
    out = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += [f"netns {line.split()[0]}" for line in netns.splitlines()
            if line.startswith(harness.NETNS_PREFIX)]
    if Path(f"/sys/class/net/{BRIDGE_NAME}").exists():
        out.append(f"bridge {BRIDGE_NAME}")
    out += [f"link {n}" for n in os.listdir("/sys/class/net") if n.startswith(harness.NETNS_PREFIX)]
    out += [f"process {p}" for p in harness._our_stray_processes()]
    if harness.state_dir().exists():
        out.append(f"state dir {harness.state_dir()}")
    if (harness.cache_dir() / "hosts").exists():
        out.append("host copies")
    return out


def test_down_leaves_nothing_and_up_recovers_from_a_killed_run(sim_fleet):
    """Runs last: tears the session fleet down, checks, then brings it back up."""
    pids = [h["pid"] for h in sim_fleet.state["hosts"].values()] + \
        [s["pid"] for s in sim_fleet.services.values() if s.get("pid")]
    harness.down()
    assert _leftovers() == []
    assert not any(harness._alive(p) for p in pids)

    # A bring-up killed half-way (kill -9 after the first host started) leaves debris ...
    proc = subprocess.Popen([sys.executable, "-m", "tests.fleet", "up", "--hosts", "3"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = harness.load_state()
        if state and any(h.get("pid") for h in state["hosts"].values()):
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _leftovers() != []
    # ... which the next `up` cleans before it works.
    harness.up(3)
    assert sorted(json.loads(harness.state_file().read_text())["hosts"]) == ["ws1", "ws2", "ws3"]
    assert sim_fleet.run("ws2", "systemctl is-system-running").stdout.strip() in (
        "running", "degraded")
