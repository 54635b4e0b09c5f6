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


def _args(key, **kw):
    given = {"key": key, "key_file": None, "name": "ws7", "user": None, "port": 2222, "allow": ["192.0.2.5"], **kw}
    return enrol.argparse.Namespace(**given)


def test_a_bad_name_or_user_is_refused_before_anything(keypair):
    key = Path(str(keypair) + ".pub").read_text()
    with pytest.raises(enrol.EnrolError, match=r"^--name"):
        enrol.inputs(_args(key, name="ws 7;rm"))
    with pytest.raises(enrol.EnrolError, match=r"^--user nobody-here-x: no such user"):
        enrol.inputs(_args(key, user="nobody-here-x"))
    with pytest.raises(enrol.EnrolError, match=r"^--port 22"):
        enrol.inputs(_args(key, user="root", port=22))
    for engine_user in ("freetoken", "freetoken-fetch"):
        with pytest.raises(enrol.EnrolError, match=rf"^--user {engine_user}: the engine's or the download's own user"):
            enrol.inputs(_args(key, user=engine_user))
    ok = enrol.inputs(_args(key, user="root"))
    assert (ok.name, ok.user, ok.port, ok.allow) == ("ws7", "root", 2222, ("192.0.2.5",))


def test_the_deploy_logs_in_as_its_own_account_unless_asked(keypair, monkeypatch):
    """Not the owner's daily account (whoever ran sudo): freetoken-deploy, made by enrol.py, so
    it need not exist yet; the owner's own only with --user."""
    key = Path(str(keypair) + ".pub").read_text()
    monkeypatch.setenv("SUDO_USER", "root")
    monkeypatch.setattr(enrol.pwd, "getpwnam", lambda name: pytest.fail(f"looked up {name}"))
    assert enrol.inputs(_args(key)).user == enrol.DEPLOY_USER == "freetoken-deploy"
    assert enrol.inputs(_args(key, user="freetoken-deploy")).user == "freetoken-deploy"
    monkeypatch.undo()
    assert enrol.inputs(_args(key, user="root")).user == "root"


def test_the_allowed_addresses_are_required_and_checked(keypair):
    key = Path(str(keypair) + ".pub").read_text()
    with pytest.raises(enrol.EnrolError, match=r"^--allow: give the address the controller connects from"):
        enrol.inputs(_args(key, allow=None))
    for bad, says in (
        ("ws1.lan", "not an IP address"),
        ("192.0.2.0/24", "not an IP address"),
        ("192.0.2.5,192.0.2.6", "not an IP address"),
        ('192.0.2.5" ssh-ed25519', "not an IP address"),
        ("0.0.0.0", "not the address of one machine"),
        ("::", "not the address of one machine"),
        ("224.0.0.1", "not the address of one machine"),
    ):
        with pytest.raises(enrol.EnrolError, match=rf"^--allow .*{says}"):
            enrol.inputs(_args(key, allow=["192.0.2.5", bad]))
    ok = enrol.inputs(_args(key, allow=["192.0.2.5", "2001:DB8:0::9", "192.0.2.5"]))
    assert ok.allow == ("192.0.2.5", "2001:db8::9")  # normal forms, once each, in order


def test_sshd_takes_public_keys_only_from_the_deploy_account():
    text = enrol.sshd_dropin(2222, "freetoken-deploy")
    assert "Port 2222\n" in text and "PasswordAuthentication no\n" in text
    assert "AuthenticationMethods publickey\n" in text and "KbdInteractiveAuthentication no\n" in text
    assert "PermitRootLogin no\n" in text and "AllowUsers freetoken-deploy\n" in text
    assert text.startswith(enrol.DROPIN_HEADER)
    as_root = enrol.sshd_dropin(2222, "root")
    assert "PermitRootLogin prohibit-password\n" in as_root and "AllowUsers root\n" in as_root


