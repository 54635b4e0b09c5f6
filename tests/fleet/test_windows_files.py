"""The Windows side as users really write it, on one simulated host over real SSH.

Files WSL accepts but our earlier INI reading did not (see freetoken_infra/core/wsl_ini.py):
  1. /etc/wsl.conf with keys before the first section (ignored by WSL): the deploy converges,
     keeps every line and adds `[boot] systemd=true` where WSL reads it;
  2. .wslconfig with inline comments and quoted values already equal to the settings: the deploy
     writes nothing to it and prints no restart message;
  3. `[automount] root = /` (drives at /c, no /mnt/c): the profile is found through cmd.exe +
     wslpath under that root and .wslconfig is managed there.
And one attack: a link planted as .wslconfig by an unprivileged account is
neither read nor written through.
The host's own files (and /mnt/c) are put back afterwards. Tests run in order.
"""

from __future__ import annotations

import base64
import re
import subprocess

import pytest

from freetoken_infra.core import wsl_ini
from tests.fleet.client import deploy, grand_total

pytestmark = pytest.mark.fleet
HOST = "ws1"
RESTART = "restart required: run `wsl.exe --shutdown` from Windows"


def read(fleet, path: str) -> bytes:
    return base64.b64decode(fleet.run(HOST, f"base64 -w0 {path}", check=True).stdout)


def read_if_there(fleet, path: str) -> bytes | None:
    return read(fleet, path) if fleet.run(HOST, f"test -e {path}").returncode == 0 else None


def write(fleet, path: str, data: bytes) -> None:
    fleet.run(HOST, f"printf %s {base64.b64encode(data).decode()} | base64 -d > {path}", check=True)


def restart_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if f"[{HOST}] {RESTART}" in line]


def converged_ok(run: subprocess.CompletedProcess) -> None:
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "Traceback" not in out, out[-6000:]


@pytest.fixture(scope="module")
def host_files(sim_fleet):
    user = sim_fleet.hosts[HOST].profile["windows_user"]
    files = {"wslconfig": f"/mnt/c/Users/{user}/.wslconfig", "wslconf": "/etc/wsl.conf", "user": user}
    saved = {path: read_if_there(sim_fleet, path) for path in (files["wslconfig"], files["wslconf"])}
    yield files
    # Put the host back as the other fleet tests expect it: C: at /mnt/c, the original files.
    sim_fleet.run(HOST, "if [ -d /c ] && [ ! -e /mnt/c ]; then mv /c /mnt/c; fi", check=True)
    for path, data in saved.items():
        if data is None:
            sim_fleet.run(HOST, f"rm -f {path}", check=True)
        else:
            write(sim_fleet, path, data)


def test_wsl_conf_with_keys_before_the_first_section_converges_and_keeps_its_lines(sim_fleet, host_files):
    wslconf = host_files["wslconf"]
    # As in microsoft/WSL#10100: the header commented out, so WSL ignores systemd=true.
    users = b"systemd=true\n# [boot]\ngenerateResolvConf = false # mine\n\n[network]\nhostname = ws1\n"
    write(sim_fleet, wslconf, users)
    run = deploy("--limit", HOST)
    converged_ok(run)
    after = read(sim_fleet, wslconf)
    assert after.startswith(users), after
    ini = wsl_ini.parse(after, wsl_ini.WSLCONF)
    assert ini.value("boot", "systemd") == "true" and ini.value("network", "hostname") == "ws1"
    (line,) = restart_lines(run)
    assert "/etc/wsl.conf" in line, line


def test_wslconfig_with_comments_and_quotes_equal_to_the_settings_is_left_alone(sim_fleet, host_files):
    path = host_files["wslconfig"]
    # The values the deploy itself wrote (this host's settings), now written as users write them.
    managed = wsl_ini.parse(read(sim_fleet, path), wsl_ini.WSLCONFIG).sections()["wsl2"]
    body = "".join(
        f'{key} = "{value}"   # {key} as I like it\r\n' for key, value in managed.items() if key != "guiapplications"
    )
    users = ("# my .wslconfig\r\n[wsl2]   # the VM\r\n" + body + "guiApplications=false # no WSLg\r\n").encode()
    write(sim_fleet, path, users)
    run = deploy("--limit", HOST)
    converged_ok(run)
    assert read(sim_fleet, path) == users
    assert restart_lines(run) == [], (run.stdout + run.stderr)[-6000:]
    _, changed, errors, _ = grand_total(run)
    assert (changed, errors) == ("-", "-"), (run.stdout + run.stderr)[-6000:]


