"""Every path and name setting is safe by construction.

Two layers, each attacked on its own:
* validation: shell and systemd metacharacters (``;``, ``$()``, backticks, a newline - which a
  ``$``-anchored pattern let through - ``%``, spaces, quotes) in every path and name setting are
  refused with one line naming the field, before anything runs;
* quoting at use: commands the operations build from a path that got past validation anyway
  (``Settings.model_construct`` skips it) still pass it as one word and run nothing extra.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import StringCommand

from freetoken_infra.core.layout import CUDA_PROFILE_FILE
from freetoken_infra.core.settings import Settings, SettingsError, build_settings
from tests.unit.fakehost import FakeHost

PATH_FIELDS = ["engine_base_dir", "model_dir", "cuda_home", "state_dir", "config_dir", "cache_dir", "hub_token_file"]
NAME_FIELDS = [
    "engine_package",
    "engine_version",
    "model_repo",
    "model_revision",
    "service_user",
    "wslconfig_memory",
    "wslconfig_swap",
    "wsl_min_version",
    "launch_moe_cpu_layers",
    "model_cache_host",
]
LIST_NAME_FIELDS = ["engine_extras", "cuda_packages"]

# Each one ran a command as root, split a unit line or broke the .wslconfig merge.
HOSTILE_SUFFIXES = [
    ";id",
    "$(id)",
    "`id`",
    "\n",
    "\nExecStartPre=/bin/id",
    "%h",
    " x",
    "'",
    '"',
    "\\",
    "|id",
    "&id",
    ">x",
    "\t",
    "\0",
    "*",
]
GOOD = {
    "engine_base_dir": "/opt/freetoken",
    "model_dir": "/var/lib/freetoken/models/Qwen",
    "cuda_home": "/usr/local/cuda-13.0",
    "state_dir": "/var/lib/freetoken",
    "config_dir": "/etc/freetoken",
    "cache_dir": "/var/cache/freetoken",
    "hub_token_file": "/etc/freetoken/hub-token",
    "engine_package": "freetoken",
    "engine_version": "0.2.1",
    "model_repo": "nvidia/Qwen3.6-35B-A3B-NVFP4",
    "model_revision": "main",
    "service_user": "freetoken",
    "wslconfig_memory": "24GB",
    "wslconfig_swap": "4GB",
    "wsl_min_version": "2.7.13",
    "launch_moe_cpu_layers": "auto",
    "model_cache_host": "ws1",
}


def _refused(data: dict[str, Any], field: str) -> str:
    with pytest.raises(SettingsError) as exc:
        build_settings("ws1", data)
    (line,) = exc.value.problems
    assert line.startswith(f"host ws1: setting '{field}' = ") and "is invalid" in line, line
    return line


@pytest.mark.parametrize("field", PATH_FIELDS + NAME_FIELDS)
@pytest.mark.parametrize("suffix", HOSTILE_SUFFIXES, ids=repr)
def test_metacharacters_in_every_path_and_name_setting_are_refused(field, suffix):
    assert build_settings("ws1", {field: GOOD[field]})  # the good value itself passes
    line = _refused({field: GOOD[field] + suffix}, field)
    assert "\n" not in line  # the bad value is shown escaped: one line per problem


@pytest.mark.parametrize("field", LIST_NAME_FIELDS)
@pytest.mark.parametrize("suffix", HOSTILE_SUFFIXES, ids=repr)
def test_metacharacters_in_list_settings_are_refused(field, suffix):
    good = Settings().model_dump()[field]
    _refused({field: [*good[:-1], good[-1] + suffix]}, field)


@pytest.mark.parametrize("field", PATH_FIELDS)
@pytest.mark.parametrize("bad", ["relative/dir", "/opt/../etc", "/opt/./x", "", "/opt/x\n"], ids=repr)
def test_paths_must_be_normalised_absolute(field, bad):
    _refused({field: bad}, field)


@pytest.mark.parametrize("field", PATH_FIELDS)
def test_paths_are_normalised(field):
    assert getattr(build_settings("ws1", {field: "/srv//freetoken/x/"}), field) == "/srv/freetoken/x"


@pytest.mark.parametrize(
    "bad", ["file:/keys/a;id", "file:/keys/a\n", "file:relative", "env:KEY\n", "env:KEY;id", "generate\n"], ids=repr
)
def test_api_key_source_is_matched_as_a_whole(bad):
    _refused({"api_key_source": bad}, "api_key_source")


# --------------------------------------------------------------------------- quoting at use


def shell_commands(host: FakeHost, op: Any, **kwargs: Any) -> list[str]:
    """The shell commands ``op`` yields on ``host`` (uploads left out: they run no shell)."""
    return [
        c if isinstance(c, str) else c.get_raw_value()
        for c in host.yielded(op, **kwargs)
        if isinstance(c, (str, StringCommand))
    ]


def hostile_paths(tmp_path: Path) -> list[str]:
    """Paths (under tmp_path) whose injection, if it ran, writes a file beside them."""
    m = tmp_path / "injected"
    return [
        f"{tmp_path}/a;echo x>{m}1;#",
        f"{tmp_path}/b$(echo x>{m}2)",
        f"{tmp_path}/c`echo x>{m}3`",
        f"{tmp_path}/d\necho x>{m}4",
        f"{tmp_path}/e f|echo x>{m}5",
    ]


def run_with_stubs(tmp_path: Path, command: str) -> list[list[str]]:
    """Run `command` with sh, every program on PATH a stub that records its argv."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    log = tmp_path / "argv.log"
    log.unlink(missing_ok=True)
    for name in ("python3", "dpkg", "grep", "mkdir", "chmod", "chown", "pip", "sh"):
        stub = stubs / name
        stub.write_text(f'#!/bin/bash\n{{ printf "%s\\0" "$0" "$@"; printf "\\n"; }} >> "{log}"\n')
        stub.chmod(0o755)
    subprocess.run(["/bin/sh", "-c", command], env={"PATH": str(stubs)}, cwd=tmp_path, capture_output=True, timeout=30)
    if not log.exists():
        return []
    return [line.split("\0") for line in log.read_text().split("\0\n") if line]


