"""The verify suite (tests/verify) against the simulated fleet, run exactly as a user runs it:
`pytest tests/verify --inventory inventories/sim.py --limit ...` in a child process, its
outcome read from its junit XML.

1. After a converge, every check passes on ws1 and ws2, the hosts the deploy serves.
2. ws3, which the deploy refuses at preflight and leaves untouched, is no FreeToken endpoint:
   the suite says so (it is left out of the passing run with --limit, as a user does).
3. Break one thing at a time on ws1 and see the matching check, and only it, fail; then undo
   the break exactly. Stopping the engine fails every check of the running endpoint (socket,
   /health, chat, decode, its process) - nothing serves - and no other.
4. After all the breaks, a converge of ws1 changes nothing: the repairs left it converged.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import pytest

from freetoken_infra.core.layout import CUDA_PIN_FILE, GUARD_TIMER, HostLayout
from freetoken_infra.core.settings import Settings
from operations.service import UNIT_PATH, key_path
from tests.fleet import harness
from tests.fleet.client import ROOT, SERVING, deploy, grand_total, wait_healthy
from tests.fleet.profiles import BRIDGE_ADDRESS, PROFILES
from tests.verify import bridge

pytestmark = pytest.mark.fleet

HOST = "ws1"
SAVE = "/root/.verify-break"  # what a break moved aside, for its exact undo
DEFAULTS = Settings()  # the sim keeps the default paths and unit names

# The checks that need a serving engine: they fail together when it is down.
SERVING_CHECKS = {
    "test_service_active",
    "test_service_runs_as_the_service_user",
    "test_api_listens_only_on_the_configured_address_and_port",
    "test_health_ok",
    "test_chat_completion_answers",
    "test_decode_tokens_per_s_at_or_above_the_floor",
}


@dataclass
class Verified:
    outcomes: dict[tuple[str, str], str]  # (check, host) -> passed / failed / error / skipped
    messages: dict[tuple[str, str], str]
    returncode: int
    output: str

    def __repr__(self) -> str:  # assertion messages: the verdict, not the whole output
        lines = self.output.strip().splitlines()
        return f"<verify exit {self.returncode}: {lines[-1] if lines else ''}>"

    def checks(self, host: str) -> dict[str, str]:
        return {check: outcome for (check, h), outcome in self.outcomes.items() if h == host}

    def not_passed(self, host: str) -> set[str]:
        return {check for check, outcome in self.checks(host).items() if outcome != "passed"}


def verify(tmp_path, *args: str) -> Verified:
    xml = tmp_path / f"verify-{len(list(tmp_path.glob('verify-*.xml')))}.xml"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/verify",
            "--inventory",
            "inventories/sim.py",
            *args,
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-q",
            "-rfEs",
            "--tb=line",
            f"--junitxml={xml}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-6000:], run.stderr[-3000:], sep="\n")
    assert xml.exists(), f"the verify suite did not run (exit {run.returncode})"
    outcomes, messages = {}, {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        check, _, host = case.get("name").partition("[")
        key = (check, host.rstrip("]"))
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome, messages[key] = tag.replace("failure", "failed"), node.get("message") or ""
                break
        outcomes[key] = outcome
    return Verified(outcomes, messages, run.returncode, run.stdout + run.stderr)


@pytest.fixture(scope="module")
def converged(sim_fleet):
    # The breaks below spell the default paths: ws1's settings must still be the defaults.
    (ws1,) = bridge.targets(ROOT / "inventories" / "sim.py", [HOST])
    for name in ("cuda_home", "engine_base_dir", "model_dir", "config_dir", "listen_host"):
        assert getattr(ws1.settings, name) == getattr(DEFAULTS, name), name
    deploy()  # ws3 is refused at preflight, so this run reports a failed host
    for host in SERVING:
        wait_healthy(sim_fleet, host)
    sim_fleet.run(HOST, f"rm -rf {SAVE} && mkdir -m 700 {SAVE}", check=True)
    return sim_fleet


@pytest.fixture(scope="module")
def baseline(converged, tmp_path_factory):
    return verify(tmp_path_factory.mktemp("verify"), "--limit", ",".join(SERVING))


def test_every_check_passes_on_the_converged_hosts(baseline):
    assert baseline.returncode == 0, baseline.output[-4000:]
    for host in SERVING:
        checks = baseline.checks(host)
        assert len(checks) >= 21, sorted(checks)
        assert {c for c, o in checks.items() if o != "passed"} == set(), baseline.messages


def test_the_refused_host_is_not_verified(converged, tmp_path):
    ws3 = verify(tmp_path, "--limit", "ws3", "--health-wait", "1")
    assert ws3.returncode == 1
    failed = ws3.not_passed("ws3")
    assert {"test_wsl_version_at_or_above_the_floor", "test_service_active", "test_health_ok"} <= failed
    assert "2.6.1" in ws3.messages[("test_wsl_version_at_or_above_the_floor", "ws3")]


# --------------------------------------------------------------------------- breaks


def _py(code: str) -> str:
    return "python3 -c " + shlex.quote(code)


def _edit_json(path: str, key: str, value) -> str:
    """Back the file up under SAVE (mode and mtime kept), then set one key."""
    name = os.path.basename(path)
    return f"cp -p {path} {SAVE}/{name} && " + _py(
        f"import json; p={path!r}; d=json.load(open(p)); d[{key!r}]={value!r}; open(p, 'w').write(json.dumps(d))"
    )


def _restore(path: str) -> str:
    """Put the backup back (content, mode, mtime) and drop it."""
    saved = f"{SAVE}/{os.path.basename(path)}"
    return f"cp -p {saved} {path} && rm {saved}"


MODEL_FLIP = """
import json, os, sys
save = "%s/model.json" % sys.argv[1]
if os.path.exists(save):
    spot = json.load(open(save))
