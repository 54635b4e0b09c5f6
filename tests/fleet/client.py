"""What the fleet tests do to the simulated fleet from outside: run the deploy with the pyinfra
CLI (exactly as a user does) and talk to a host's engine over SSH, the API key always on stdin.
Shared by every tests/fleet/test_*.py module."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from freetoken_infra.core.layout import DEPLOY_STATE_DIR
from tests.fleet import harness

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
SERVING = ("ws1", "ws2")


def deploy(*extra: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [PYINFRA, "-y", *extra, "inventories/sim.py", "deploys/freetoken.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-20000:], run.stderr[-20000:], sep="\n")
    return run


def api_key(fleet, host) -> str:
    text = fleet.run(host, "cat /etc/freetoken/api-key.env", check=True).stdout
    return text.strip().split("=", 1)[1]


def chat(fleet, host, key: str) -> dict:
    # The key travels on stdin to python on the host, never in an argument.
    script = (
        "import json,sys,urllib.request;key=sys.stdin.readline().strip();"
        "req=urllib.request.Request('http://127.0.0.1:8000/v1/chat/completions',"
        "data=json.dumps({'model':'Qwen3.6-35B-A3B-NVFP4-nvidia','messages':[{'role':'user','content':'hi'}],"
        "'max_tokens':8}).encode(),headers={'Authorization':'Bearer '+key,'Content-Type':'application/json'});"
        "print(urllib.request.urlopen(req,timeout=60).read().decode())"
    )
    r = subprocess.run(
        fleet.ssh_argv(host) + ["python3", "-c", json.dumps(script)],
        input=key + "\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def health(fleet, host) -> dict:
    r = fleet.run(
        host,
        'python3 -c "import urllib.request;print(urllib.request.urlopen('
        "'http://127.0.0.1:8000/health',timeout=5).read().decode())\"",
    )
    return json.loads(r.stdout) if r.returncode == 0 else {"status": "down", "error": r.stderr}


def wait_healthy(fleet, host, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    last = {}
    while time.time() < deadline:
        last = health(fleet, host)
        if last.get("status") == "ok":
            return last
        time.sleep(2)
    raise AssertionError(f"{host} not healthy after {timeout}s: {last}")


def wait_until(what: str, check, timeout: float, poll: float = 0.2) -> float:
    """The time `check()` first held; fails naming `what` after `timeout` (a bound on a hang only:
    what the time itself is worth, a bench prints)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return time.time()
        time.sleep(poll)
    raise AssertionError(f"{what}: not within {timeout} s")


def engine_pid(fleet, host) -> int:
    return int(fleet.run(host, "systemctl show -p MainPID --value freetoken.service", check=True).stdout)


def parse_grand_total(output: str) -> tuple[str, str, str, str] | None:
    """pyinfra's results table, last line: (host-operations, changed, errors, unchanged); '-' = 0
    (all four for a run in which no host had an operation: every host answered by its fast check)."""
    total = re.search(r"Grand total\s+(\d+|-)\s+(\S+)\s+(\S+)\s+(\S+)", output[output.rfind("--> Results:") :])
    return total.groups() if total else None


def grand_total(run: subprocess.CompletedProcess) -> tuple[str, str, str, str]:
    total = parse_grand_total(run.stdout + run.stderr)
    assert total, (run.stdout + run.stderr)[-5000:]
    return total


def hub(fleet, path: str, body: dict | None = None) -> dict:
    """Call the hub stand-in's switches and counters (``/_standin/stats``, ``reset``, ``cut``,
    ``throttle``; tests/fleet/standins/hub.py) from the controller."""
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(fleet.url("hub") + path, data=data, method="POST" if data else "GET")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as r:
        return json.loads(r.read())