def test_the_drop_in_is_read_before_every_other_drop_in():
    """sshd reads sshd_config.d/*.conf in name order and keeps the first value: the drop-in's
    name sorts before the usual NN-*.conf files; the old name sorted after them."""
    folder = os.path.dirname(enrol.SSHD_DROPIN)
    assert folder == "/etc/ssh/sshd_config.d" and os.path.dirname(enrol.OLD_SSHD_DROPIN) == folder
    others = ["01-local.conf", "10-owner.conf", "50-cloud-init.conf", "60-cloudimg-settings.conf", "99-x.conf"]
    assert sorted([os.path.basename(enrol.SSHD_DROPIN), *others])[0] == "00-freetoken.conf"
    assert sorted([os.path.basename(enrol.OLD_SSHD_DROPIN), *others])[-1] == "freetoken.conf"


def test_sudo_is_as_root_only_without_a_prompt():
    text = enrol.sudoers_dropin("freetoken-deploy")
    rules = [line for line in text.splitlines() if not line.startswith("#")]
    assert rules == ["freetoken-deploy ALL=(root) NOPASSWD: ALL"]  # not (ALL): no other user, no group


def test_one_elevated_powershell_carries_the_firewall_rule_and_the_task():
    script = enrol.powershell_script(2222, "Ubuntu-24.04", rule=True, task=True, allow=("192.0.2.5", "192.0.2.9"))
    argv = enrol.elevated_command(script)
    assert argv[:4] == ["powershell.exe", "-NoProfile", "-NonInteractive", "-Command"]
    assert argv[4].count("-Verb RunAs") == 1
    encoded = argv[4].rsplit("'", 2)[1]
    decoded = base64.b64decode(encoded).decode("utf-16-le")
    assert decoded == script
    assert "New-NetFirewallHyperVRule -Name 'FreeToken-WSL-sshd'" in decoded and "-LocalPorts 2222" in decoded
    assert "-RemoteAddresses '192.0.2.5','192.0.2.9' -Profiles Domain,Private\r\n" in decoded
    assert "Remove-NetFirewallHyperVRule" not in decoded
    assert enrol.WSL_VM_CREATOR_ID in decoded
    assert (
        "schtasks.exe /Create /F /SC ONLOGON /TN 'FreeToken-WSL' /TR 'wsl.exe -d Ubuntu-24.04 --exec /bin/true'"
        in decoded
    )
    only_task = enrol.powershell_script(2222, "Debian", rule=False, task=True)
    assert "New-NetFirewallHyperVRule" not in only_task and "schtasks.exe" in only_task
    replace = enrol.powershell_script(2222, "Debian", rule=True, task=False, allow=("192.0.2.5",), replace=True)
    lines = replace.split("\r\n")
    assert lines[1] == "Remove-NetFirewallHyperVRule -Name 'FreeToken-WSL-sshd'"
    assert lines[2].startswith("New-NetFirewallHyperVRule") and lines[2].endswith(
        "-RemoteAddresses '192.0.2.5' -Profiles Domain,Private"
    )


def test_the_inventory_line_is_python_the_fleet_can_read(keypair):
    i = enrol.Inputs(key="k", name="ws7", user="freetoken-deploy", port=2222, allow=("192.0.2.5",))
    line = enrol.inventory_line(i, "192.0.2.17", "SHA256:abc")
    code, _, comment = line.partition("  #")
    name, data = eval(code.rstrip(","), {})  # a tuple literal
    assert name == "ws7" and data == {"ssh_hostname": "192.0.2.17", "ssh_port": 2222, "ssh_user": "freetoken-deploy"}
    assert comment.strip() == "host key SHA256:abc"
    add = enrol.add_command(i, "192.0.2.17", "SHA256:abc").split()
    assert add[3:6] == ["add", "ws7", "192.0.2.17"] and add[add.index("--user") + 1] == "freetoken-deploy"
    assert enrol.admits(i) == (
        "freetoken-deploy, with the controller's key, from 192.0.2.5 (Domain and Private networks)"
    )


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


# --------------------------------------------------------------------------- the firewall rule
STANDIN_POWERSHELL = Path(__file__).resolve().parents[1] / "fleet" / "standins" / "bin" / "powershell.exe"