def test_automount_root_slash_still_gets_wslconfig_managed(sim_fleet, host_files):
    user = host_files["user"]
    write(sim_fleet, host_files["wslconf"], b"[boot]\nsystemd=true\n\n[automount]\nroot = /   # drives at /c\n")
    sim_fleet.run(HOST, "mv /mnt/c /c", check=True)
    wslconfig = f"/c/Users/{user}/.wslconfig"
    write(sim_fleet, wslconfig, b"# mine\r\n[wsl2]\r\nmemory=3GB\r\n")
    run = deploy("--limit", HOST)
    converged_ok(run)
    assert sim_fleet.run(HOST, "test -e /mnt/c").returncode != 0  # nothing recreated /mnt/c
    text = read(sim_fleet, wslconfig).decode()
    assert text.startswith("# mine\r\n[wsl2]\r\n"), text
    ini = wsl_ini.parse(text.encode(), wsl_ini.WSLCONFIG)
    assert ini.value("wsl2", "memory") != "3GB" and ini.value("wsl2", "vmIdleTimeout") == "0", text
    (line,) = restart_lines(run)
    assert wslconfig in line, line
    assert re.search(r"^memory=\d+GB\r?$", text, re.M), text


def test_a_link_planted_as_wslconfig_by_an_unprivileged_account_is_neither_read_nor_written(sim_fleet, host_files):
    """Below the drive root every Linux account can plant files (DrvFs shows
    them 0777, owned by uid 1000). ``nobody`` links ``.wslconfig`` to /etc/shadow; the deploy
    reads nothing through it, writes nothing through it, prints none of shadow and names it."""
    # The drive may still be at /c (the test above moved it; the fixture puts it back at the end).
    drive = "/c" if sim_fleet.run(HOST, "test -d /c && ! test -e /mnt/c").returncode == 0 else "/mnt/c"
    folder = f"{drive}/Users/{host_files['user']}"
    path = f"{folder}/.wslconfig"
    shadow = read(sim_fleet, "/etc/shadow")
    mode = sim_fleet.run(HOST, f"stat -c %a {folder}", check=True).stdout.strip()
    # Until the simulated C: drive is 0777 and uid 1000's as DrvFs shows it, open the profile
    # folder to every account as DrvFs does (the attacker needs nothing more).
    sim_fleet.run(HOST, f"chmod 0777 {folder} && rm -f {path}", check=True)
    try:
        sim_fleet.run(HOST, f"runuser -u nobody -- ln -s /etc/shadow {path}", check=True)
        run = deploy("--limit", HOST)
        out = run.stdout + run.stderr
        assert "Traceback" not in out, out[-6000:]
        assert read(sim_fleet, "/etc/shadow") == shadow
        target = sim_fleet.run(HOST, f"readlink {path}").stdout.strip()
        if target:
            assert target == "/etc/shadow"
        else:  # replaced by a regular file: none of shadow in it
            assert sim_fleet.run(HOST, f"test -f {path} && ! test -L {path}").returncode == 0
            written = read(sim_fleet, path)
            assert not any(line in written for line in shadow.splitlines() if len(line) > 8)
        secret_lines = [line.decode() for line in shadow.splitlines() if len(line) > 8]
        assert not any(line in out for line in secret_lines), out[-6000:]
        assert base64.b64encode(shadow).decode()[:40] not in out
        # the preflight's table wraps its evidence; the merge's own line says it whole
        assert f"{path} is a symbolic link" in " ".join(out.split()), out[-6000:]
    finally:
        # The link goes before the fixture writes the saved file back (a write through it as root).
        sim_fleet.run(HOST, f"rm -f {path}; chmod {mode} {folder}", check=True)
