"""Trust boundaries on a real host: what the engine's service user (or the download's) can write
never aims what root does, the engine cannot write the model it serves, and a missing key file
stops the engine instead of opening it.

The attacker is the service user itself (``freetoken``, what a compromised engine runs as), or
the download's user (``freetoken-fetch``, what a hostile hub answer could run as): they plant
links in the folders they own, named as the files root used to write there, aimed at files of
their choosing in /etc; on a host the old layout left, the engine's user watches /proc for root's
fact reads and swaps the model's folder for a link right after them. Then the deploy runs. Nothing
may appear at, or change on, the links' targets. ws1 only; the tests in this module run in order.
"""

from __future__ import annotations

import json
import shlex

import pytest

from freetoken_infra.core.layout import DEPLOY_STATE_DIR, HostLayout
from freetoken_infra.core.settings import Settings
from tests.fleet.client import deploy, grand_total, health, hub, wait_healthy
from tests.fleet.test_model import weight_bytes

pytestmark = pytest.mark.fleet
HOST = "ws1"
SETTINGS = Settings()
LAYOUT = HostLayout.of(SETTINGS)
KEY_FILE = LAYOUT.api_key_file
ENGINE_USER, FETCH_USER = SETTINGS.service_user, SETTINGS.fetch_user
MODEL_DIR = LAYOUT.model_dir
MODEL_PARENT = MODEL_DIR.rsplit("/", 1)[0]
# Where the download's user aims its links: files only root may create.
PLANTS = {LAYOUT.reverify_request_file: "/etc/ft-planted-reverify"}
OLD_GATE_RECORD = f"{LAYOUT.state_dir}/health-gate.json"  # where the engine planted one before


def as_user(fleet, command: str, user: str = ENGINE_USER, check: bool = True):
    return fleet.run(
        HOST, f"setpriv --reuid={user} --regid={user} --clear-groups -- sh -c {shlex.quote(command)}", check=check
    )


def stat(fleet, path: str) -> list[str]:
    return fleet.run(HOST, f"stat -c '%U %G %a' -- {shlex.quote(path)}", check=True).stdout.split()


def out(run) -> str:
    return run.stdout + run.stderr


@pytest.fixture(scope="module")
def converged(sim_fleet):
    run = deploy("--limit", HOST)
    assert run.returncode == 0, (run.stdout + run.stderr)[-5000:]
    wait_healthy(sim_fleet, HOST)
    return run


def test_roots_state_directory_is_roots_and_outside_the_engines_reach(sim_fleet, converged):
    stat = sim_fleet.run(HOST, f"stat -c '%U %G %a' {DEPLOY_STATE_DIR}", check=True).stdout.split()
    assert stat == ["root", "root", "755"]
    writable = sim_fleet.run(HOST, "systemctl show -p ReadWritePaths --value freetoken.service", check=True).stdout
    assert writable.split() == [LAYOUT.cache_dir]
    gate = json.loads(sim_fleet.run(HOST, f"cat {LAYOUT.last_gate_file}", check=True).stdout)
    assert gate["ok"] is True
    # The guard (root) samples into root's folder only.
    guard_unit = sim_fleet.run(HOST, "systemctl cat freetoken-guard.service", check=True).stdout
    assert f"ReadWritePaths=-{DEPLOY_STATE_DIR}" in guard_unit
    assert f"ReadWritePaths=-{LAYOUT.state_dir}\n" not in guard_unit
    sim_fleet.run(HOST, f"rm -f {LAYOUT.guard_textfile} && systemctl start freetoken-guard.service", check=True)
    prom = sim_fleet.run(HOST, f"cat {LAYOUT.guard_textfile}", check=True).stdout
    assert "freetoken_guard_swap_used_bytes" in prom


