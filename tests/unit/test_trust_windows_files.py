"""Root's reads and writes below the drive root never follow what a Linux account planted there.

Under DrvFs' default mount options every file below ``/mnt/c`` is 0777 and owned by uid 1000:
every Linux account, the engine's user too, can create, replace and link files in the owner's
profile folder and Desktop. A temporary folder stands in for the drive; the attacks are planted
files (a link to a secret, a link as a parent folder, a FIFO, a folder, a huge file, a link at a
shortcut's name or at the temporary name). The host-side code runs as the hosts run it: the
facts' commands under ``sh`` (``python3 -c`` with ``hostio``'s source) and ``windows_file.py``
with ``hostio.py`` beside it; the operations' commands come from the fake host.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from facts.inputs import inputs_of
from facts.windows import (
    RESUME_SHORTCUT,
    SNOOZE_SHORTCUT,
    IniFileInfo,
    OwnerShortcuts,
    WindowsFile,
    WslConfigFile,
)
from freetoken_infra.core.layout import HOSTIO_MODULE, WINDOWS_FILE_SCRIPT
from freetoken_infra.core.settings import Settings
from operations import owner as owner_op
from operations import windows
from tests.unit.fakehost import FakeHost
from tests.unit.test_rules import healthy

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"root:$y$j9T$SECRET-HASH-5f0c:19700:0:99999:7:::\n"
MINE = b"# mine\r\n[wsl2]\r\nmemory=3GB\r\n"


def sh(command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=timeout)


def fact_answer(fact, **kwargs):
    """The fact's command run under sh as on a host, its raw output and its answer."""
    run = sh(fact.command(**kwargs))
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr, fact.process(run.stdout.splitlines())


def appears(secret: bytes, text: str) -> bool:
    """The secret, or its base64 (as a fact's output carries bytes), in ``text``."""
    return secret.decode() in text or base64.b64encode(secret).decode() in text.replace("\n", "")


@pytest.fixture
def drive(tmp_path):
    """A stand-in for /mnt/c: Users/dev (the profile) with its Desktop, a root-only secret beside."""
    profile = tmp_path / "c" / "Users" / "dev"
    (profile / "Desktop").mkdir(parents=True)
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    assert os.path.realpath(tmp_path) == str(tmp_path), "the test's own folder must have no link on the way"
    return profile, secret


@pytest.fixture
def lib(tmp_path):
    """``windows_file.py`` with ``hostio.py`` beside it, as uploaded under /usr/local/lib/freetoken."""
    folder = tmp_path / "lib"
    folder.mkdir()
    shutil.copy(ROOT / "operations" / "scripts" / "windows_file.py", folder / "windows_file.py")
    shutil.copy(ROOT / "freetoken_infra" / "core" / "hostio.py", folder / "hostio.py")
    return folder


def run_on_this_machine(commands: list[str], lib: Path) -> subprocess.CompletedProcess[str]:
    """The operation's commands as the host runs them, the script from ``lib``; uploads of the
    script and its module are what ``lib`` already holds."""
    shell = [c for c in commands if not c.startswith("upload ")]
    assert [c for c in commands if c.startswith("upload ")] == [
        f"upload {HOSTIO_MODULE}",
        f"upload {WINDOWS_FILE_SCRIPT}",
    ]
    return sh("; ".join(c.replace(WINDOWS_FILE_SCRIPT, str(lib / "windows_file.py")) for c in shell))


# --------------------------------------------------------------------------- reads


