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

from tests.fleet import harness

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
SERVING = ("ws1", "ws2")


def deploy(*extra: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [PYINFRA, "-y", *extra, "inventories/sim.py", "deploys/freetoken.py"],
        cwd=ROOT, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout,
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
        fleet.ssh_argv(host) + ["python3", "-c", json.dumps(script)], input=key + "\n",
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def health(fleet, host) -> dict:
    r = fleet.run(host, "python3 -c \"import urllib.request;print(urllib.request.urlopen("
                  "'http://127.0.0.1:8000/health',timeout=5).read().decode())\"")
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


def engine_pid(fleet, host) -> int:
    return int(fleet.run(host, "systemctl show -p MainPID --value freetoken.service", check=True).stdout)


def parse_grand_total(output: str) -> tuple[str, str, str, str] | None:
    """pyinfra's results table, last line: (host-operations, changed, errors, unchanged); '-' = 0."""
    total = re.search(r"Grand total\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)", output[output.rfind("--> Results:"):])
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