else:
    d = sys.argv[2]
    files = json.load(open(os.path.join(d, ".freetoken-manifest.json")))["files"]
    name = max(files, key=lambda n: files[n]["size"])
    path = os.path.join(d, name)
    spot = {"path": path, "offset": os.path.getsize(path) // 2}
st = os.stat(spot["path"])
with open(spot["path"], "r+b") as f:  # same size, one byte inverted (twice: restored)
    f.seek(spot["offset"]); b = f.read(1); f.seek(spot["offset"]); f.write(bytes([b[0] ^ 0xFF]))
os.utime(spot["path"], ns=(st.st_atime_ns, st.st_mtime_ns))  # the manifest's mtime still matches
if os.path.exists(save):
    os.remove(save)
else:
    json.dump(spot, open(save, "w"))
"""

DRIVER_DEB = """
import re, sys, urllib.request as u
repo = sys.argv[1]
index = u.urlopen(repo + "Packages").read().decode()
stanza = next(s for s in index.split("\\n\\n") if re.search(r"^Package: cuda-drivers$", s, re.M))
u.urlretrieve(repo + re.search(r"^Filename: (\\S+)$", stanza, re.M).group(1).removeprefix("./"),
              "/tmp/cuda-drivers.deb")
"""


@dataclass(frozen=True)
class Break:
    name: str
    fails: frozenset[str]
    do: str
    undo: str
    restarts: bool = False  # the engine restarts: wait for /health ok after do and after undo


def _breaks() -> list[Break]:
    wslconfig = f"/mnt/c/Users/{PROFILES[HOST].windows_user}/.wslconfig"
    nvcc = f"{DEFAULTS.cuda_home}/bin/nvcc"
    active = HostLayout.of(DEFAULTS).engine_active_link
    dropin = "/etc/systemd/system/freetoken.service.d"
    key = key_path(DEFAULTS)
    repo = f"http://{BRIDGE_ADDRESS}:{harness.PORTS['cuda_repo']}/{harness.CUDA_REPO_PATH}"
    return [
        Break(
            "stop the service",
            frozenset(SERVING_CHECKS),
            "systemctl stop freetoken.service",
            "systemctl start freetoken.service",
        ),
        Break(
            "disable the service",
            frozenset({"test_service_enabled"}),
            "systemctl disable --quiet freetoken.service",
            "systemctl enable --quiet freetoken.service",
        ),
        Break(
            "restart policy off",
            frozenset({"test_service_restart_policy"}),
            f"mkdir -p {dropin} && printf '[Service]\\nRestart=no\\n' > {dropin}/verify-break.conf && "
            "systemctl daemon-reload",
            f"rm {dropin}/verify-break.conf && rmdir {dropin} && systemctl daemon-reload",
        ),
        Break(
            "a .wslconfig value",
            frozenset({"test_wslconfig_holds_the_configured_values"}),
            f"cp -p {wslconfig} {SAVE}/ && sed -i 's/^memory=24GB/memory=16GB/' {wslconfig} && "
            f"grep -q '^memory=16GB' {wslconfig}",
            _restore(wslconfig),
        ),
        Break(
            "wsl.conf without systemd",
            frozenset({"test_wsl_conf_boots_systemd"}),
            f"cp -p /etc/wsl.conf {SAVE}/ && sed -i 's/^systemd=true/systemd=false/' /etc/wsl.conf && "
            "grep -q '^systemd=false' /etc/wsl.conf",
            _restore("/etc/wsl.conf"),
        ),
        Break(
            "WSL below the floor",
            frozenset({"test_wsl_version_at_or_above_the_floor"}),
            _edit_json("/.sim/profile.json", "wsl_version", "2.6.1"),
            _restore("/.sim/profile.json"),
        ),
        # The pin blocks apt, so the package comes the way a user's manual install would: dpkg -i.
        Break(
            "a driver package installed",
            frozenset({"test_no_driver_package_installed"}),
            f"python3 -c {shlex.quote(DRIVER_DEB)} {repo} && dpkg -i /tmp/cuda-drivers.deb",
            "dpkg --purge cuda-drivers && rm /tmp/cuda-drivers.deb",
        ),
        Break(
            "the driver pin removed",
            frozenset({"test_driver_packages_pinned_out"}),
            f"mv {CUDA_PIN_FILE} {SAVE}/pin",
            f"mv {SAVE}/pin {CUDA_PIN_FILE}",
        ),
        Break(
            "nvcc gone", frozenset({"test_nvcc_lists_the_gpu_arch"}), f"mv {nvcc} {SAVE}/nvcc", f"mv {SAVE}/nvcc {nvcc}"
        ),
        Break(
            "the engine link on another version",
            frozenset({"test_engine_environment_holds_the_configured_version"}),
            f"cp -P {active} {SAVE}/active && ln -sfn {DEFAULTS.engine_base_dir}/0.0.0 {active}",
            f"mv -T {SAVE}/active {active}",
        ),
        Break(
            "a model byte changed",
            frozenset({"test_model_files_match_the_verified_manifest"}),
            f"python3 -c {shlex.quote(MODEL_FLIP)} {SAVE} {DEFAULTS.model_dir}",
            f"python3 -c {shlex.quote(MODEL_FLIP)} {SAVE} {DEFAULTS.model_dir}",
        ),
        Break(
            "the model writable by the engine",
            frozenset({"test_the_model_is_read_only_to_the_engine"}),
            f"chown {DEFAULTS.service_user} {DEFAULTS.model_dir}",
            f"chown {DEFAULTS.fetch_user} {DEFAULTS.model_dir}",
        ),
        Break(
            "the API on every address",
            frozenset({"test_api_listens_only_on_the_configured_address_and_port"}),
            f"cp -p {UNIT_PATH} {SAVE}/ && sed -i 's/--host 127.0.0.1/--host 0.0.0.0/' {UNIT_PATH} && "
            f"grep -q -- '--host 0.0.0.0' {UNIT_PATH} && systemctl daemon-reload && "
            "systemctl restart freetoken.service",
            f"{_restore(UNIT_PATH)} && systemctl daemon-reload && systemctl restart freetoken.service",
            restarts=True,
        ),
        # The engine stand-in's pace (its own knob, not a setting): a GPU decoding too slowly.
        Break(
            "decode below the floor",
            frozenset({"test_decode_tokens_per_s_at_or_above_the_floor"}),
            _edit_json("/etc/freetoken-standin.json", "tokens_per_s", 10.0) + " && systemctl restart freetoken.service",
            _restore("/etc/freetoken-standin.json") + " && systemctl restart freetoken.service",
            restarts=True,
        ),
        Break(
            "the key file readable by all",
            frozenset({"test_secret_files_are_0600"}),
            f"chmod 644 {key}",
            f"chmod 600 {key}",
        ),
        # A process started with the key as an argument (read from the file: never in this
        # command line, and never in the journal).
        Break(
            "the key on a command line",
            frozenset({"test_api_key_in_neither_ps_nor_the_journal"}),
            f"k=$(sed -n 's/^FREETOKEN_API_KEY=//p' {key}) && "
            "{ python3 -c 'import os, time; os.setsid(); time.sleep(900)' verify-leak \"$k\" "
            f"</dev/null >/dev/null 2>&1 & echo $! > {SAVE}/leak.pid; }}",
            f"kill $(cat {SAVE}/leak.pid) && rm {SAVE}/leak.pid",
        ),
        # journalctl fails (as a broken or rotated-away journal would): a journal that was not
        # read must not pass for one without the key.
        Break(
            "the journal unreadable",
            frozenset({"test_api_key_in_neither_ps_nor_the_journal"}),
            f"mv /usr/bin/journalctl {SAVE}/journalctl && printf '#!/bin/sh\\nexit 1\\n' > /usr/bin/journalctl && "
            "chmod 755 /usr/bin/journalctl",
            f"mv {SAVE}/journalctl /usr/bin/journalctl",
        ),
        Break(
            "the guard timer stopped",
            frozenset({"test_guard_timer_active"}),
            f"systemctl stop {GUARD_TIMER}",
            f"systemctl start {GUARD_TIMER}",
        ),
    ]


BREAKS = _breaks()


@pytest.mark.parametrize("broken", BREAKS, ids=[b.name.replace(" ", "-") for b in BREAKS])
def test_breaking_one_thing_fails_its_check_and_only_it(converged, baseline, tmp_path, broken):
    fleet = converged
    all_checks = set(baseline.checks(HOST))
    assert broken.fails <= all_checks
    fleet.run(HOST, broken.do, check=True)
    try:
        if broken.restarts:
            wait_healthy(fleet, HOST)
        result = verify(tmp_path, "--limit", HOST, "--health-wait", "5")
        assert set(result.checks(HOST)) == all_checks
        assert result.not_passed(HOST) == broken.fails, {
            k: v for k, v in result.messages.items() if k[0] in result.not_passed(HOST) ^ broken.fails
        }
        assert all(result.outcomes[(c, HOST)] == "failed" for c in broken.fails)
    finally:
        fleet.run(HOST, broken.undo, check=True)
        if broken.restarts or "test_health_ok" in broken.fails:
            wait_healthy(fleet, HOST)


def test_the_repairs_left_the_host_converged(converged, baseline):
    again = deploy("--limit", HOST)
    assert again.returncode == 0
    _, changed, errors, _ = grand_total(again)
    assert (changed, errors) == ("-", "-"), again.stdout[-4000:]
    converged.run(HOST, f"rmdir {SAVE}", check=True)