def test_the_engine_reads_the_model_it_cannot_write_and_a_second_converge_changes_nothing(sim_fleet, converged):
    assert stat(sim_fleet, LAYOUT.state_dir) == ["root", "root", "755"]
    assert stat(sim_fleet, MODEL_PARENT) == ["root", "root", "755"]
    assert stat(sim_fleet, MODEL_DIR) == [FETCH_USER, FETCH_USER, "755"]
    assert stat(sim_fleet, LAYOUT.fetch_status_dir) == [FETCH_USER, FETCH_USER, "755"]
    assert stat(sim_fleet, LAYOUT.cache_dir) == [ENGINE_USER, ENGINE_USER, "755"]
    foreign = sim_fleet.run(HOST, f"find -P {MODEL_PARENT} {LAYOUT.fetch_status_dir} -user {ENGINE_USER}", check=True)
    assert foreign.stdout == "", foreign.stdout
    # The engine's user reads the model and can change nothing in it or on the way to it.
    as_user(sim_fleet, f"cat {MODEL_DIR}/config.json >/dev/null")
    for attempt in (
        f"touch {MODEL_DIR}/x",
        f"mv {MODEL_DIR} {MODEL_DIR}.moved",
        f"ln -s /etc {MODEL_PARENT}/planted",
        f"ln -s /etc {OLD_GATE_RECORD}",
        f"touch {LAYOUT.reverify_request_file}",
        f"chmod 700 {MODEL_DIR}",
    ):
        denied = as_user(sim_fleet, attempt, check=False)
        assert denied.returncode != 0, f"the engine's user could: {attempt}"
    unit = sim_fleet.run(HOST, "systemctl show -p ProtectProc --value freetoken.service", check=True).stdout
    assert unit.strip() == "invisible"
    again = deploy("--limit", HOST)
    assert again.returncode == 0, out(again)[-5000:]
    assert grand_total(again)[1:3] == ("-", "-"), out(again)[-5000:]


def test_links_planted_by_the_download_user_aim_nothing_root_does(sim_fleet, converged):
    for link, target in PLANTS.items():
        sim_fleet.run(HOST, f"rm -f {target}")
        as_user(sim_fleet, f"rm -f {link} && ln -s {target} {link}", user=FETCH_USER)
    # A re-verify: the request file is (re)made, the fetcher re-hashes, the engine restarts and
    # the health gate runs and records its result.
    run = deploy("--limit", HOST, "--data", "model_reverify=true")
    out = run.stdout + run.stderr
    planted = sim_fleet.run(HOST, "ls -l " + " ".join(PLANTS.values()) + " 2>/dev/null; true").stdout
    assert planted.strip() == "", f"root wrote where the service user aimed it:\n{planted}"
    assert run.returncode == 0, out[-5000:]
    assert "== health gate ==" in out and grand_total(run)[1] != "-"
    # The request link was replaced by the service user's own file (then used and removed by
    # the fetcher), never followed.
    left = sim_fleet.run(HOST, f"test -L {shlex.quote(LAYOUT.reverify_request_file)}")
    assert left.returncode != 0
    gate = json.loads(sim_fleet.run(HOST, f"cat {LAYOUT.last_gate_file}", check=True).stdout)
    assert gate["ok"] is True


def test_a_deleted_key_file_stops_the_engine_instead_of_opening_it(sim_fleet, converged):
    backup = "/root/api-key.env.kept-by-test"
    sim_fleet.run(HOST, f"cp -p {KEY_FILE} {backup} && rm -f {KEY_FILE}", check=True)
    try:
        sim_fleet.run(HOST, "systemctl restart freetoken.service")
        state = sim_fleet.run(HOST, "systemctl is-active freetoken.service").stdout.strip()
        assert state != "active", "the engine started without its key file"
        log = sim_fleet.run(HOST, "journalctl -u freetoken.service -n 20 --no-pager -o cat").stdout
        assert "Failed to load environment files" in log, log
        assert health(sim_fleet, HOST)["status"] == "down", "something serves the API without the key"
    finally:
        sim_fleet.run(
            HOST,
            f"mv {backup} {KEY_FILE} && systemctl reset-failed freetoken.service; systemctl restart freetoken.service",
            check=True,
        )
    wait_healthy(sim_fleet, HOST)