@pytest.mark.parametrize(
    "output, seen",
    [
        ("2222|192.0.2.5,192.0.2.9|Domain, Private\r\n", ({"2222"}, {"192.0.2.5", "192.0.2.9"}, {"Domain", "Private"})),
        ("2222|192.0.2.5|3\r\n", ({"2222"}, {"192.0.2.5"}, {"Domain", "Private"})),  # the flags as a number
        ("2222|Any|Any\r\n", ({"2222"}, None, {"Domain", "Private", "Public"})),  # an earlier enrol.py's rule
        ("2222|2001:DB8::9|Private\r\n", ({"2222"}, {"2001:db8::9"}, {"Private"})),
        ("2222|192.0.2.0/24|0\r\n", ({"2222"}, {"192.0.2.0/24"}, {"Domain", "Private", "Public"})),
        (
            "2222|192.0.2.5/255.255.255.255,2001:db8::9/128|3\r\n",
            ({"2222"}, {"192.0.2.5", "2001:db8::9"}, {"Domain", "Private"}),
        ),
        (
            "2222|192.0.2.5-192.0.2.9,LocalSubnet|3\r\n",
            ({"2222"}, {"192.0.2.5-192.0.2.9", "LocalSubnet"}, {"Domain", "Private"}),
        ),
    ],
)
def test_the_rule_is_read_as_windows_writes_it(output, seen):
    rule = enrol.parse_rule(output)
    ports, addresses, profiles = seen
    assert rule == enrol.RuleSeen(
        frozenset(ports), None if addresses is None else frozenset(addresses), frozenset(profiles)
    )


def test_only_the_rule_as_set_is_as_set():
    allow = ("192.0.2.5", "192.0.2.9")
    assert enrol.parse_rule("2222|192.0.2.9,192.0.2.5|Domain, Private").is_as(2222, allow)
    for other in (
        "2222|Any|Any",  # any address, any network: what enrol.py made before
        "2222|192.0.2.5,192.0.2.9|Domain, Private, Public",  # public Wi-Fi too
        "2222|192.0.2.5|Domain, Private",  # one address short
        "2222|192.0.2.5,192.0.2.9,192.0.2.66|Domain, Private",  # one too many
        "2223|192.0.2.5,192.0.2.9|Domain, Private",
    ):
        assert not enrol.parse_rule(other).is_as(2222, allow), other
    assert enrol.parse_rule("") is None
    assert enrol.parse_rule("Get-NetFirewallHyperVRule : No MSFT_NetFirewallHyperVRule objects found") is None


def _windows(tmp_path, monkeypatch):
    """enrol.py's Windows calls answered by the fleet's PowerShell stand-in (its rules kept under
    tmp_path) and a schtasks that has the task; returns the stand-in's rules file."""
    drive = tmp_path / "c"
    env = {**os.environ, "FREETOKEN_SIM_DRIVE_C": str(drive), "FREETOKEN_SIM_DIR": str(tmp_path)}
    real = enrol._run

    def run(argv, what, **kwargs):
        if argv[0] == "powershell.exe":
            return subprocess.run(
                [sys.executable, str(STANDIN_POWERSHELL), *argv[1:]], capture_output=True, text=True, env=env
            )
        if argv[0] == "schtasks.exe":
            return subprocess.CompletedProcess(argv, 0, "", "")
        return real(argv, what, **kwargs)

    monkeypatch.setattr(enrol, "_run", run)
    monkeypatch.setenv("WSL_DISTRO_NAME", "Ubuntu-24.04")
    return drive / ".sim" / "hyperv-firewall.json"


def _inputs(**kw):
    given = {"key": "k", "name": "ws7", "user": "freetoken-deploy", "port": 2222, "allow": ("192.0.2.5",), **kw}
    return enrol.Inputs(**given)


