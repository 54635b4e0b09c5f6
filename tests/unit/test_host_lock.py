"""The host lock: the target-side script (run here, on temporary files, as on a target), the
fact the doctor reads, and the controller's side with a host double whose shell is this
machine's."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from pyinfra.connectors.util import CommandOutput, OutputLine

from facts.host_lock import HostLock, parse_host_lock_output
from operations import host_lock

SCRIPT = Path(host_lock.__file__).resolve().parent / "scripts" / "host_lock.py"


def holder(token: str, pid: int | None = None, **extra) -> dict:
    return {
        "controller": "ctl",
        "user": "alice",
        "pid": pid or os.getpid(),
        "started": "2026-12-03 07:00:00 UTC",
        "command": "pyinfra -y inventories/sim.py deploys/freetoken.py",
        "token": token,
        **extra,
    }


def lock(tmp_path: Path, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *args,
            "--lock-file",
            str(tmp_path / "run.lock"),
            "--mutex",
            str(tmp_path / "run.lock.mutex"),
        ],
        capture_output=True,
        text=True,
        timeout=120,  # bounds a hang only: the script answers in well under a second
    )
    return proc.returncode, json.loads(proc.stdout.splitlines()[-1])


def b64(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()


def test_take_hold_release(tmp_path):
    before = time.time()
    rc, doc = lock(tmp_path, "take", "--holder", b64(holder("A")), "--lease", "60")
    after = time.time()
    assert (rc, doc["taken"], doc["took_over"]) == (0, True, None)
    written = json.loads((tmp_path / "run.lock").read_text())
    # the lease ends 60 s after the script took it, whenever that was between the two readings
    assert written["token"] == "A" and before + 60 <= written["expires"] <= after + 60
    # the session is a live process (here: no sshd above the script, so this test process or none)
    rc, doc = lock(tmp_path, "take", "--holder", b64(holder("B")), "--lease", "60")
    assert rc == host_lock.HELD_EXIT and doc["taken"] is False and doc["holder"]["token"] == "A"
    assert lock(tmp_path, "take", "--holder", b64(holder("A")), "--lease", "60")[0] == 0  # ours again
    assert lock(tmp_path, "release", "--token", "B") == (0, {"released": False, "recorded": None})
    assert (tmp_path / "run.lock").exists()
    assert lock(tmp_path, "release", "--token", "A") == (0, {"released": True, "recorded": None})
    assert not (tmp_path / "run.lock").exists()


def _write_lock(tmp_path: Path, doc: dict) -> None:
    (tmp_path / "run.lock").write_text(json.dumps(doc))


def _start_ticks(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    _write_lock(tmp_path, {**holder("OLD"), "session": {"pid": gone.pid, "start": 1}, "expires": time.time() + 3600})
    rc, doc = lock(tmp_path, "take", "--holder", b64(holder("NEW")), "--lease", "60")
    assert rc == 0 and doc["why"] == "holder gone" and doc["took_over"]["token"] == "OLD"


def test_a_live_holder_past_its_lease_is_taken_over_and_a_reused_pid_is_not_the_holder(tmp_path):
    me = {"pid": os.getpid(), "start": _start_ticks(os.getpid())}
    _write_lock(tmp_path, {**holder("OLD"), "session": me, "expires": time.time() - 1})
    rc, doc = lock(tmp_path, "take", "--holder", b64(holder("NEW")), "--lease", "60")
    assert rc == 0 and doc["why"] == "lease expired"
    # Same pid, another start time: another process, so the holder is gone.
    _write_lock(tmp_path, {**holder("OLD"), "session": {**me, "start": me["start"] + 1}, "expires": time.time() + 3600})
    assert lock(tmp_path, "take", "--holder", b64(holder("NEW")), "--lease", "60")[1]["why"] == "holder gone"
    # A live session within its lease holds.
    _write_lock(tmp_path, {**holder("OLD"), "session": me, "expires": time.time() + 3600})
    assert lock(tmp_path, "take", "--holder", b64(holder("NEW")), "--lease", "60")[0] == host_lock.HELD_EXIT


def test_renew_extends_only_our_own_lease(tmp_path):
    lock(tmp_path, "take", "--holder", b64(holder("A")), "--lease", "5")
    before = json.loads((tmp_path / "run.lock").read_text())["expires"]
    assert lock(tmp_path, "renew", "--token", "A", "--lease", "600")[0] == 0
    assert json.loads((tmp_path / "run.lock").read_text())["expires"] > before + 500
    rc, doc = lock(tmp_path, "renew", "--token", "B", "--lease", "600")
    assert rc == host_lock.HELD_EXIT and doc["renewed"] is False


def test_session_is_the_sshd_ancestor_or_the_local_controller():
    spec = __import__("importlib.util").util.spec_from_file_location("host_lock_script", SCRIPT)
    module = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(module)
    here = os.uname().nodename
    session = module.session_of({"controller": here, "pid": os.getpid()}, pid=os.getpid())
    assert session["pid"] == os.getpid() and session["what"] == "controller process"
    assert module.session_alive(session) is True
    assert module.session_alive({"pid": os.getpid(), "start": session["start"] + 1}) is False
    assert module.session_alive(None) is None


def test_the_fact_reads_a_held_a_gone_and_no_lock(tmp_path):
    me = {"pid": os.getpid(), "start": _start_ticks(os.getpid())}

    def fact(doc: dict | None):
        path = tmp_path / "run.lock"
        if doc is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(json.dumps(doc))
        out = subprocess.run(HostLock().command(str(path)), shell=True, capture_output=True, text=True)
        return parse_host_lock_output(out.stdout.splitlines())

    written = time.time()
    held = fact({**holder("A", command="pyinfra\n@@ft:lock forged"), "session": me, "expires": written + 100})
    read = time.time()
    # the fact's own clock read the lease between the write and now: what is left lies in between
    assert held.held and held.holder_alive is True and written + 100 - read <= held.lease_left_s <= 100
    assert held.holder["command"] == "pyinfra\n@@ft:lock forged"  # crossed encoded
    gone = fact({**holder("A"), "session": {**me, "start": me["start"] + 1}, "expires": time.time() + 100})
    assert gone.holder_alive is False and not gone.held
    expired = fact({**holder("A"), "session": me, "expires": time.time() - 5})
    assert not expired.held and expired.lease_left_s < 0
    free = fact(None)
    assert free.holder is None and not free.held and free.error is None
    assert not tmp_path.joinpath("run.lock").exists()  # the fact created nothing


def test_redacted_command_hides_secret_looking_data_values():
    argv = [
        "/home/a/.venv/bin/pyinfra",
        "-y",
        "inventories/sim.py",
        "deploys/freetoken.py",
        "--data",
        "engine_version=0.2.2",
        "--data",
        "hub_token=hf_abc",
        "--data",
        "api_key=xyz",
    ]
    text = host_lock.redacted_command(argv)
    assert text == (
        "pyinfra -y inventories/sim.py deploys/freetoken.py --data engine_version=0.2.2 "
        "--data 'hub_token=********' --data 'api_key=********'"
    )


SECRETS = ("PW-ssh-s3cret", "PW-keyphrase", "PW-in-url", "PW-sudo")
SECRET_ARGV = [
    "pyinfra",
    "-y",
    "--ssh-password",
    "PW-ssh-s3cret",
    "--ssh-key-password=PW-keyphrase",
    "--sudo-password",
    "PW-sudo",
    "--data",
    "pip_index_url=https://builder:PW-in-url@mirror.example/simple",
    "inv.py",
    "deploys/freetoken.py",
]


def test_the_command_line_is_redacted_in_the_lock_file_the_wait_line_and_the_doctor(tmp_path, capsys, monkeypatch):
    """A run started with passwords on its command line takes the lock; the lock
    file, the line a second run prints while it waits and the doctor's line carry none of them,
    and the lock file is root's alone (0600), as is its mutex."""
    monkeypatch.setattr(host_lock, "POLL_S", 0.2)
    first, second = _State(), _State()
    host = LocalHost("ws1", tmp_path)
    assert host_lock.take(first, host, timeout_s=1, argv=SECRET_ARGV) is None
    try:
        lock_file = tmp_path / "run.lock"
        assert lock_file.stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "run.lock.mutex").stat().st_mode & 0o777 == 0o600
        written = lock_file.read_text()
        assert "--ssh-password '********' " in json.loads(written)["command"]
        why = host_lock.take(second, host, timeout_s=0.5, argv=["pyinfra", "other"])
        waited = capsys.readouterr().err
        doctor = host_lock.describe(HostLock().process(_fact_lines(lock_file)).holder)
        shown = "\n".join([written, why, waited, doctor, *host.commands])
        assert "waiting for the host lock" in waited and "pyinfra -y --ssh-password" in doctor
        for secret in SECRETS:
            assert secret not in shown, secret
    finally:
        first.callback_handlers[0].host_disconnect(first, host)


