"""operations/scripts/enrol.py, the PC owner's one command: what it accepts, what it writes, and
its single-file form. (Run on a simulated host, end to end: tests/fleet/test_enrol.py.)"""

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freetoken_infra.core import wsl_ini

SCRIPT = Path(__file__).resolve().parents[2] / "operations" / "scripts" / "enrol.py"
sys.path.insert(0, str(SCRIPT.parent))
import enrol  # noqa: E402


@pytest.fixture(scope="module")
def keypair(tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "op@controller", "-f", str(key)], check=True)
    return key


def test_a_real_public_key_is_accepted_as_one_line(keypair):
    line = Path(str(keypair) + ".pub").read_text()
    assert enrol.public_key(line) == line.strip()


def test_the_fingerprint_is_ssh_keygens(keypair):
    pub = Path(str(keypair) + ".pub").read_text()
    listed = subprocess.run(
        ["ssh-keygen", "-l", "-f", str(keypair) + ".pub"], capture_output=True, text=True, check=True
    )
    assert listed.stdout.split()[1] == enrol.fingerprint(pub)


@pytest.mark.parametrize(
    "mangle, says",
    [
        (lambda k: k + "\nssh-ed25519 " + k.split()[1], "more than one line"),
        (lambda k: 'command="/bin/sh" ' + k, "not an OpenSSH public key"),
        (lambda k: "ssh-dss " + k.split(" ", 1)[1], "not an OpenSSH public key"),
        (lambda k: k.split()[0] + " !!!notbase64 x", "does not decode"),
        (lambda k: "ssh-rsa " + k.split(" ", 1)[1], "not a ssh-rsa key"),
        (lambda k: " ".join(k.split()[:2]) + " $(reboot)", "comment"),
        (lambda k: k.split()[0], "not an OpenSSH public key"),
    ],
)
def test_anything_but_one_public_key_is_refused_naming_the_field(keypair, mangle, says):
    line = Path(str(keypair) + ".pub").read_text().strip()
    with pytest.raises(enrol.EnrolError, match=says) as exc:
        enrol.public_key(mangle(line))
    assert str(exc.value).startswith("--key")


def test_a_bad_name_or_user_is_refused_before_anything(keypair):
    key = Path(str(keypair) + ".pub").read_text()
    args = enrol.argparse.Namespace(key=key, key_file=None, name="ws 7;rm", user=None, port=2222)
    with pytest.raises(enrol.EnrolError, match=r"^--name"):
        enrol.inputs(args, {})
    args = enrol.argparse.Namespace(key=key, key_file=None, name="ws7", user="nobody-here-x", port=2222)
    with pytest.raises(enrol.EnrolError, match=r"^--user nobody-here-x: no such user"):
        enrol.inputs(args, {})
    args = enrol.argparse.Namespace(key=key, key_file=None, name="ws7", user="root", port=22)
    with pytest.raises(enrol.EnrolError, match=r"^--port 22"):
        enrol.inputs(args, {})
    ok = enrol.inputs(
        enrol.argparse.Namespace(key=key, key_file=None, name="ws7", user=None, port=2222), {"SUDO_USER": "root"}
    )
    assert (ok.name, ok.user, ok.port) == ("ws7", "root", 2222)


def test_sshd_takes_public_keys_only():
    text = enrol.sshd_dropin(2222, "deploy")
    assert "Port 2222\n" in text and "PasswordAuthentication no\n" in text
    assert "AuthenticationMethods publickey\n" in text and "KbdInteractiveAuthentication no\n" in text
    assert "PermitRootLogin no\n" in text
    assert "PermitRootLogin prohibit-password\n" in enrol.sshd_dropin(2222, "root")


def test_one_elevated_powershell_carries_the_firewall_rule_and_the_task():
    script = enrol.powershell_script(2222, "Ubuntu-24.04", rule=True, task=True)
    argv = enrol.elevated_command(script)
    assert argv[:4] == ["powershell.exe", "-NoProfile", "-NonInteractive", "-Command"]
    assert argv[4].count("-Verb RunAs") == 1
    encoded = argv[4].rsplit("'", 2)[1]
    decoded = base64.b64decode(encoded).decode("utf-16-le")
    assert decoded == script
    assert "New-NetFirewallHyperVRule -Name 'FreeToken-WSL-sshd'" in decoded and "-LocalPorts 2222" in decoded
    assert enrol.WSL_VM_CREATOR_ID in decoded
    assert (
        "schtasks.exe /Create /F /SC ONLOGON /TN 'FreeToken-WSL' /TR 'wsl.exe -d Ubuntu-24.04 --exec /bin/true'"
        in decoded
    )
    only_task = enrol.powershell_script(2222, "Debian", rule=False, task=True)
    assert "New-NetFirewallHyperVRule" not in only_task and "schtasks.exe" in only_task