def test_the_rule_admits_the_allowed_addresses_on_private_and_domain_networks_only(tmp_path, monkeypatch):
    rules_file = _windows(tmp_path, monkeypatch)
    run = enrol.Run()
    enrol.ensure_windows(_inputs(allow=("192.0.2.5", "192.0.2.9")), run)
    rule = json.loads(rules_file.read_text())["FreeToken-WSL-sshd"]
    assert rule["remote_addresses"] == ["192.0.2.5", "192.0.2.9"]
    assert rule["profiles"] == ["Domain", "Private"] and rule["local_ports"] == "2222"
    assert rule["vm_creator_id"] == enrol.WSL_VM_CREATOR_ID and rule["direction"] == "Inbound"
    assert [c for c in run.changed if "firewall" in c] == [
        "Windows: Hyper-V firewall rule FreeToken-WSL-sshd (TCP 2222 into WSL from 192.0.2.5, 192.0.2.9; "
        "Domain and Private networks only)"
    ]
    again = enrol.Run()
    enrol.ensure_windows(_inputs(allow=("192.0.2.9", "192.0.2.5")), again)  # the same set
    assert again.changed == []


def test_a_rule_that_admits_more_is_replaced_in_the_one_prompt(tmp_path, monkeypatch):
    """The rule an earlier enrol.py made (any address, every network) is removed and made again
    as set; Windows refuses a second rule of the same name, as the stand-in does."""
    rules_file = _windows(tmp_path, monkeypatch)
    rules_file.parent.mkdir(parents=True)
    old = {"direction": "Inbound", "vm_creator_id": enrol.WSL_VM_CREATOR_ID, "protocol": "TCP", "local_ports": "2222"}
    rules_file.write_text(json.dumps({"FreeToken-WSL-sshd": old}))
    run = enrol.Run()
    enrol.ensure_windows(_inputs(), run)
    rule = json.loads(rules_file.read_text())["FreeToken-WSL-sshd"]
    assert (rule["remote_addresses"], rule["profiles"]) == (["192.0.2.5"], ["Domain", "Private"])
    calls = [json.loads(line) for line in (rules_file.parent / "calls.jsonl").read_text().splitlines()]
    assert [c["tool"] for c in calls].count("uac") == 1
    with pytest.raises(enrol.EnrolError, match="still missing or not as set"):
        real = enrol.firewall_rule_lines  # Windows made another rule than the one asked for
        monkeypatch.setattr(enrol, "firewall_rule_lines", lambda port, allow, r: real(port, ("192.0.2.99",), r))
        enrol.ensure_windows(_inputs(allow=("192.0.2.77",)), enrol.Run())


def test_the_standin_takes_only_the_whole_rule_as_enrol_writes_it(tmp_path):
    """The stand-in imitates New-NetFirewallHyperVRule with -RemoteAddresses and -Profiles only:
    the rule without them (what enrol.py wrote before) is refused as not imitated."""
    env = {**os.environ, "FREETOKEN_SIM_DRIVE_C": str(tmp_path / "c"), "FREETOKEN_SIM_DIR": str(tmp_path)}
    whole = enrol.firewall_rule_lines(2222, ("192.0.2.5",), replace=False)[0]
    for line in (whole.split(" -RemoteAddresses")[0], whole + " -Action Allow", whole.replace("Private", "Privat")):
        script = "$ErrorActionPreference = 'Stop'\r\n" + line + "\r\n"
        ran = subprocess.run(
            [sys.executable, str(STANDIN_POWERSHELL), *enrol.elevated_command(script)[1:]],
            capture_output=True,
            env=env,
        )
        assert ran.returncode == 1 and b"not imitated" in ran.stderr, line
    assert not (tmp_path / "c/.sim/hyperv-firewall.json").exists()