def fault(fleet, host, kind: str, **options) -> dict:
    """Throw one of the engine stand-in's fault switches on `host` (``crash``, ``exit``, ``oom``,
    ``swap``; tests/fleet/standins/engine/freetoken/standin.py) through its loopback-only
    ``POST /_standin/fault``, the API key on stdin. ``swap`` takes ``mib_per_s``."""
    key = api_key(fleet, host)
    script = (
        "import json,sys,urllib.request;k=sys.stdin.readline().strip();body=sys.stdin.readline();"
        "r=urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:8000/_standin/fault',"
        "data=body.encode(),headers={'Authorization':'Bearer '+k,'Content-Type':'application/json'}),"
        "timeout=30);print(r.read().decode())"
    )
    r = subprocess.run(
        fleet.ssh_argv(host) + ["python3", "-c", json.dumps(script)],
        input=key + "\n" + json.dumps({"kind": kind, **options}) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"{host}: fault {kind}: {r.stderr}"
    return json.loads(r.stdout)


def swap_used_bytes(fleet, host) -> int:
    """SwapTotal - SwapFree as the host's own `free -b` reports it."""
    row = fleet.run(host, "free -b | awk '/^Swap:/ {print $3}'", check=True).stdout
    return int(row)


def leftovers() -> list[str]:
    """Whatever of a simulated fleet still exists on this machine, found without the harness's
    state or PID bookkeeping: any process in a network namespace other than ours (every fleet
    host's processes live in one), any systemd-nspawn, any named network namespace, the bridge
    or any veth link, any address on the bridge's subnet, any TCP server listening on the
    bridge address, the state dir and the host copies."""
    from ipaddress import ip_address, ip_network

    from tests.fleet.profiles import BRIDGE_ADDRESS, BRIDGE_NAME, BRIDGE_PREFIX

    out = []
    own_netns = os.readlink("/proc/self/ns/net")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            netns = os.readlink(entry / "ns" / "net")
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        if not cmd:
            continue  # kernel threads
        if netns != own_netns:
            out.append(f"process {entry.name} in {netns}: {cmd[:120]}")
        elif comm == "systemd-nspawn":
            out.append(f"process {entry.name} (systemd-nspawn): {cmd[:120]}")
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    out += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.split()]
    if Path("/run/netns").is_dir():
        out += [f"netns file /run/netns/{n}" for n in os.listdir("/run/netns")]
    if Path(f"/sys/class/net/{BRIDGE_NAME}").exists():
        out.append(f"bridge {BRIDGE_NAME}")
    veths = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    out += [f"veth link {line.split(':')[1].strip().split('@')[0]}" for line in veths.splitlines() if ":" in line]
    subnet = ip_network(f"{BRIDGE_ADDRESS}/{BRIDGE_PREFIX}", strict=False)
    for line in subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if "inet" in parts and ip_address(parts[parts.index("inet") + 1].split("/")[0]) in subnet:
            out.append(f"address {parts[parts.index('inet') + 1]} on {parts[1]}")
    bridge_hex = "".join(f"{int(b):02X}" for b in reversed(BRIDGE_ADDRESS.split(".")))
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and local.split(":")[0] == bridge_hex:
            out.append(f"listening server on {BRIDGE_ADDRESS}:{int(local.split(':')[1], 16)}")
    if harness.state_dir().exists():
        out.append(f"state dir {harness.state_dir()}")
    if (harness.cache_dir() / "hosts").exists():
        out.append(f"host copies {harness.cache_dir() / 'hosts'}")
    return out


# What the guard timer writes every 30 s (samples and its journal position, in root's state
# directory): changes a snapshot comparison of "nothing changed" must not count.
GUARD_SAMPLES = (f"{DEPLOY_STATE_DIR}/metrics/", f"{DEPLOY_STATE_DIR}/guard-journal.json")


def report_rows(doc: dict) -> dict[str, dict]:
    """A rollout report's rows by host."""
    return {r["host"]: r for r in doc["hosts"]}


def snapshot_without_guard_samples(fleet, host) -> dict:
    """``fleet.snapshot(host)`` less the guard's periodic writes."""
    snap = fleet.snapshot(host)
    snap["files"] = {p: v for p, v in snap["files"].items() if not p.startswith(GUARD_SAMPLES)}
    return snap
