"""The verify suite's plumbing (tests/verify): the pyinfra inventory -> testinfra bridge, its host
selection, the parsers of its probes, and how `pytest` treats tests/verify without an inventory.
The checks themselves run on the simulated fleet (tests/fleet/test_verify.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from freetoken_infra.core.settings import SettingsError, build_settings
from tests.verify import bridge
from tests.verify.probes import apt_policy, parse_ss, present_packages

ROOT = Path(__file__).resolve().parents[2]

SSH_INVENTORY = """
    rtx5090_32gb = [
        ("box1", {"ssh_hostname": "10.0.0.5", "ssh_user": "deploy", "ssh_port": 2222,
                  "ssh_key": "~/.ssh/id_box", "ssh_known_hosts_file": "/etc/ft/known_hosts",
                  "ssh_strict_host_key_checking": "yes"}),
        "box2.lan",
    ]
    lab = (["box2.lan"], {"listen_port": 9000})
"""


def _inventory(tmp_path, text: str) -> Path:
    path = tmp_path / "inventory.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory) -> list[dict]:
    """The SSH inventory's hosts as pyinfra reads them (one child python per module)."""
    return bridge.load_inventory(_inventory(tmp_path_factory.mktemp("inv"), SSH_INVENTORY))


def test_home_inventory_is_local_with_the_deploys_settings():
    (target,) = bridge.targets(ROOT / "inventories" / "home.py")
    assert target.name == "@local"
    assert (target.hostspec, target.backend_kwargs) == ("local://", {})
    # No hardware class unless the owner opts into one: the plan follows the
    # GPU, and group_data/all.py applies, as in the deploy.
    assert "home" in target.groups and not {"rtx5060ti_16gb", "rtx5090_32gb"} & set(target.groups)
    assert target.settings.hardware_profile == "auto"
    assert target.settings.decode_floor_tps is None
    assert target.settings.wslconfig_values()["vmIdleTimeout"] == "0"


def test_local_target_runs_commands_with_sudo_only_when_not_root():
    (target,) = bridge.targets(ROOT / "inventories" / "home.py")
    host = target.testinfra_host()
    assert host.backend.NAME == "local"
    assert host.backend.sudo is (os.geteuid() != 0)
    assert host.run("echo verify").stdout.strip() == "verify"


def test_ssh_hosts_carry_user_port_key_and_known_hosts(ssh_hosts):
    by_name = {t.name: t for t in map(bridge.target_for, ssh_hosts)}
    box1, box2 = by_name["box1"], by_name["box2.lan"]

    assert box1.hostspec == "ssh://deploy@10.0.0.5:2222"
    assert box1.backend_kwargs["ssh_identity_file"] == os.path.expanduser("~/.ssh/id_box")
    extra = box1.backend_kwargs["ssh_extra_args"]
    assert "-o UserKnownHostsFile=/etc/ft/known_hosts" in extra
    assert "-o StrictHostKeyChecking=yes" in extra
    assert "-o BatchMode=yes" in extra

    assert box2.hostspec == "ssh://box2.lan"
    assert "ssh_identity_file" not in box2.backend_kwargs
    # pyinfra's own default applies when the inventory says nothing.
    assert "-o StrictHostKeyChecking=accept-new" in box2.backend_kwargs["ssh_extra_args"]
    assert "UserKnownHostsFile" not in box2.backend_kwargs["ssh_extra_args"]

    # Settings: group_data/rtx5090_32gb.py, then the inventory's group data, as in the deploy.
    assert box1.settings.decode_floor_tps == 40.0
    assert (box1.settings.listen_port, box2.settings.listen_port) == (8000, 9000)
    assert box2.settings == build_settings(
        "box2.lan", {**_group_file("all"), **_group_file("rtx5090_32gb"), "listen_port": 9000}
    )


def _group_file(name: str) -> dict:
    values: dict = {}
    exec((ROOT / "group_data" / f"{name}.py").read_text(), {}, values)
    return {k: v for k, v in values.items() if not k.startswith("_")}


def test_testinfra_ssh_backend_gets_the_options(ssh_hosts):
    import testinfra

    box1 = bridge.target_for(ssh_hosts[0])
    backend = testinfra.get_host(box1.hostspec, sudo=True, **box1.backend_kwargs).backend
    cmd, args = backend._build_ssh_command(backend.get_command("id -u"))
    line = " ".join(cmd) % tuple(args)
    assert "-o User=deploy" in line and "-o Port=2222" in line
    assert "-o UserKnownHostsFile=/etc/ft/known_hosts" in line and "ControlPath=" in line
    assert args[-2:] == ["10.0.0.5", "sudo /bin/sh -c 'id -u'"]


@pytest.mark.parametrize(
    "limit, exclude, names",
    [
        ([], [], ["box1", "box2.lan"]),
        (["lab"], [], ["box2.lan"]),  # a group name
        (["box*"], ["lab"], ["box1"]),  # a glob, minus a group
        (["box1,box2.lan"], [], ["box1", "box2.lan"]),  # comma-separated
        (["rtx5090_32gb"], ["box2.lan"], ["box1"]),
    ],
)
def test_limit_and_exclude_select_like_pyinfra(ssh_hosts, limit, exclude, names):
    assert [h["name"] for h in bridge.select(ssh_hosts, limit, exclude)] == names