def test_a_lock_file_written_by_an_older_release_is_masked_when_shown():
    holder_doc = holder("A", command="pyinfra -y --ssh-password PW-ssh-s3cret inv.py deploys/freetoken.py")
    assert "PW-ssh-s3cret" not in host_lock.describe(holder_doc)
    assert "--ssh-password '********'" in host_lock.describe(holder_doc)


def test_an_old_world_readable_lock_file_becomes_root_only_when_taken(tmp_path):
    (tmp_path / "run.lock").write_text("{}")
    (tmp_path / "run.lock").chmod(0o644)
    (tmp_path / "run.lock.mutex").write_text("")
    (tmp_path / "run.lock.mutex").chmod(0o644)
    rc, doc = lock(tmp_path, "take", "--holder", b64(holder("A")), "--lease", "60")
    assert rc == 0 and doc["taken"]
    for name in ("run.lock", "run.lock.mutex"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name


def _fact_lines(lock_file: Path) -> list[str]:
    from facts.host_lock import LOCK_SCRIPT

    proc = subprocess.run([sys.executable, "-c", LOCK_SCRIPT, str(lock_file)], capture_output=True, text=True)
    return proc.stdout.splitlines()


class LocalHost:
    """Just enough of a pyinfra Host for the controller's side: commands run in this shell,
    with the lock's paths moved under a temporary folder."""

    def __init__(self, name: str, tmp_path: Path):
        self.name = name
        self.tmp_path = tmp_path
        self.commands: list[str] = []
        self.data = types.SimpleNamespace()  # host data: what the lock sets for the run

    def run_shell_command(self, command, _stdin=None, **arguments):
        command = (
            str(command)
            .replace(host_lock.HOST_LOCK_FILE, str(self.tmp_path / "run.lock"))
            .replace(host_lock.HOST_LOCK_MUTEX, str(self.tmp_path / "run.lock.mutex"))
        )
        self.commands.append(command)
        proc = subprocess.run(
            command.replace("python3", sys.executable, 1), shell=True, input=_stdin, capture_output=True, text=True
        )
        lines = [OutputLine("stdout", line) for line in proc.stdout.splitlines()]
        return proc.returncode == 0, CommandOutput(lines)


class _State:
    def __init__(self):
        self.callback_handlers: list = []

    def add_callback_handler(self, handler):
        self.callback_handlers.append(handler)


def test_a_second_run_waits_says_who_holds_it_and_stops_after_the_timeout(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_lock, "POLL_S", 0.2)
    first, second = _State(), _State()
    host = LocalHost("ws1", tmp_path)
    argv = ["pyinfra", "-y", "inv.py", "deploys/freetoken.py"]
    assert host_lock.take(first, host, timeout_s=1, argv=argv) is None
    keeper = first.callback_handlers[0]
    try:
        why = host_lock.take(second, host, timeout_s=1, argv=["pyinfra", "other"])
        err = capsys.readouterr().err
        assert why.startswith("the host lock is held by ")
        assert "gave up after 1 s (host_lock_timeout_s)" in why
        assert "pyinfra -y inv.py deploys/freetoken.py" in why
        waiting = [line for line in err.splitlines() if "waiting for the host lock" in line]
        assert len(waiting) == 1 and "[ws1] waiting for the host lock, held by " in waiting[0], err
    finally:
        keeper.host_disconnect(first, host)  # releases (no SSH client: the connection is not lost)
    assert not (tmp_path / "run.lock").exists()
    assert host_lock.take(second, host, timeout_s=1) is None
    second.callback_handlers[0].host_disconnect(second, host)


def test_the_lease_is_renewed_while_the_run_works(tmp_path, monkeypatch):
    import gevent

    state, host = _State(), LocalHost("ws1", tmp_path)
    assert host_lock.take(state, host, timeout_s=1, lease_s=0.8) is None
    first = json.loads((tmp_path / "run.lock").read_text())["expires"]
    # a renewal every 0.2 s: wait for one to move the lease (the deadline bounds a hang only)
    deadline = time.monotonic() + 60
    while json.loads((tmp_path / "run.lock").read_text())["expires"] <= first and time.monotonic() < deadline:
        gevent.sleep(0.05)
    assert json.loads((tmp_path / "run.lock").read_text())["expires"] > first
    assert any(" renew " in c for c in host.commands)
    state.callback_handlers[0].host_disconnect(state, host)
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.parametrize("active, expected", [(True, False), (False, True)])
def test_connection_lost_reads_the_ssh_transport(active, expected):
    from freetoken_infra.core.pyinfra_internals import connection_lost

    class Transport:
        def is_active(self):
            return active

    class Client:
        def get_transport(self):
            return Transport()

    class Connector:
        client = Client()

    class Host:
        connector = Connector()

    assert connection_lost(Host()) is expected
    assert connection_lost(object()) is False  # @local: no SSH client


def test_a_lock_asked_for_without_root_is_asked_for_again_through_sudo(tmp_path):
    """The first try runs as the SSH user; the script says it needs root; the lock is taken
    through sudo, and the keeper renews and releases it that way."""
    locked = Path(tempfile.mkdtemp())  # root's 0755 folder (or, unprivileged, any 0555 one)
    locked.chmod(0o555 if os.geteuid() else 0o755)
    state, host, tries = _State(), LocalHost("ws1", tmp_path), []

    def run(command, script, elevation):
        tries.append(dict(elevation))
        if not elevation:  # as the SSH user, who is not root: the lock's folder is not writable
            for path in (host_lock.HOST_LOCK_FILE, host_lock.HOST_LOCK_MUTEX):
                command = command.replace(path, f"{locked}/x/{Path(path).name}")
            proc = subprocess.run(
                command, shell=True, input=script, capture_output=True, text=True, user=None if os.geteuid() else 65534
            )
            return proc.returncode == 0, proc.stdout.splitlines()
        ok, output = host.run_shell_command(command, _stdin=script)
        return ok, list(output.output_lines)

    try:
        assert host_lock.take(state, host, timeout_s=1, run=run) is None
    finally:
        locked.chmod(0o755)
        shutil.rmtree(locked)
    assert tries == [{}, {"_sudo": True}]
    keeper = state.callback_handlers[0]
    assert keeper.elevation["ws1"] == {"_sudo": True}
    keeper.host_disconnect(state, host)
    assert not (tmp_path / "run.lock").exists()


def test_a_lock_that_cannot_be_taken_says_why_in_one_line(tmp_path):
    state, host = _State(), LocalHost("ws1", tmp_path)

    def run(command, script, elevation):
        return False, ["python3: command not found"]

    why = host_lock.take(state, host, timeout_s=1, run=run)
    assert why == "cannot take the host lock: python3: command not found"


# ---------------------------------------------------------------------------- uploads through sudo
SSH_USER_UID = 4242  # the SSH user sudo was run by (SUDO_UID); another local user: nobody (65534)


@pytest.mark.skipif(os.geteuid() != 0, reason="the lock script runs as root on a target")
def test_a_run_through_sudo_uploads_through_a_private_folder_not_the_predictable_tmp_name(tmp_path, monkeypatch):
    """pyinfra's sudo upload writes /tmp/pyinfra-<sha1 of the destination> as the SSH user, then
    root copies it into place: another local user can plant that name first. A run through sudo
    gets its own folder, made when it takes the lock (0700, the SSH user's, an unpredictable
    name), pyinfra uploads through it, another user can neither plant nor read anything there, a
    file planted at the old predictable name is neither used nor touched, and the folder goes
    when the run releases the lock."""
    import hashlib

    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.arguments import pop_global_arguments

    monkeypatch.setenv("SUDO_UID", str(SSH_USER_UID))
    monkeypatch.setenv("SUDO_GID", str(SSH_USER_UID))
    dest = "/etc/freetoken/gateway-keys.map"
    predictable = Path("/tmp") / f"pyinfra-{hashlib.sha1(dest.encode()).hexdigest()}"
    planted = not predictable.exists()
    if planted:  # another local user plants the name pyinfra would have used
        subprocess.run(["sh", "-c", f"printf planted > {predictable}"], check=True, user=65534)
    state, host = _State(), LocalHost("ws1", tmp_path)
    try:
        assert host_lock.take(state, host, timeout_s=1, elevation={"_sudo": True}) is None
        folder = Path(host.data._temp_dir)
        info = folder.stat()
        assert host_lock.UPLOAD_DIR_RE.fullmatch(str(folder)) and not folder.is_symlink()
        assert (info.st_uid, info.st_mode & 0o777) == (SSH_USER_UID, 0o700)
        # what pyinfra makes of it: the operation's _temp_dir, and the upload's temporary file
        inventory = Inventory((["ws1"], {"_temp_dir": str(folder)}))
        real = inventory.get_host("ws1")
        arguments, _ = pop_global_arguments(State(inventory, Config()), real, {})
        upload = real.get_temp_filename(dest, temp_directory=arguments["_temp_dir"])
        assert upload.startswith(f"{folder}/pyinfra-") and Path(upload) != predictable
        denied = subprocess.run(["sh", "-c", f"touch {upload}"], capture_output=True, user=65534)
        assert denied.returncode != 0 and not Path(upload).exists()
        # a second run's folder is another one: nothing to guess
        other, other_host = _State(), LocalHost("ws2", tmp_path / "2")
        (tmp_path / "2").mkdir()
        assert host_lock.take(other, other_host, timeout_s=1, elevation={"_sudo": True}) is None
        assert other_host.data._temp_dir != str(folder)
        other.callback_handlers[0].host_disconnect(other, other_host)
    finally:
        state.callback_handlers[0].host_disconnect(state, host)
        if planted:
            assert predictable.read_text() == "planted"  # neither used nor overwritten
            predictable.unlink()
    assert not folder.exists() and not Path(other_host.data._temp_dir).exists()


def test_without_sudo_no_upload_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.delenv("SUDO_UID", raising=False)
    state, host = _State(), LocalHost("ws1", tmp_path)
    assert host_lock.take(state, host, timeout_s=1) is None
    assert not hasattr(host.data, "_temp_dir")
    state.callback_handlers[0].host_disconnect(state, host)


def test_an_upload_folder_named_by_the_host_is_taken_only_in_its_own_shape():
    for bad in ("/etc", "/tmp/freetoken-upload-x; rm -rf /", "/tmp/freetoken-upload-../../etc", "/tmp"):
        assert not host_lock.UPLOAD_DIR_RE.fullmatch(bad)


def test_a_deploy_without_the_lock_gets_its_private_upload_folder_too(tmp_path):
    """deploys/gateway.py takes no host lock; through sudo, its key maps are uploaded through a
    folder made by the SSH user (mktemp -d, 0700) and removed at disconnect."""

    class Data(types.SimpleNamespace):
        def get(self, key, default=None):
            return getattr(self, key, default)

    state, host = _State(), LocalHost("gw", tmp_path)
    host.data = Data(_sudo=True)
    host_lock.private_uploads(state, host)
    folder = Path(host.data._temp_dir)
    assert host_lock.UPLOAD_DIR_RE.fullmatch(str(folder)) and folder.stat().st_mode & 0o777 == 0o700
    state.callback_handlers[0].host_disconnect(state, host)
    assert not folder.exists()
    plain = LocalHost("gw2", tmp_path)
    plain.data = Data()
    host_lock.private_uploads(_State(), plain)  # no sudo: pyinfra uploads straight to the file
    assert not hasattr(plain.data, "_temp_dir")