def test_a_link_as_wslconfig_to_a_secret_is_refused_and_its_bytes_appear_nowhere(drive):
    profile, secret = drive
    wslconfig = profile / ".wslconfig"
    wslconfig.symlink_to(secret)
    out, seen = fact_answer(WindowsFile(), path=str(wslconfig))
    assert (seen.data, seen.kind) == (None, "link")
    assert seen.refused == f"{wslconfig} is a symbolic link"
    assert not appears(SECRET, out)
    out, info = fact_answer(WslConfigFile(), path=str(wslconfig))
    assert info.refused == f"{wslconfig} is a symbolic link" and info.sections == {}
    assert not appears(SECRET, out)
    # The merge writes nothing: the run names the path and why, the link and the secret stay.
    host = FakeHost(facts={"WindowsFile": lambda path: fact_answer(WindowsFile(), path=path)[1]})
    assert host.commands(windows.ini_values, str(wslconfig), "wsl2", Settings().wslconfig_values()) == []
    (noop,) = host.noops
    assert str(wslconfig) in noop and "is a symbolic link" in noop and not appears(SECRET, noop)
    assert wslconfig.is_symlink() and os.readlink(wslconfig) == str(secret)
    assert secret.read_bytes() == SECRET


def test_a_link_as_a_parent_folder_is_refused_for_reads_and_writes(drive, lib, tmp_path):
    profile, _ = drive
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".wslconfig").write_bytes(SECRET)
    moved = profile.with_name("dev.real")
    profile.rename(moved)
    profile.symlink_to(elsewhere)  # Users/dev -> elsewhere
    out, seen = fact_answer(WindowsFile(), path=str(profile / ".wslconfig"))
    assert seen.refused == f"{profile} is a symbolic link, not a folder" and seen.data is None
    assert not appears(SECRET, out)
    _, shortcuts = fact_answer(OwnerShortcuts(), path=str(profile / "Desktop"))
    assert shortcuts.desktop_refused == f"{profile} is a symbolic link, not a folder" and not shortcuts.files
    run = sh(f"printf %s {base64.b64encode(MINE).decode()} | python3 {lib}/windows_file.py write {profile}/.wslconfig")
    assert run.returncode == 3, run
    assert f"{profile} is a symbolic link" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert (elsewhere / ".wslconfig").read_bytes() == SECRET and sorted(os.listdir(elsewhere)) == [".wslconfig"]


def test_a_fifo_as_wslconfig_is_refused_promptly(drive):
    profile, _ = drive
    fifo = profile / ".wslconfig"
    os.mkfifo(fifo)
    # No writer ever opens it: a reader that opened it blocking would hang here (timeout fails).
    run = subprocess.run(["sh", "-c", WindowsFile().command(str(fifo))], capture_output=True, text=True, timeout=20)
    seen = WindowsFile().process(run.stdout.splitlines())
    assert (seen.refused, seen.kind) == (f"{fifo} is a FIFO", "fifo")


def test_a_folder_as_wslconfig_is_refused(drive):
    profile, _ = drive
    (profile / ".wslconfig").mkdir()
    _, seen = fact_answer(WindowsFile(), path=str(profile / ".wslconfig"))
    assert (seen.refused, seen.kind) == (f"{profile}/.wslconfig is a folder", "folder")


def test_an_oversize_wslconfig_is_refused_not_truncated_and_does_not_flood(drive):
    profile, _ = drive
    big = profile / ".wslconfig"
    big.write_bytes(b"[wsl2]\r\n" + b"#" * (5 * 1024 * 1024 - 8))
    out, seen = fact_answer(WindowsFile(), path=str(big))
    assert seen.refused == f"{big} is 5.0 MiB, over the 64 KiB cap" and seen.data is None
    assert len(out) < 16 * 1024
    _, info = fact_answer(WslConfigFile(), path=str(big))
    assert info.refused == seen.refused
    # the cap itself is read whole
    big.write_bytes(b"#" * (64 * 1024))
    assert fact_answer(WindowsFile(), path=str(big))[1].data == b"#" * (64 * 1024)


def test_a_plain_wslconfig_is_read_byte_for_byte_and_a_missing_one_is_absent(drive):
    profile, _ = drive
    _, seen = fact_answer(WindowsFile(), path=str(profile / ".wslconfig"))
    assert (seen.data, seen.refused) == (None, None)
    (profile / ".wslconfig").write_bytes(MINE)
    _, seen = fact_answer(WindowsFile(), path=str(profile / ".wslconfig"))
    assert (seen.data, seen.refused) == (MINE, None)
    _, info = fact_answer(WslConfigFile(), path=str(profile / ".wslconfig"))
    assert info.exists and info.sections["wsl2"]["memory"] == "3GB"