# ------------------------------------------------------------ root's folders, never through a link

OPT_MODEL = f"/opt/models/{SETTINGS.served_model_name}"


def test_a_model_dir_under_a_system_folder_gets_only_its_leaf(sim_fleet, converged):
    """The old deploy chowned model_dir's parent to the engine's user (/opt/models here,
    /opt or /var/lib for a shallower setting). The folders above the leaf keep their owner."""
    sim_fleet.run(HOST, "rm -rf /opt/models && mkdir -p /opt/models && chown daemon:daemon /opt/models", check=True)
    opt_before = stat(sim_fleet, "/opt")
    try:
        run = deploy("--limit", HOST, "--data", f"model_dir={OPT_MODEL}")
        assert run.returncode == 0, out(run)[-5000:]
        assert stat(sim_fleet, "/opt") == opt_before == ["root", "root", "755"]
        assert stat(sim_fleet, "/opt/models") == ["daemon", "daemon", "755"]
        assert stat(sim_fleet, OPT_MODEL) == [FETCH_USER, FETCH_USER, "755"]
        assert as_user(sim_fleet, f"touch {OPT_MODEL}/x", check=False).returncode != 0
        wait_healthy(sim_fleet, HOST)
    finally:
        back = deploy("--limit", HOST)
        sim_fleet.run(HOST, "rm -rf /opt/models")
    assert back.returncode == 0, out(back)[-5000:]


# The engine's user, on a host the old layout left: it keeps the model's parent at 0700 (so root's
# first fact read queues a chmod), watches /proc for root's process that names the folder (the
# fact batch), and the moment that process is gone swaps the folder for a link to a root folder.
# The old deploy then ran `chmod 755` and `chown freetoken` on the link, i.e. on the target.
ATTACKER = r"""
import os, sys, time
folder, target = bytes.fromhex(sys.argv[1]).decode(), sys.argv[2]  # hex: its own launch names no path
needle, me, seen = folder.encode(), str(os.getpid()), set()
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    now = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            if os.stat("/proc/" + pid).st_uid != 0:
                continue
            with open("/proc/" + pid + "/cmdline", "rb") as f:
                if needle in f.read():
                    now.add(pid)
        except OSError:
            pass
    if seen and not (seen & now):
        try:
            os.rename(folder, folder + ".real")
            os.symlink(target, folder)
            print("swapped", flush=True)
        except OSError as exc:
            print("swap refused:", exc, flush=True)
        break
    seen |= now
    time.sleep(0.002)
"""
TARGET_DIR = "/etc/ft-target"