# --------------------------------------------------------------------------- the account and its key
def test_the_key_is_usable_from_the_allowed_addresses_only():
    key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKx op@controller"
    line = enrol.authorized_key_line(key, ("192.0.2.5", "2001:db8::9"))
    assert line == 'from="192.0.2.5,2001:db8::9" ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKx op@controller'
    assert enrol.with_authorized_key("", key, ("192.0.2.5",)) == f'from="192.0.2.5" {key}\n'
    mine = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ me@laptop"
    # The key as an earlier enrol.py wrote it (no from=), between the owner's own: replaced in place.
    have = f"{mine}\n{key}\n# a comment\n"
    assert enrol.with_authorized_key(have, key, ("192.0.2.5",)) == f'{mine}\nfrom="192.0.2.5" {key}\n# a comment\n'
    # Other options, another address, a second copy: one line as set.
    have = f'from="0.0.0.0/0",no-pty {key}\n{mine}\n{key.rsplit(" ", 1)[0]}\n'
    assert enrol.with_authorized_key(have, key, ("192.0.2.5",)) == f'from="192.0.2.5" {key}\n{mine}\n'
    assert enrol.with_authorized_key(f'{mine}\nfrom="192.0.2.5" {key}\n', key, ("192.0.2.5",)) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the writer drops root's groups: needs root")
