"""What WSL shares with every Linux user, attacked on a simulated workstation (docs/security.md,
"What WSL shares with every Linux user").

On WSL any Linux account can start a Windows program as the PC's owner through the interop
socket (0777), and `wsl.exe -u root` as root in the distro; the C: drive (DrvFs) is 0777 and
every access is the owner's. The stand-ins model both (tests/fleet/standins/bin: init, binfmt,
wsl-interop-server; harness.drvfs_defaults). First the model is shown to hold for a plain
account; then each less-trusted unit's own sandbox, read from its unit file, runs the attacks and
every one must fail. `python -m tests.fleet.test_wsl_boundary baseline` runs the same attacks in
the same sandboxes without the lines `core.units.no_windows` adds (the units before them) and
prints what got through.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from freetoken_infra.core.settings import Settings
from operations import model
from tests.fleet import harness
from tests.fleet.client import PYINFRA, ROOT, deploy

pytestmark = pytest.mark.fleet
HOST = "ws1"
OWNER = "dev"  # ws1's owner (tests/fleet/profiles.py)
PWNED = f"/mnt/c/Users/{OWNER}/pwned"

# Each attack prints one line `NAME: what it got`.
ATTACKS = (
    "W=/mnt/c/Windows/System32\n"
    'echo "cmd: $($W/cmd.exe /c whoami 2>&1 | tr -d "\\r" | tr "\\n" " ")"\n'
    'echo "root: $($W/wsl.exe -u root -e id -u 2>&1 | tr "\\n" " ")"\n'
    # A Windows program of its own: no path to the drives needed, only the binfmt handler.
    'd=$(mktemp -d); printf "#!/.sim/binfmt/handler\\0 x\\n" > "$d/cmd.exe"; chmod +x "$d/cmd.exe"\n'
    'echo "own: $("$d/cmd.exe" /c whoami 2>&1 | tr -d "\\r" | tr "\\n" " ")"\n'
    f'echo "read: $(head -c 200 /mnt/c/Users/{OWNER}/.wslconfig 2>&1 | tr "\\n" " ")"\n'
    f'echo "write: $( (echo x > {PWNED}) 2>&1 && echo wrote)"\n'
    r"""echo "socket: $(python3 -c 'import socket; s = socket.socket(socket.AF_UNIX); s.connect("/run/WSL/1_interop"); print("connected")' 2>&1 | tail -n 1)"
"""
)
GOT_THROUGH = {
    "cmd": lambda v: f"{HOST}\\{OWNER}" in v,
    "root": lambda v: v.strip() == "0",
    "own": lambda v: f"{HOST}\\{OWNER}" in v,
    "read": lambda v: "[wsl2]" in v,
    "write": lambda v: "wrote" in v,
    "socket": lambda v: "connected" in v,
}
# What systemd-run takes of a unit's [Service] section: who it runs as and its sandbox.
SANDBOX = {
    "User",
    "Group",
    "UMask",
    "NoNewPrivileges",
    "ProtectSystem",
    "ProtectHome",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "ProtectProc",
    "ProcSubset",
    "PrivateTmp",
    "DevicePolicy",
    "DeviceAllow",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectControlGroups",
    "RestrictSUIDSGID",
    "LockPersonality",
    "RestrictAddressFamilies",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "NoExecPaths",
    "CapabilityBoundingSet",
}
NO_WINDOWS = {"RestrictAddressFamilies", "InaccessiblePaths", "TemporaryFileSystem"}


def sandbox(unit_text: str, user: str | None = None, baseline: bool = False) -> list[str]:
    """``-p KEY=VALUE`` for each sandbox setting of the unit's [Service] section."""
    section, props = "", []
    for line in unit_text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            if key in SANDBOX and not (baseline and key in NO_WINDOWS):
                if not (user and key in ("User", "Group")):
                    props.append(f"{key}={value}")
    if user:  # its primary group goes with it
        props.append(f"User={user}")
    return props


def unit_texts(fleet) -> dict[str, tuple[str, str | None]]:
    """The engine's and the download's units as the host has them; the LAN cache's as the deploy
    writes it on its host (its workers run as the engine's user: nginx's master is root)."""
    texts = {}
    for name, unit in (("engine", "freetoken.service"), ("download", "freetoken-model-fetch.service")):
        run = fleet.run(HOST, f"systemctl cat {unit}", check=True)
        texts[name] = (run.stdout, None)
    texts["lan cache workers"] = (model.cache_unit(Settings(), "127.0.0.1"), Settings().cache_user)
    return texts


def attack(fleet, unit_text: str, user: str | None, baseline: bool = False) -> dict[str, str]:
    made = None
    if user and fleet.run(HOST, f"id -u {user}").returncode != 0:  # the cache's account, on a non-cache host
        fleet.run(HOST, f"useradd --system --no-create-home --shell /usr/sbin/nologin {user}", check=True)
        made = user
    try:
        return _attack(fleet, unit_text, user, baseline)
    finally:
        if made:
            fleet.run(HOST, f"userdel {made}", check=True)


def _attack(fleet, unit_text: str, user: str | None, baseline: bool = False) -> dict[str, str]:
    props = " ".join(f"-p {shlex.quote(p)}" for p in sandbox(unit_text, user, baseline))
    cmd = (
        f"rm -f {PWNED}; systemd-run --quiet --wait --pipe --collect --service-type=exec {props} "
        f"-- /bin/sh -c {shlex.quote(ATTACKS)} </dev/null"
    )
    run = fleet.run(HOST, cmd, timeout=120)
    got = {}
    for line in run.stdout.splitlines():
        name, sep, value = line.partition(": ")
        if sep and name in GOT_THROUGH:
            got[name] = value
    assert set(got) == set(GOT_THROUGH), (run.returncode, run.stdout, run.stderr)
    got["pwned on the drive"] = "yes" if fleet.run(HOST, f"test -e {PWNED}").returncode == 0 else "no"
    fleet.run(HOST, f"rm -f {PWNED}")
    return got