def assert_nothing_injected(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("injected*")), "an injected command ran"


def test_engine_environment_commands_pass_the_path_as_one_word(tmp_path):
    from operations.engine import environment, pip_conf

    class Install:
        versions: dict[str, str] = {}

    for base in hostile_paths(tmp_path):
        s = Settings.model_construct(**{**Settings().model_dump(), "engine_base_dir": base})
        host = FakeHost(files={f"{base}/0.2.1/pip.conf": pip_conf(s)}, facts={"EngineInstall": Install()})
        commands = shell_commands(host, environment, settings=s, activate=False)
        assert any("-m venv" in c for c in commands) and any(" install " in c for c in commands)
        for command in commands:
            calls = run_with_stubs(tmp_path, command)
            if "-m venv" in command:
                assert calls == [[str(tmp_path / "stubs" / "python3"), "-m", "venv", f"{base}/0.2.1"]]
            if " install " in command:  # the venv's pip does not exist: sh says so, runs nothing
                assert calls == []
        assert_nothing_injected(tmp_path)


def test_cuda_commands_and_profile_pass_cuda_home_as_one_word(tmp_path):
    from operations.cuda import profile_text, toolkit

    class Toolchain:
        nvcc: list[Any] = []

    for home in hostile_paths(tmp_path):
        s = Settings.model_construct(**{**Settings().model_dump(), "cuda_home": home})
        host = FakeHost(
            files={CUDA_PROFILE_FILE: profile_text(s)}, packages=s.cuda_packages, facts={"CudaToolchain": Toolchain()}
        )
        (command,) = shell_commands(host, toolkit, settings=s, gpu_arch="compute_120")
        calls = run_with_stubs(tmp_path, command)
        assert [c[1:] for c in calls if c[0].endswith("/grep")] == [["-qx", "--", "compute_120"]]
        # The profile is sourced by login shells: CUDA_HOME is exactly the value, nothing ran.
        profile = tmp_path / "profile.sh"
        profile.write_text(profile_text(s))
        out = subprocess.run(
            ["/bin/sh", "-c", f'. "{profile}"; printf %s "$CUDA_HOME"'],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=30,
        )
        assert out.stdout == home
        assert_nothing_injected(tmp_path)