def test_the_key_is_written_by_the_account_itself_with_from(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".ssh").mkdir()
    (home / ".ssh/authorized_keys").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKx op@controller\n")
    account = enrol.pwd.struct_passwd(("freetoken-deploy", "x", os.getuid(), os.getgid(), "", str(home), "/bin/sh"))
    monkeypatch.setattr(enrol.pwd, "getpwnam", lambda name: account)
    i = _inputs(key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKx op@controller", allow=("192.0.2.5", "192.0.2.9"))
    run = enrol.Run()
    enrol.ensure_authorized_key(i, run)
    assert (home / ".ssh/authorized_keys").read_text() == f'from="192.0.2.5,192.0.2.9" {i.key}\n'
    assert (home / ".ssh/authorized_keys").stat().st_mode & 0o777 == 0o600
    assert len(run.changed) == 1 and "from 192.0.2.5, 192.0.2.9 only" in run.changed[0]
    again = enrol.Run()
    enrol.ensure_authorized_key(i, again)
    assert again.changed == [] and sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


def _recorder(answers=None):
    calls = []

    def run(argv, what, **kwargs):
        calls.append(argv)
        for prefix, result in (answers or {}).items():
            if " ".join(argv).startswith(prefix):
                return subprocess.CompletedProcess(argv, *result)
        return subprocess.CompletedProcess(argv, 0, "", "")

    return calls, run


def test_the_deploy_account_is_made_without_a_password(tmp_path, monkeypatch):
    shadow = tmp_path / "shadow"
    monkeypatch.setattr(enrol, "SHADOW", str(shadow))
    calls, run = _recorder()
    monkeypatch.setattr(enrol, "_run", run)
    monkeypatch.setattr(enrol, "_account_exists", lambda user: False)
    shadow.write_text("root:*:20000:0:99999:7:::\nfreetoken-deploy:*:20000::::::\n")  # what useradd -p '*' leaves
    made = enrol.Run()
    enrol.ensure_account(_inputs(), made)
    assert calls == [
        [
            "useradd", "--system", "--user-group", "--create-home", "--home-dir", "/home/freetoken-deploy",
            "--shell", "/bin/bash", "--password", "*", "--comment", "freetoken-infra deploy", "freetoken-deploy",
        ]
    ]  # fmt: skip
    assert made.changed == ["deploy account freetoken-deploy: no password, the controller's key only"]
    monkeypatch.setattr(enrol, "_account_exists", lambda user: True)
    calls.clear()
    enrol.ensure_account(_inputs(), kept := enrol.Run())
    assert calls == [] and kept.changed == []
    shadow.write_text("freetoken-deploy:$y$j9T$salt$hash:20000::::::\n")  # someone gave it a password
    enrol.ensure_account(_inputs(), fixed := enrol.Run())
    assert calls == [["usermod", "--password", "*", "freetoken-deploy"]] and len(fixed.changed) == 1
    calls.clear()
    enrol.ensure_account(_inputs(user="alice"), own := enrol.Run())
    assert calls == [] and own.changed == []  # the owner's own account is theirs: nothing made or changed


# --------------------------------------------------------------------------- sshd's effective settings
REAL = Path(__file__).resolve().parents[1] / "fixtures" / "real"
DEBIAN_SSHD_CONFIG = (
    "# Debian bookworm's /etc/ssh/sshd_config, its settings (comments trimmed)\n"
    "Include {d}/*.conf\n"
    "KbdInteractiveAuthentication no\n"
    "UsePAM yes\n"
    "X11Forwarding yes\n"
    "PrintMotd no\n"
    "AcceptEnv LANG LC_*\n"
    "Subsystem\tsftp\t/usr/lib/openssh/sftp-server\n"
)


def _sshd_tree(tmp_path, dropin_name="00-freetoken.conf", extra=""):
    """The files of the sshd -T captures in tests/fixtures/real (README there), under tmp_path."""
    d = tmp_path / "sshd_config.d"
    d.mkdir()
    (tmp_path / "sshd_config").write_text(DEBIAN_SSHD_CONFIG.format(d=d) + extra)
    (d / dropin_name).write_text(enrol.sshd_dropin(2222, "freetoken-deploy"))
    (d / "50-cloud-init.conf").write_text("PasswordAuthentication yes\n")
    return str(tmp_path / "sshd_config"), str(d / dropin_name)


def _sshd_answers(plain, with_context=None):
    def run(argv, what, **kwargs):
        text = (REAL / (with_context if "-C" in argv and with_context else plain)).read_text()
        return subprocess.CompletedProcess(argv, 0, text, "")

    return run


def test_sshd_lines_are_read_in_sshds_order(tmp_path):
    config, dropin = _sshd_tree(tmp_path, extra="Match Address 192.0.2.0/24\n\tPasswordAuthentication yes\n")
    (tmp_path / "sshd_config.d" / "relative.conf").write_text("Port = 22\n")
    with open(config, "a") as f:
        f.write("Include sshd_config.d/relative.conf\n")
    lines = enrol.sshd_lines(config)
    said = [(os.path.basename(s.file), s.key, s.value, s.match is not None) for s in lines]
    assert said[:2] == [
        ("00-freetoken.conf", "port", "2222", False),
        ("00-freetoken.conf", "pubkeyauthentication", "yes", False),
    ]
    password = [s for s in said if s[1] == "passwordauthentication"]
    assert password == [
        ("00-freetoken.conf", "passwordauthentication", "no", False),
        ("50-cloud-init.conf", "passwordauthentication", "yes", False),
        ("sshd_config", "passwordauthentication", "yes", True),  # inside the Match block
    ]
    assert ("relative.conf", "port", "22", True) in said  # an Include below a Match is inside it


def test_the_drop_in_read_first_is_in_effect(tmp_path):
    """Real `sshd -T` (OpenSSH 9.2p1): with 00-freetoken.conf the drop-in wins over a
    50-cloud-init.conf that turns passwords on."""
    config, dropin = _sshd_tree(tmp_path)
    i = _inputs()
    assert enrol.sshd_mismatch(i, _sshd_answers("sshd-T-9.2p1-00-freetoken.txt"), config, dropin) is None


def test_a_file_read_before_the_drop_in_is_named_with_the_key(tmp_path):
    """Real `sshd -T` with the drop-in under its old name: 50-cloud-init.conf is read first and
    PasswordAuthentication yes is in effect; the error names the key and the file that won."""
    config, dropin = _sshd_tree(tmp_path, dropin_name="freetoken.conf")
    problem = enrol.sshd_mismatch(_inputs(), _sshd_answers("sshd-T-9.2p1-old-name-cloud-init-wins.txt"), config, dropin)
    assert problem == (
        "PasswordAuthentication is yes in effect (`sshd -T`), not no: "
        f"{tmp_path}/sshd_config.d/50-cloud-init.conf:1 (PasswordAuthentication yes) is read before {dropin} "
        "and wins (sshd keeps the first value it reads)"
    )


def test_a_match_block_that_wins_for_the_controllers_address_is_named(tmp_path):
    """Real `sshd -T -C ...`: a Match Address block turns passwords on for the controller's own
    connections, which plain `sshd -T` does not show."""
    config, dropin = _sshd_tree(tmp_path, extra="Match Address 192.0.2.0/24\n\tPasswordAuthentication yes\n")
    answers = _sshd_answers("sshd-T-9.2p1-00-freetoken.txt", "sshd-T-C-9.2p1-match-address.txt")
    problem = enrol.sshd_mismatch(_inputs(), answers, config, dropin)
    assert problem == (
        "PasswordAuthentication is yes in effect "
        "(`sshd -T -C user=freetoken-deploy,host=192.0.2.5,addr=192.0.2.5,lport=2222`), not no: "
        f"{tmp_path}/sshd_config:10 (PasswordAuthentication yes) in the Match block at {tmp_path}/sshd_config:9 wins"
    )


def test_a_port_or_user_another_file_adds_is_named(tmp_path):
    """Port and AllowUsers add up over the files: another file's line is named."""
    config, dropin = _sshd_tree(tmp_path, extra="Port 22\n")
    real = (REAL / "sshd-T-9.2p1-00-freetoken.txt").read_text()

    def run(argv, what, **kwargs):
        return subprocess.CompletedProcess(argv, 0, real.replace("port 2222\n", "port 2222\nport 22\n"), "")

    assert enrol.sshd_mismatch(_inputs(), run, config, dropin) == (
        f"Port is 2222 22 in effect (`sshd -T`), not 2222: {config}:9 adds Port 22"
    )
    as_root = enrol.sshd_mismatch(_inputs(user="root"), _sshd_answers("sshd-T-9.2p1-00-freetoken.txt"), config, dropin)
    assert as_root is not None and as_root.startswith(
        "PermitRootLogin is no in effect (`sshd -T`), not without-password"
    )


def test_ensure_sshd_replaces_the_old_drop_in_and_puts_both_back_on_a_mismatch(tmp_path, monkeypatch):
    d = tmp_path / "sshd_config.d"
    d.mkdir()
    new, old = d / "00-freetoken.conf", d / "freetoken.conf"
    monkeypatch.setattr(enrol, "SSHD_DROPIN", str(new))
    monkeypatch.setattr(enrol, "OLD_SSHD_DROPIN", str(old))
    monkeypatch.setattr(enrol, "systemd_running", lambda: False)
    monkeypatch.setattr(enrol.os, "makedirs", lambda *a, **k: None)
    ours_before = enrol.DROPIN_HEADER + ": the fleet's controller logs in with its key only.\nPort 2222\n"
    old.write_text(ours_before)
    installed = {"dpkg-query": (0, "install ok installed", "")}
    mismatch = "PasswordAuthentication is yes in effect (`sshd -T`), not no: /etc/ssh/x.conf:1 ... wins"
    monkeypatch.setattr(enrol, "sshd_mismatch", lambda i: mismatch)
    calls, run = _recorder(installed)
    monkeypatch.setattr(enrol, "_run", run)
    with pytest.raises(enrol.EnrolError) as exc:
        enrol.ensure_sshd(_inputs(), enrol.Run())
    assert str(exc.value) == f"sshd: {mismatch}; change that, then run this again; drop-in put back"
    assert not new.exists() and old.read_text() == ours_before  # as it was
    monkeypatch.setattr(enrol, "sshd_mismatch", lambda i: None)
    done = enrol.Run()
    enrol.ensure_sshd(_inputs(), done)
    assert new.read_text() == enrol.sshd_dropin(2222, "freetoken-deploy") and not old.exists()
    assert ["/usr/sbin/sshd", "-t"] in calls and done.changed
    old.write_text("Port 2222\n")  # the hand-made file inventories/fleet.py once showed: not ours, kept
    enrol.ensure_sshd(_inputs(), again := enrol.Run())
    assert old.exists() and again.changed == []