def test_a_pattern_that_matches_nothing_is_an_error(ssh_hosts):
    with pytest.raises(bridge.BridgeError, match=r"--limit ws9: no such host or group \(hosts: box1, box2.lan\)"):
        bridge.select(ssh_hosts, ["ws9"])


def test_unsupported_connector_and_bad_settings_are_refused(tmp_path):
    with pytest.raises(bridge.BridgeError, match=r"host @docker/ctr: connector DockerConnector is not supported"):
        bridge.targets(_inventory(tmp_path, 'boxes = ["@docker/ctr"]\n'))
    with pytest.raises(SettingsError, match=r"host box: unknown setting 'lisen_port'"):
        bridge.targets(_inventory(tmp_path, 'boxes = [("box", {"lisen_port": 1})]\n'))
    with pytest.raises(bridge.BridgeError, match=r"inventory .*: boom"):
        bridge.targets(_inventory(tmp_path, 'raise SystemExit("boom")\n'))


def test_loading_an_inventory_leaves_this_interpreter_unpatched(tmp_path):
    # pyinfra_cli monkey-patches the interpreter for gevent on import: it runs in a child.
    bridge.targets(ROOT / "inventories" / "home.py")
    assert "pyinfra_cli" not in sys.modules
    import socket

    assert "gevent" not in type(socket.socket).__module__ and "gevent" not in socket.socket.__module__


# --------------------------------------------------------------------------- probe parsers

# `apt-cache policy` on a converged simulated host (apt 2.6): two pinned driver packages, one
# installed toolkit package, one driver package installed by hand behind the pin's back.
APT_POLICY = """\
cuda-drivers:
  Installed: (none)
  Candidate: (none)
  Version table:
     580.95.05-1 -1
        500 http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64  Packages
cuda-13-0:
  Installed: (none)
  Candidate: (none)
  Version table:
     13.0.2-1 -1
        500 http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64  Packages
cuda-nvcc-13-0:
  Installed: 13.0.88-1
  Candidate: 13.0.88-1
  Version table:
 *** 13.0.88-1 500
        500 http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64  Packages
        100 /var/lib/dpkg/status
"""


def test_apt_policy_reads_each_versions_own_priority():
    table = apt_policy(APT_POLICY)
    assert table["cuda-drivers"] == [
        ("580.95.05-1", -1, False, ["http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64  Packages"])
    ]
    assert table["cuda-13-0"][0][:3] == ("13.0.2-1", -1, False)
    version, priority, installed, origins = table["cuda-nvcc-13-0"][0]
    assert (version, priority, installed) == ("13.0.88-1", 500, True)
    assert origins[-1] == "/var/lib/dpkg/status"


def test_present_packages_leave_out_removed_ones():
    text = "ii  cuda-nvcc-13-0\nrc  cuda-drivers\nun  nvidia-driver-580\niU  cuda-13-0\n"
    assert present_packages(text) == ["cuda-nvcc-13-0", "cuda-13-0"]


def test_parse_ss_listeners_with_their_processes():
    text = (
        'LISTEN 0      5      127.0.0.1:8000 0.0.0.0:* users:(("python",pid=2251,fd=3))\n'
        'LISTEN 0      16     127.0.0.1:8001 0.0.0.0:* users:(("python",pid=2251,fd=4))\n'
        'LISTEN 0      128      0.0.0.0:22   0.0.0.0:* users:(("sshd",pid=33,fd=3))    \n'
        'LISTEN 0      128         [::]:22      [::]:* users:(("sshd",pid=33,fd=4),("sshd",pid=34,fd=4))\n'
        "LISTEN 0      4096           *:9100       *:*\n"
    )
    got = [(s.address, s.port, s.pids, s.loopback) for s in parse_ss(text)]
    assert got == [
        ("127.0.0.1", 8000, (2251,), True),
        ("127.0.0.1", 8001, (2251,), True),
        ("0.0.0.0", 22, (33,), False),
        ("::", 22, (33, 34), False),
        ("0.0.0.0", 9100, (), False),
    ]


# --------------------------------------------------------------------------- collection


def _pytest(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_projects_pytest_run_leaves_tests_verify_out():
    run = _pytest("--collect-only", "-q")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tests/unit/test_verify_bridge.py::" in run.stdout
    assert "tests/verify" not in run.stdout + run.stderr


def test_tests_verify_without_an_inventory_is_a_usage_error():
    run = _pytest("tests/verify")
    assert run.returncode == 4
    assert "add --inventory FILE" in run.stderr


def test_tests_verify_collects_every_check_once_per_host():
    run = _pytest("tests/verify", "--inventory", "inventories/home.py", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ids = [line for line in run.stdout.splitlines() if line.startswith("tests/verify/")]
    assert len(ids) >= 20 and all(i.endswith("[@local]") for i in ids)
    assert "tests/verify/test_host.py::test_decode_tokens_per_s_at_or_above_the_floor[@local]" in ids


def test_a_hardware_class_is_the_owners_opt_in(tmp_path):
    """Moving @local into a class's group (as home.py's docstring says) brings that class's settings."""
    inventory = tmp_path / "home.py"
    inventory.write_text('rtx5060ti_16gb = ["@local"]\n')
    shutil.copytree(ROOT / "group_data", tmp_path / "group_data")
    (target,) = bridge.targets(inventory)
    assert target.settings.hardware_profile == "rtx5060ti_16gb"
    assert target.settings.decode_floor_tps == 18.0