def test_an_old_layout_host_migrates_without_a_download_and_a_swap_at_the_worst_moment_aims_nothing(
    sim_fleet, converged
):
    # The host as the old deploy left it: everything under state_dir the engine's user's (the
    # model included), no download user yet.
    sim_fleet.run(
        HOST,
        f"systemctl stop freetoken-model-fetch.service; userdel {FETCH_USER}; "
        f"chown -R {ENGINE_USER}:{ENGINE_USER} {LAYOUT.state_dir} && "
        f"rm -rf {TARGET_DIR} && mkdir -m 700 {TARGET_DIR} && echo secret > {TARGET_DIR}/f && chmod 600 {TARGET_DIR}/f",
        check=True,
    )
    as_user(sim_fleet, f"chmod 700 {MODEL_PARENT}")
    before = stat(sim_fleet, TARGET_DIR)
    sim_fleet.run(
        HOST,
        f"systemd-run --unit=ft-attacker --uid={ENGINE_USER} --gid={ENGINE_USER} -p Type=exec "
        f"/usr/bin/python3 -c {shlex.quote(ATTACKER)} {MODEL_PARENT.encode().hex()} {TARGET_DIR}",
        check=True,
    )
    hub(sim_fleet, "/_standin/reset", {})
    try:
        run = deploy("--limit", HOST)
    finally:
        sim_fleet.run(HOST, "systemctl stop ft-attacker.service; systemctl reset-failed ft-attacker.service")
    attacker = sim_fleet.run(HOST, "journalctl -u ft-attacker --no-pager -o cat | tail -3").stdout
    print(f"the attacker: {attacker.strip()!r}; the run exited {run.returncode}")
    assert "swapped" in attacker or "swap refused" in attacker, f"the attacker never saw root's fact read: {attacker}"
    assert stat(sim_fleet, TARGET_DIR) == before == ["root", "root", "700"], (
        f"root re-owned the link's target\n{attacker}"
    )
    assert stat(sim_fleet, f"{TARGET_DIR}/f") == ["root", "root", "600"]
    if run.returncode != 0:
        # The swap landed before root took state_dir: the run refuses the link, naming it.
        assert "swapped" in attacker, out(run)[-5000:]
        assert f"{MODEL_PARENT} is a symbolic link; root does not follow or replace it" in out(run), out(run)[-5000:]
        sim_fleet.run(HOST, f"rm {MODEL_PARENT} && mv {MODEL_PARENT}.real {MODEL_PARENT}", check=True)
        run = deploy("--limit", HOST)
    assert run.returncode == 0, out(run)[-5000:]
    # Migrated in place: the old model re-owned, not fetched again; the engine cannot write it.
    assert weight_bytes(hub(sim_fleet, "/_standin/stats")) == 0
    assert stat(sim_fleet, LAYOUT.state_dir) == stat(sim_fleet, MODEL_PARENT) == ["root", "root", "755"]
    assert stat(sim_fleet, MODEL_DIR) == [FETCH_USER, FETCH_USER, "755"]
    left = sim_fleet.run(HOST, f"find -P {MODEL_DIR} {LAYOUT.fetch_status_dir} -user {ENGINE_USER}", check=True)
    assert left.stdout == "", left.stdout
    assert as_user(sim_fleet, f"touch {MODEL_DIR}/x", check=False).returncode != 0
    wait_healthy(sim_fleet, HOST)
    sim_fleet.run(HOST, f"rm -rf {TARGET_DIR}")


PLANTED_DEB = f"{LAYOUT.cache_dir}/cuda-keyring.deb"  # where the old deploy took it from
PLANTED_MARK = "/etc/ft-planted-keyring"


def test_a_keyring_package_planted_in_the_engines_cache_is_never_installed(sim_fleet, converged):
    """The old step installed whatever file was at PLANTED_DEB (skipping the download)."""
    # (the old deploy left its own download there, root's, in the engine's folder: the engine's
    # user cannot write that file, but may remove it and put its own in its place)
    build = (
        f"rm -f {PLANTED_DEB} && d=$(mktemp -d) && mkdir -p $d/pkg/DEBIAN $d/pkg/etc && echo planted > $d/pkg{PLANTED_MARK} && "
        "printf 'Package: cuda-keyring\\nVersion: 9.9-1\\nArchitecture: all\\nMaintainer: x <x@x>\\n"
        "Description: planted\\n' > $d/pkg/DEBIAN/control && "
        f"dpkg-deb --root-owner-group --build $d/pkg {PLANTED_DEB} >/dev/null && rm -rf $d"
    )
    as_user(sim_fleet, build)
    sim_fleet.run(HOST, f"rm -f {PLANTED_MARK}; dpkg --purge cuda-keyring", check=True)
    run = deploy("--limit", HOST)
    assert run.returncode == 0, out(run)[-5000:]
    assert sim_fleet.run(HOST, f"test -e {PLANTED_MARK}").returncode != 0, "root installed the planted package"
    version = sim_fleet.run(HOST, "dpkg-query -W -f '${Version}' cuda-keyring", check=True).stdout
    assert version != "9.9-1"
    sim_fleet.run(HOST, f"rm -f {PLANTED_DEB}")
