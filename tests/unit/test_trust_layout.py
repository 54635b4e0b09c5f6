"""Root makes and re-owns the deploy's folders without following a link, leaves folders it did
not create as they are, and installs the CUDA keyring only from a fresh root-only folder.

The attacks: a less-trusted user's folder swapped for a link (planted before the run, and swapped
back and forth while it runs) aimed at a root-owned folder or file; a hard link to a root file
inside the tree being re-owned; a setting under a folder another user owns; a keyring package
planted where the old code took it from. ``own_dir.py`` runs as a real process (as root: it
changes owners), the keyring command in a real shell with stand-in ``curl`` and ``dpkg``.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from facts.ownership import DirOwnership, components
from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from operations import cuda, ownership
from operations.service import engine_unit

SCRIPT = Path(__file__).resolve().parents[2] / "operations" / "scripts" / "own_dir.py"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="own_dir.py changes owners: it runs as root")
OLD = "daemon"  # the "engine's user" of these tests
NEW = "nobody"  # the "download's user"
NEW_GROUP = "nogroup"


def own_dir(path: Path | str, *extra: str, owner: str = NEW, group: str = NEW_GROUP, mode: str = "755"):
    argv = [sys.executable, str(SCRIPT), "--path", str(path), "--owner", owner, "--group", group, "--mode", mode]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=60)


def owner_mode(path: Path) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    # A root-owned folder above the tests' trees: /tmp's own mode must not matter.
    os.chmod(tmp_path, 0o755)
    return tmp_path


@pytest.fixture
def root_target(base: Path) -> Path:
    """What the attacker aims at: a root folder with a file, both with known modes."""
    target = base / "etc-like"
    target.mkdir(mode=0o700)
    (target / "shadow").write_text("secret\n")
    os.chmod(target / "shadow", 0o600)
    return target


# --------------------------------------------------------------------------- links


@needs_root
def test_a_leaf_swapped_for_a_link_is_refused_and_its_target_untouched(base, root_target):
    parent = base / "state"
    parent.mkdir()
    (parent / "models").symlink_to(root_target)
    before = owner_mode(root_target)
    run = own_dir(parent / "models")
    assert run.returncode == 3, run
    assert "is a symbolic link; root does not follow or replace it" in run.stderr
    assert f"{parent}/models" in run.stderr
    assert owner_mode(root_target) == before == (0, 0, 0o700)


@needs_root
def test_a_link_on_the_way_is_refused_and_nothing_is_made_behind_it(base, root_target):
    (base / "state").symlink_to(root_target)
    run = own_dir(base / "state" / "models" / "Qwen")
    assert run.returncode == 3 and f"{base}/state is a symbolic link" in run.stderr, run
    assert sorted(os.listdir(root_target)) == ["shadow"]
    assert owner_mode(root_target) == (0, 0, 0o700)


@needs_root
def test_a_folder_swapped_for_a_link_while_root_works_never_aims_root(base, root_target):
    """The race: the folder is swapped for a link and back as fast as the attacker
    can, while root re-owns and re-modes it, again and again. The old look-then-chmod by name
    re-moded the target whenever the swap fell between the two; this may never touch it."""
    state = base / "state"
    state.mkdir()
    folder = state / "models"
    folder.mkdir(mode=0o700)
    swapper = subprocess.Popen(
        [
            "sh",
            "-c",
            f"cd {state} && while :; do mv models real && ln -s {root_target} models; "
            "rm -f models; mv real models; done",
        ]
    )
    try:
        outcomes = set()
        deadline = time.monotonic() + 4
        n = 0
        while time.monotonic() < deadline or n < 20:
            run = own_dir(folder)
            outcomes.add(run.returncode)
            assert owner_mode(root_target) == (0, 0, 0o700), f"run {n}: root re-owned the link's target"
            assert owner_mode(root_target / "shadow") == (0, 0, 0o600)
            n += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert outcomes <= {0, 1, 3}, outcomes  # done, or refused (a link or a vanished name)


# --------------------------------------------------------------------------- folders root did not create


@needs_root
def test_existing_folders_above_the_leaf_keep_their_owner_and_mode(base):
    home = base / "home" / "bob"
    home.mkdir(parents=True)
    os.chown(home, 1234, 1234)
    os.chmod(home, 0o750)
    run = own_dir(home / "models" / "Qwen")
    assert run.returncode == 0, run
    assert owner_mode(home) == (1234, 1234, 0o750)  # bob's, as it was
    assert owner_mode(home / "models") == (0, 0, 0o755)  # made by root for root
    nobody = pwd.getpwnam(NEW)
    assert owner_mode(home / "models" / "Qwen") == (nobody.pw_uid, nobody.pw_gid, 0o755)
    again = own_dir(home / "models" / "Qwen")
    assert again.returncode == 0 and again.stdout == "", again  # a second run changes nothing


@needs_root
def test_a_folder_above_that_an_old_layout_gave_the_engine_goes_back_to_root(base):
    old = pwd.getpwnam(OLD)
    state = base / "state"
    (state / "models").mkdir(parents=True)
    for p in (state, state / "models"):
        os.chown(p, old.pw_uid, old.pw_gid)
    run = own_dir(state / "models" / "Qwen", "--reclaim", OLD, "--reclaim", "no-such-user-x")
    assert run.returncode == 0, run
    assert owner_mode(state) == owner_mode(state / "models") == (0, 0, 0o755)


# --------------------------------------------------------------------------- migration


@needs_root
def test_adopt_reowns_the_old_users_model_without_following_links(base, root_target):
    old, new = pwd.getpwnam(OLD), pwd.getpwnam(NEW)
    model = base / "state" / "models" / "Qwen"
    (model / "sub").mkdir(parents=True)
    (model / "weights.safetensors").write_bytes(b"w" * 100)
    (model / "sub" / "config.json").write_text("{}")
    os.chmod(model / "sub" / "config.json", 0o4666)
    os.link(root_target / "shadow", model / "hard")  # root's file, hard-linked in
    (model / "soft").symlink_to(root_target / "shadow")
    (model / "dirlink").symlink_to(root_target)
    for p in (model, model / "sub", model / "weights.safetensors", model / "sub" / "config.json"):
        os.lchown(p, old.pw_uid, old.pw_gid)
    for p in (model / "soft", model / "dirlink"):
        os.lchown(p, old.pw_uid, old.pw_gid)
    mtime = os.stat(model / "weights.safetensors").st_mtime_ns
    run = own_dir(model, "--adopt-from", OLD)
    assert run.returncode == 0, run
    for p in (model, model / "sub"):
        assert owner_mode(p) == (new.pw_uid, new.pw_gid, 0o755)
    assert owner_mode(model / "weights.safetensors")[:2] == (new.pw_uid, new.pw_gid)
    assert owner_mode(model / "sub" / "config.json") == (new.pw_uid, new.pw_gid, 0o644)  # no set-id, no o+w
    assert os.stat(model / "weights.safetensors").st_mtime_ns == mtime  # the manifest still covers it
    assert owner_mode(root_target / "shadow") == (0, 0, 0o600)
    assert owner_mode(root_target) == (0, 0, 0o700)
    assert os.lstat(model / "soft").st_uid == old.pw_uid  # a link is left as it is, never followed
    again = own_dir(model, "--adopt-from", OLD)
    assert again.returncode == 0 and again.stdout == "", again


# --------------------------------------------------------------------------- the fact and the decision


def test_the_fact_reads_every_component_and_the_decision_follows_it(tmp_path):
    fact = DirOwnership()
    cmd = fact.command("/var/lib/freetoken/models/Q", adopt_from="freetoken")
    assert "find -P /var/lib/freetoken/models/Q -mindepth 1 -user freetoken" in cmd
    assert components("/var/lib/x") == ["/var", "/var/lib", "/var/lib/x"]
    out = [
        "@root|root|755|directory|/var",
        "@root|root|755|directory|/var/lib",
        "@freetoken|freetoken|755|directory|/var/lib/freetoken",
        "@freetoken|freetoken|755|directory|/var/lib/freetoken/models",
        "@freetoken-fetch|freetoken-fetch|755|directory|/var/lib/freetoken/models/Q",
    ]
    tree = fact.process(out)
    path, who = "/var/lib/freetoken/models/Q", ("freetoken", "freetoken-fetch")
    assert ownership.needs_change(tree, path, "freetoken-fetch", "freetoken-fetch", "755", who)
    fixed = fact.process([line.replace("@freetoken|freetoken|", "@root|root|") for line in out])
    assert not ownership.needs_change(fixed, path, "freetoken-fetch", "freetoken-fetch", "755", who)
    assert ownership.needs_change(fact.process([*out[:4]]), path, "x", "x", "755")  # leaf missing
    link = fact.process([*out[:4], "@freetoken|freetoken|777|symbolic link|/var/lib/freetoken/models/Q"])
    assert ownership.needs_change(link, path, "freetoken", "freetoken", "755")  # the script refuses it
    adopt = fact.process([line.replace("@freetoken|freetoken|", "@root|root|") for line in out] + ["@@adopt"])
    assert ownership.needs_change(adopt, path, "freetoken-fetch", "freetoken-fetch", "755", who)
    # A folder above owned by another user (a setting under /home/bob) is not a change to make.
    bob = fact.process(
        ["@root|root|755|directory|/home", "@bob|bob|750|directory|/home/bob", "@x|x|755|directory|/home/bob/m"]
    )
    assert not ownership.needs_change(bob, "/home/bob/m", "x", "x", "755", who)


def test_the_script_command_is_quoted_words():
    argv = ownership.own_dir_argv(
        "/opt/models/Q", "freetoken-fetch", "freetoken-fetch", "755", ["freetoken"], "freetoken"
    )
    assert argv[:2] == ["/usr/bin/python3", "/usr/local/lib/freetoken/own_dir.py"]
    assert argv[-4:] == ["--reclaim", "freetoken", "--adopt-from", "freetoken"]


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"model_dir": "/var/cache/freetoken/models/Q"}, "model_dir", "is inside cache_dir (/var/cache/freetoken)"),
        ({"model_dir": "/var/cache/freetoken"}, "model_dir", "is inside cache_dir"),
        ({"cache_dir": "/srv/m/Q/cache", "model_dir": "/srv/m/Q"}, "cache_dir", "is inside model_dir (/srv/m/Q)"),
        ({"state_dir": "/var/cache/freetoken/state"}, "state_dir", "is inside cache_dir"),
        ({"config_dir": "/var/cache/freetoken/etc"}, "config_dir", "is inside cache_dir"),
        ({"hub_token_file": "/var/cache/freetoken/token"}, "hub_token_file", "is inside cache_dir"),
        ({"model_dir": "/var/lib/freetoken/model-fetch/Q"}, "model_dir", "overlaps state_dir"),
        ({"fetch_user": "freetoken"}, "fetch_user", "must differ from service_user"),
        ({"cache_user": "freetoken"}, "cache_user", "must differ from service_user and fetch_user"),
        ({"cache_user": "freetoken-fetch"}, "cache_user", "must differ from service_user and fetch_user"),
        ({"fetch_user": "root"}, "fetch_user", "non-root system user"),
        ({"fetch_user": "a;id"}, "fetch_user", "non-root system user"),
    ],
)
def test_a_layout_where_root_would_act_inside_a_users_tree_is_refused_naming_the_field(data, field, words):
    with pytest.raises(SettingsError) as exc:
        build_settings("ws1", data)
    (line,) = exc.value.problems
    assert line.startswith(f"host ws1: setting '{field}' = ") and words in line, line


@pytest.mark.parametrize("model_dir", ["/var/lib/models/Q", "/opt/models/Q", "/home/dev/Q", "/srv/Q"])
def test_model_dirs_under_system_folders_are_accepted(model_dir):
    assert build_settings("ws1", {"model_dir": model_dir}).model_dir == model_dir


# --------------------------------------------------------------------------- the engine's unit


def test_the_engine_writes_only_its_cache_and_sees_no_other_users_processes():
    s = Settings()
    unit = engine_unit(s, derive_plan(s, 16311, (12, 0)))
    lines = unit.splitlines()
    assert "ReadWritePaths=/var/cache/freetoken" in lines
    assert "WorkingDirectory=/var/cache/freetoken" in lines
    assert "ProtectProc=invisible" in lines
    assert not any(line.startswith("ReadWritePaths=") and s.state_dir in line for line in lines)


# --------------------------------------------------------------------------- the CUDA keyring


def test_the_keyring_is_fetched_into_a_fresh_root_only_folder_never_a_planted_file(tmp_path):
    """The old step downloaded to /var/cache/freetoken/cuda-keyring.deb, in the engine's writable
    cache, and skipped the download when a file was already there: a planted package was
    installed by root. Now: stand-ins for curl and dpkg record what is installed, and a package
    planted at the old path (and in /tmp) is never the one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "dpkg.log"
    (bin_dir / "curl").write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\nprintf good > "$2"\n')
    (bin_dir / "dpkg").write_text(
        f'#!/bin/sh\nd=$(dirname "$2"); printf "%s %s %s\\n" "$2" "$(stat -c %a "$d")" "$(cat "$2")" > {log}\n'
    )
    for f in ("curl", "dpkg"):
        os.chmod(bin_dir / f, 0o755)
    planted = tmp_path / "var-cache-freetoken"
    planted.mkdir()
    (planted / "cuda-keyring.deb").write_text("planted")
    command = cuda.keyring_install_command(Settings())
    assert "/var/cache" not in command
    run = subprocess.run(
        ["sh", "-c", command],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run
    installed, mode, content = log.read_text().split()
    assert content == "good" and mode == "700"
    assert not Path(installed).exists() and not Path(installed).parent.exists()  # removed after dpkg -i
    # A failed download installs nothing and still removes its folder.
    (bin_dir / "curl").write_text("#!/bin/sh\nexit 22\n")
    log.unlink()
    run = subprocess.run(["sh", "-c", command], env={"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    assert run.returncode == 22 and not log.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "var-cache-freetoken"]