@pytest.fixture(scope="module")
def converged(sim_fleet):
    fleet = sim_fleet
    fleet.interop(HOST, "ok")
    if fleet.run(HOST, "systemctl cat freetoken.service >/dev/null 2>&1").returncode != 0:
        run = deploy("--limit", HOST)
        assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return fleet


def test_on_wsl_every_account_reaches_windows_root_and_the_owners_files(converged):
    """The model holds: a plain account (nobody) runs Windows programs as the owner, gets root
    through wsl.exe, and writes the owner's profile."""
    got = attack(converged, "[Service]\n", "nobody")
    through = {name for name, check in GOT_THROUGH.items() if check(got[name])}
    assert through == set(GOT_THROUGH), got
    assert got["pwned on the drive"] == "yes"


@pytest.mark.parametrize("unit", ["engine", "download", "lan cache workers"])
def test_a_less_trusted_unit_reaches_neither_windows_nor_root_nor_the_drives(converged, unit):
    text, user = unit_texts(converged)[unit]
    got = attack(converged, text, user)
    through = {name for name, check in GOT_THROUGH.items() if check(got[name])}
    assert through == set(), got
    assert got["pwned on the drive"] == "no", got
    # Refused for the reasons the unit gives, not by chance: the interop client's vsock is denied.
    assert "socket failed 97" in got["own"], got


def whoami(fleet) -> str:
    run = fleet.run(HOST, "/mnt/c/Windows/System32/cmd.exe /c whoami 2>&1 | tr -d '\\r'; echo rc=$?")
    return run.stdout


def test_the_deploy_keeps_interop_registered_under_systemd(converged):
    """systemd-binfmt empties the table (a WSL that does not keep `status` read-only): the
    deploy's binfmt.d entry puts WSLInterop back. Removed by other means, the next run of the
    deploy registers it again."""
    fleet = converged
    assert ":WSLInterop:M::MZ::/init:FP" in fleet.run(HOST, "cat /etc/binfmt.d/WSLInterop.conf", check=True).stdout
    try:
        fleet.interop(HOST, "unregistered")
        assert f"{HOST}\\{OWNER}" in whoami(fleet)
        fleet.interop(HOST, "removed")
        assert "Exec format error" in whoami(fleet)
        run = deploy("--limit", HOST)
        assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
        assert f"{HOST}\\{OWNER}" in whoami(fleet)
    finally:
        fleet.interop(HOST, "ok")


def owner_status(fleet, want: str, timeout: float = 90) -> str:
    """`freetoken-owner status` once its owner signals line holds ``want`` (polled: the agent
    reads Windows on its own schedule)."""
    deadline = time.monotonic() + timeout
    while True:
        out = fleet.run(HOST, "freetoken-owner status").stdout
        if want in out or time.monotonic() > deadline:
            return out
        time.sleep(2)


@pytest.mark.parametrize(
    "mode, reason",
    [("removed", "Exec format error"), ("dead", "interop socket: connect failed 111"), ("hang", "timed out after")],
)
def test_with_interop_broken_the_agent_says_which_owner_signals_are_off(converged, mode, reason):
    fleet = converged
    try:
        fleet.interop(HOST, mode)
        fleet.run(HOST, "systemctl restart freetoken-agent.service", check=True)  # a fresh look at Windows
        out = owner_status(fleet, f"(interop: {reason}")
        print(out)
        assert f"owner signals: VRAM only (interop: {reason}" in out, out
    finally:
        fleet.interop(HOST, "ok")
    fleet.run(HOST, "systemctl restart freetoken-agent.service", check=True)
    out = owner_status(fleet, "owner signals: VRAM, reboot")
    assert "interop:" not in out, out


def doctor_text(*extra: str) -> str:
    run = subprocess.run(
        [PYINFRA, "-y", "--limit", HOST, *extra, "inventories/sim.py", "deploys/doctor.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
        env={**os.environ, "FREETOKEN_SIM_STATE": str(harness.state_dir())},
    )
    print(run.stdout[-8000:], run.stderr[-8000:], sep="\n")
    return " ".join((run.stdout + run.stderr).split())


@pytest.mark.parametrize(
    "mode, reason, fix",
    [
        ("removed", "Exec format error", "/etc/binfmt.d/WSLInterop.conf"),
        ("taken", "run-detectors: no interpreter", "update-binfmts --disable"),
    ],
)
def test_the_doctor_checks_interop_as_a_service_sees_it_and_names_the_fix(converged, mode, reason, fix):
    fleet = converged
    assert re.search(r"interop pass a Windows program starts from a systemd service", doctor_text())
    try:
        fleet.interop(HOST, mode)
        out = doctor_text()
    finally:
        fleet.interop(HOST, "ok")
    assert f"interop WARN as a service: {reason}" in out, out[-3000:]
    assert f"owner signals: VRAM only (interop: {reason})" in out
    assert fix in out


def baseline() -> int:
    """The same attacks in each unit's sandbox without no_windows's lines: what got through."""
    fleet = harness.Fleet()
    for unit, (text, user) in unit_texts(fleet).items():
        got = attack(fleet, text, user, baseline=True)
        through = sorted(name for name, check in GOT_THROUGH.items() if check(got[name]))
        print(f"{unit}: got through: {', '.join(through) or 'nothing'}; {got}")
    return 0


if __name__ == "__main__":
    sys.exit(baseline() if sys.argv[1:] == ["baseline"] else 2)