def test_the_inventory_line_is_python_the_fleet_can_read(keypair):
    i = enrol.Inputs(key="k", name="ws7", user="deploy", port=2222)
    line = enrol.inventory_line(i, "192.0.2.17", "SHA256:abc")
    code, _, comment = line.partition("  #")
    name, data = eval(code.rstrip(","), {})  # a tuple literal
    assert name == "ws7" and data == {"ssh_hostname": "192.0.2.17", "ssh_port": 2222, "ssh_user": "deploy"}
    assert comment.strip() == "host key SHA256:abc"
    assert enrol.add_command(i, "192.0.2.17", "SHA256:abc").split()[3:6] == ["add", "ws7", "192.0.2.17"]


def test_the_single_file_form_merges_as_the_deploy_does(tmp_path):
    bundled = tmp_path / "enrol-standalone.py"
    out = subprocess.run([sys.executable, str(SCRIPT), "--bundle"], capture_output=True, check=True)
    bundled.write_bytes(out.stdout)
    original = "[wsl2]\r\nmemory=24GB # mine\r\n[experimental]\r\nnetworkingMode=NAT\r\n".encode("utf-16")
    code = (
        "import json, sys, runpy\n"
        f"m = runpy.run_path({str(bundled)!r}, run_name='enrol_bundle')\n"
        "w = m['_wsl_ini']()\n"
        "assert 'freetoken_infra' not in {p.split('/')[-1] for p in sys.path}\n"
        f"r = w.merge(bytes.fromhex({original.hex()!r}), w.WSLCONFIG, 'wsl2', {{'networkingMode': 'mirrored'}})\n"
        "print(json.dumps([r.data.hex(), list(r.changed), w.__file__ if hasattr(w, '__file__') else None]))\n"
    )
    # -I: no PYTHONPATH, no user site; run from an empty folder, as on the PC.
    ran = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    data, changed, origin = json.loads(ran.stdout)
    want = wsl_ini.merge(original, wsl_ini.WSLCONFIG, "wsl2", {"networkingMode": "mirrored"})
    assert bytes.fromhex(data) == want.data and tuple(changed) == want.changed == ("networkingMode",)
    assert origin is None  # the module came from inside the file, not from a repository


def test_it_refuses_to_run_without_root(keypair):
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="enrol-unprivileged-", dir="/tmp"))  # readable by nobody
    try:
        folder.chmod(0o755)
        script = folder / "enrol.py"
        shutil.copyfile(SCRIPT, script)
        pub = folder / "key.pub"
        pub.write_text(Path(str(keypair) + ".pub").read_text())
        argv = ["/usr/bin/python3", str(script), "--key-file", str(pub)]  # the PC's own python3
        if enrol.os.geteuid() == 0:  # as nobody: what a user without sudo sees
            argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv]
        ran = subprocess.run(argv, capture_output=True, text=True, cwd=folder)
    finally:
        shutil.rmtree(folder)
    assert ran.returncode == 2 and ran.stderr.startswith("enrol: run it as root"), ran.stderr


def _proc(tmp_path: Path, btime: int, ticks: int) -> Path:
    """A /proc with the two lines pid1_started reads, laid out as the kernel writes them
    (proc(5); the command name in parentheses may hold spaces and parentheses)."""
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "stat").write_text(f"cpu  1 2 3 4 5 6 7 0 0 0\nintr 0\nctxt 10\nbtime {btime}\nprocesses 9\n")
    after = ["S", "0", "1", "1", "0", "-1", "4194560", "12", "0", "0", "0", "3", "4", "0", "0", "20", "0", "1", "0"]
    (proc / "1/stat").write_text(f"1 (init (wsl) x) {' '.join(after)} {ticks} 2000 300 18446744073709551615\n")
    return proc


def test_pid1s_start_is_boot_time_plus_its_ticks(tmp_path):
    hz = os.sysconf("SC_CLK_TCK")
    assert enrol.pid1_started(str(_proc(tmp_path, 1_700_000_000, 50 * hz))) == 1_700_000_050
    real = enrol.pid1_started()
    assert real is not None and real <= time.time()


def test_a_settings_file_changed_after_pid1_started_still_owes_the_restart(tmp_path):
    """A first run that changed wsl.conf and then stopped (a declined Windows prompt) leaves a
    second run that changes nothing still saying: restart."""
    conf = tmp_path / "wsl.conf"
    conf.write_text("[boot]\nsystemd=true\n")
    os.utime(conf, (1_700_000_100, 1_700_000_100))
    hz = os.sysconf("SC_CLK_TCK")
    booted_before = _proc(tmp_path / "a", 1_700_000_000, 50 * hz)  # PID 1 at ...050: older than the file
    booted_after = _proc(tmp_path / "b", 1_700_000_000, 200 * hz)  # PID 1 at ...200: it read the file
    assert enrol.restart_pending([str(conf), str(tmp_path / "absent")], str(booted_before))
    assert not enrol.restart_pending([str(conf), str(tmp_path / "absent")], str(booted_after))
    assert enrol.restart_pending([str(conf)], str(tmp_path / "no-proc"))  # unreadable: ask for it