# --------------------------------------------------------------------------- writes


def test_the_merge_of_wslconfig_is_written_by_rename_through_the_script(drive, lib):
    profile, _ = drive
    wslconfig = profile / ".wslconfig"
    wslconfig.write_bytes(MINE)
    host = FakeHost(facts={"WindowsFile": lambda path: fact_answer(WindowsFile(), path=path)[1]})
    commands = host.commands(windows.ini_values, str(wslconfig), "wsl2", Settings().wslconfig_values())
    assert f"upload {wslconfig}" not in commands  # never pyinfra's put, which follows a link
    inode = wslconfig.stat().st_ino
    run = run_on_this_machine(commands, lib)
    assert run.returncode == 0, run.stderr
    after = wslconfig.read_bytes()
    assert after.startswith(b"# mine\r\n[wsl2]\r\n") and b"memory=3GB" not in after
    assert wslconfig.stat().st_ino != inode  # a new file, renamed over the name
    assert sorted(os.listdir(profile)) == [".wslconfig", "Desktop"]  # no temporary file left


def test_a_link_planted_at_a_shortcut_is_replaced_and_its_target_untouched(drive, lib, tmp_path):
    profile, _ = drive
    desktop = profile / "Desktop"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"VICTIM\n")
    (desktop / RESUME_SHORTCUT).symlink_to(victim)
    texts = owner_op.shortcut_texts("Debian")
    (desktop / SNOOZE_SHORTCUT).write_bytes(texts[SNOOZE_SHORTCUT])  # already right: not written

    def shortcuts(path):
        seen = fact_answer(OwnerShortcuts(), path=path)[1]
        assert seen.refused == {RESUME_SHORTCUT: (f"{desktop}/{RESUME_SHORTCUT} is a symbolic link", "link")}
        return type(seen)(seen.desktop_exists, "Debian", seen.files, seen.refused, seen.desktop_refused)

    host = FakeHost(facts={"WindowsUserProfile": _profile(profile), "OwnerShortcuts": shortcuts})
    commands = host.commands(_desktop_shortcuts)
    assert len([c for c in commands if "windows_file.py write" in c]) == 1
    run = run_on_this_machine(commands, lib)
    assert run.returncode == 0, run.stderr
    written = desktop / RESUME_SHORTCUT
    assert not written.is_symlink() and written.read_bytes() == texts[RESUME_SHORTCUT]
    assert victim.read_bytes() == b"VICTIM\n"


def test_a_link_planted_as_the_temporary_name_makes_the_create_fail(drive, lib, tmp_path):
    profile, _ = drive
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"VICTIM\n")
    (profile / ".wslconfig").write_bytes(MINE)
    (profile / ".wslconfig.planted.tmp").symlink_to(victim)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import hostio\n"
        "try:\n    hostio.write_below(sys.argv[2], b'NEW', tmp_name='.wslconfig.planted.tmp')\n"
        "except FileExistsError:\n    print('refused: exists')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(lib), str(profile / ".wslconfig")], capture_output=True, text=True, timeout=30
    )
    assert run.stdout.strip() == "refused: exists", run
    assert victim.read_bytes() == b"VICTIM\n" and (profile / ".wslconfig").read_bytes() == MINE
    assert (profile / ".wslconfig.planted.tmp").is_symlink()


# --------------------------------------------------------------------------- what the run says


def test_the_preflight_warns_naming_the_refused_file_and_the_plan_writes_nothing():
    from freetoken_infra import rules

    why = "/mnt/c/Users/dev/.wslconfig is a symbolic link"
    info = IniFileInfo("/mnt/c/Users/dev/.wslconfig", True, {}, why, refused=why)
    obs = healthy(wslconfig=info)  # the rules' own healthy host
    finding = rules.check_wslconfig(Settings(), obs)
    assert finding.status == "warn" and not finding.deploy_fixes
    assert finding.evidence == f"{why}; root does not follow or replace it"
    # the fake host refuses a link on the way, as the host does: ini_values names it and writes nothing
    host = FakeHost(links={"/mnt/c/Users/dev": "/root"}, files={"/root/.wslconfig": MINE})
    assert host.commands(windows.ini_values, "/mnt/c/Users/dev/.wslconfig", "wsl2", {"memory": "24GB"}) == []
    assert host.noops == [
        "/mnt/c/Users/dev/.wslconfig left unchanged: /mnt/c/Users/dev is a symbolic link; "
        "root does not follow or replace it"
    ]


