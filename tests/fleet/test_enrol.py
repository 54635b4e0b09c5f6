"""A new PC joins the fleet in one command, on a bare simulated workstation: no sshd,
no controller key, systemd off in /etc/wsl.conf (harness.start_bare, booted only by this
module). Driven as its owner and the operator would:

1. the owner runs the single-file enrol.py through the PC's console (no SSH yet), as sudo would
   (no $WSL_DISTRO_NAME), admitting the controller (the bridge) and the gateway host; a declined
   Windows prompt stops it in one line; the Windows stand-ins record the interop calls: one
   elevation prompt for the Hyper-V firewall rule (those addresses, Domain and Private profiles)
   and the logon task; the deploy's own account, `from=` on its key, the drop-in read first and
   sshd's effective values; a second run changes nothing; a bad key is refused in one line;
2. the owner does what it says (`wsl.exe --shutdown`: the container boots again);
3. the operator's `fleet add` refuses another host key, then pins the printed one, runs the
   doctor and adds the host to an inventory file, as `freetoken-deploy`;
4. the normal deploy converges it from that inventory (through sudo) and the verify suite
   passes on it;
5. `fleet remove` takes it out again.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleet import harness
from tests.fleet.client import ROOT
from tests.fleet.profiles import BRIDGE_ADDRESS, GATEWAY_ADDRESS

pytestmark = pytest.mark.fleet

HOST = harness.BARE_NAME
SCRIPT = ROOT / "operations" / "scripts" / "enrol.py"
WRONG_PIN = "SHA256:" + "A" * 43
DEPLOY_USER = "freetoken-deploy"
DEPLOY_KEYS = f"home/{DEPLOY_USER}/.ssh/authorized_keys"
# The controller is this machine, on the bridge; the gateway host's address is admitted too.
ALLOW = (BRIDGE_ADDRESS, GATEWAY_ADDRESS)


@pytest.fixture(scope="module")
def bare(sim_fleet):
    h = harness.start_bare()
    try:
        yield h
    finally:
        harness.stop_bare()


@pytest.fixture(scope="module")
def run(sim_fleet, bare, tmp_path_factory):
    """What the module's steps leave for the next ones."""
    work = tmp_path_factory.mktemp("enrol")
    standalone = subprocess.run([sys.executable, str(SCRIPT), "--bundle"], capture_output=True, check=True).stdout
    (Path(bare["root"]) / "root/enrol.py").write_bytes(standalone)
    pub = Path(bare["ssh_key"] + ".pub").read_text().strip()
    return {"work": work, "pub": pub, "root": Path(bare["root"])}


def _enrol(sim_fleet, run):
    allow = [arg for address in ALLOW for arg in ("--allow", address)]
    return sim_fleet.console(HOST, ["python3", "/root/enrol.py", "--key", run["pub"], "--name", HOST, *allow])