def test_the_deploy_gathers_a_refused_wslconfig_as_refused_and_its_plan_writes_nothing():
    from freetoken_infra import plan, preflight, rules

    wslconfig = "/mnt/c/Users/dev/.wslconfig"
    host = FakeHost(links={"/mnt/c/Users/dev": "/root"}, files={"/etc/wsl.conf": b"[boot]\nsystemd=true\n"})
    files, refused = preflight.windows_files(host, [wslconfig, "/etc/wsl.conf"])
    assert refused == {wslconfig: "/mnt/c/Users/dev is a symbolic link"} and files[wslconfig] is None
    assert ("FileBytes", {"path": wslconfig}) not in host.asked  # never the reader that follows links
    settings, obs = Settings(), healthy()
    pre = rules.HostPreflight(settings, obs, rules.evaluate(settings, obs))
    assert [t.changes for t in plan.windows_side(settings, pre, files, refused).targets] == [False, False]
    # the same bytes (none: absent) read without the refusal would be created
    assert [t.changes for t in plan.windows_side(settings, pre, files).targets] == [True, False]


def test_the_fast_check_knows_the_inputs_of_the_windows_file_fact():
    inputs = inputs_of("facts.windows:WindowsFile", {"path": "/mnt/c/Users/dev/.wslconfig"})
    assert inputs is not None and inputs.paths == {"/mnt/c/Users/dev/.wslconfig"}


# --------------------------------------------------------------------------- helpers


# desktop_shortcuts is a step of the agent's operation: the fake host runs it as one
_desktop_shortcuts = SimpleNamespace(_inner=lambda: owner_op.desktop_shortcuts(Settings(), "/mnt/"))


def _profile(profile: Path):
    from facts.windows import WindowsProfileInfo

    return WindowsProfileInfo(str(profile), "C:\\Users\\dev", None)


# --------------------------------------------------------------------------- enrol.py (root, on the PC)


def test_enrol_refuses_a_link_planted_as_wslconfig_and_writes_nothing(drive):
    sys.path.insert(0, str(ROOT / "operations" / "scripts"))
    import enrol

    from freetoken_infra.core import wsl_ini

    profile, secret = drive
    wslconfig = profile / ".wslconfig"
    wslconfig.symlink_to(secret)
    run = enrol.Run()
    with pytest.raises(enrol.EnrolError) as refused:
        enrol.merge_ini(
            enrol._wsl_ini(),
            str(wslconfig),
            wsl_ini.WSLCONFIG,
            "wsl2",
            {"networkingMode": "mirrored"},
            ".wslconfig",
            run,
            enrol._hostio(),
        )
    assert str(refused.value).startswith(f".wslconfig: {wslconfig} is a symbolic link; root does not follow")
    assert not appears(SECRET, str(refused.value))
    assert wslconfig.is_symlink() and secret.read_bytes() == SECRET
    assert sorted(os.listdir(profile)) == [".wslconfig", "Desktop"] and run.changed == []
    # a plain one is merged, by rename
    wslconfig.unlink()
    wslconfig.write_bytes(MINE)
    enrol.merge_ini(
        enrol._wsl_ini(),
        str(wslconfig),
        wsl_ini.WSLCONFIG,
        "wsl2",
        {"networkingMode": "mirrored"},
        ".wslconfig",
        run,
        enrol._hostio(),
    )
    assert wsl_ini.parse(wslconfig.read_bytes(), wsl_ini.WSLCONFIG).value("wsl2", "networkingMode") == "mirrored"
    assert run.changed and sorted(os.listdir(profile)) == [".wslconfig", "Desktop"]