def _calls(root: Path) -> list[dict]:
    path = root / "mnt/c/.sim/calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_bare_host_cannot_be_reached(sim_fleet, bare):
    r = subprocess.run(sim_fleet.ssh_argv(HOST) + ["-p", "2222", "true"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 255, r.stderr
    assert not (Path(bare["root"]) / "usr/sbin/sshd").exists()


def test_a_declined_windows_prompt_stops_the_run_in_one_line(sim_fleet, run):
    flag = run["root"] / "mnt/c/.sim/uac-decline"
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.write_text("the owner says no\n")
    try:
        r = _enrol(sim_fleet, run)
    finally:
        flag.unlink()
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("enrol: Windows: the elevated PowerShell failed or was declined")
    assert r.stderr.strip().count("\n") == 0
    assert not (run["root"] / "mnt/c/.sim/hyperv-firewall.json").exists()


def test_the_owner_enrols_it_in_one_command(sim_fleet, run):
    run["calls_before"] = len(_calls(run["root"]))
    r = _enrol(sim_fleet, run)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stderr
    root = run["root"]
    assert re.search(r"^\[boot\]\nsystemd=true\n", (root / "etc/wsl.conf").read_text(), re.M)
    user = json.loads((root / ".sim/profile.json").read_text())["windows_user"]
    wslconfig = (root / f"mnt/c/Users/{user}/.wslconfig").read_text()
    assert "networkingMode=mirrored" in wslconfig and "# my own settings - keep this comment" in wslconfig
    dropin = (root / "etc/ssh/sshd_config.d/00-freetoken.conf").read_text()
    assert "AuthenticationMethods publickey" in dropin and f"AllowUsers {DEPLOY_USER}\n" in dropin
    assert not (root / "etc/ssh/sshd_config.d/freetoken.conf").exists()
    effective = sim_fleet.console(HOST, ["/usr/sbin/sshd", "-T"])
    assert effective.returncode == 0, effective.stderr
    lines = set(effective.stdout.splitlines())
    assert {"port 2222", "passwordauthentication no", "pubkeyauthentication yes", f"allowusers {DEPLOY_USER}"} <= lines
    assert not {line for line in lines if line.startswith(("port ", "allowusers "))} - {
        "port 2222",
        f"allowusers {DEPLOY_USER}",
    }
    # The deploy's own account: no password (key only), sudo as root, the key from the controller only.
    assert re.search(
        rf"^{DEPLOY_USER}:x:\d+:\d+:[^:]*:/home/{DEPLOY_USER}:/bin/bash$", (root / "etc/passwd").read_text(), re.M
    )
    assert re.search(rf"^{DEPLOY_USER}:\*:", (root / "etc/shadow").read_text(), re.M)
    sudoers = (root / "etc/sudoers.d/freetoken-deploy").read_text()
    assert f"{DEPLOY_USER} ALL=(root) NOPASSWD: ALL\n" in sudoers
    assert (root / DEPLOY_KEYS).read_text() == f'from="{",".join(ALLOW)}" {run["pub"]}\n'
    assert not (root / "root/.ssh/authorized_keys").exists()  # not root's, not the owner's
    calls = _calls(root)[run["calls_before"] :]
    assert [c["tool"] for c in calls].count("uac") == 1  # Windows asked once
    rules = json.loads((root / "mnt/c/.sim/hyperv-firewall.json").read_text())
    assert rules["FreeToken-WSL-sshd"]["local_ports"] == "2222"
    assert rules["FreeToken-WSL-sshd"]["vm_creator_id"] == "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}"
    assert rules["FreeToken-WSL-sshd"]["remote_addresses"] == list(ALLOW)
    assert rules["FreeToken-WSL-sshd"]["profiles"] == ["Domain", "Private"]
    tasks = json.loads((root / "mnt/c/.sim/schtasks.json").read_text())
    assert re.fullmatch(r"wsl\.exe -d \S+ --exec /bin/true", tasks["FreeToken-WSL"]["/TR"])
    assert "still to do: from Windows, run `wsl.exe --shutdown`" in r.stdout
    pub = (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text()
    listed = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=pub, capture_output=True, text=True, check=True)
    run["host_key"] = listed.stdout.split()[1]
    assert f"# host key {run['host_key']}" in r.stdout
    assert f"--host-key {run['host_key']}" in r.stdout and f"--user {DEPLOY_USER}" in r.stdout


def test_a_second_run_changes_nothing_and_asks_windows_nothing(sim_fleet, run):
    before = len(_calls(run["root"]))
    r = _enrol(sim_fleet, run)
    assert r.returncode == 0, r.stderr
    assert "--> nothing changed" in r.stdout, r.stdout
    assert "uac" not in [c["tool"] for c in _calls(run["root"])[before:]]


def test_bad_input_is_refused_in_one_line_and_changes_nothing(sim_fleet, run):
    before = (run["root"] / DEPLOY_KEYS).read_text()
    r = sim_fleet.console(HOST, ["python3", "/root/enrol.py", "--key", run["pub"] + "\nssh-ed25519 AAAA x"])
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and r.stderr.startswith("enrol: --key")
    r = sim_fleet.console(HOST, ["python3", "/root/enrol.py", "--key", run["pub"]])  # no --allow
    assert r.returncode == 2 and r.stderr.startswith("enrol: --allow: give the address the controller connects from")
    assert (run["root"] / DEPLOY_KEYS).read_text() == before


def _inventory(path: Path) -> None:
    path.write_text(
        '"""The fleet test\'s inventory: hosts that `fleet add` put in, with the sim\'s stand-in URLs."""\n\n'
        "import sys\n\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from inventories.sim import SIM_DATA  # noqa: E402\n\n"
        "rtx5060ti_16gb = [\n]\n\n"
        "sim = ([name for name, _ in rtx5060ti_16gb], SIM_DATA)\n"
    )


def _fleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freetoken_infra.fleet", *args], capture_output=True, text=True, cwd=ROOT, timeout=900
    )


def test_after_the_restart_fleet_add_pins_its_key_runs_the_doctor_and_adds_it(sim_fleet, bare, run):
    harness.reboot_bare()  # the owner's `wsl.exe --shutdown`
    inventory = run["work"] / "fleet.py"
    _inventory(inventory)
    run["inventory"] = inventory
    before = inventory.read_text()
    common = ["--class", "rtx5060ti_16gb", "--user", DEPLOY_USER, "--ssh-key", bare["ssh_key"]]
    known = str(run["work"] / "known_hosts")
    wrong = _fleet(
        "-i", str(inventory), "add", HOST, bare["address"], "--host-key", WRONG_PIN, "--known-hosts", known, *common
    )
    assert wrong.returncode == 1 and f"not the pinned {WRONG_PIN}" in wrong.stderr, wrong.stderr
    assert inventory.read_text() == before
    added = _fleet(
        "-i",
        str(inventory),
        "add",
        HOST,
        bare["address"],
        "--host-key",
        run["host_key"],
        "--known-hosts",
        known,
        *common,
    )
    print(added.stdout, added.stderr)
    assert added.returncode == 0, added.stdout[-3000:] + added.stderr
    assert f'("{HOST}", {{"ssh_hostname": "{bare["address"]}"' in inventory.read_text()


def test_the_normal_deploy_converges_it_and_the_verify_suite_passes(sim_fleet, run):
    inventory = str(run["inventory"])
    deploy = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", inventory, "deploys/freetoken.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert deploy.returncode == 0, deploy.stdout[-4000:] + deploy.stderr[-2000:]
    verify = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/verify", "--inventory", inventory, "-p", "no:cacheprovider", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    assert verify.returncode == 0, verify.stdout[-4000:]
    assert re.search(r"\d+ passed", verify.stdout)


def test_fleet_remove_takes_it_out(run):
    removed = _fleet("-i", str(run["inventory"]), "remove", HOST, "--no-gateway")
    assert removed.returncode == 0, removed.stderr
    assert HOST not in run["inventory"].read_text()
