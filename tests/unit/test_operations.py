"""Pure parts of the operations: the .wslconfig merge, the apt pin, the unit file."""

import re
import subprocess

import pytest

from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.settings import DRIVER_PACKAGE_GLOBS, Settings
from freetoken_infra.core.wsl_ini import WSLCONF
from operations.cuda import pin_text, sources_line
from operations.engine import pip_conf
from operations.service import engine_environment, engine_unit
from operations.windows import merge_ini

USER_FILE = b"# my own settings - keep this comment\r\n[wsl2]\r\nMemory=16GB\r\nguiApplications=false\r\n"
WANT = Settings().wslconfig_values()


def test_wslconfig_merge_keeps_the_users_comment_keys_spelling_and_crlf():
    merged = merge_ini(USER_FILE, "wsl2", WANT)
    text = merged.decode()
    assert text.startswith("# my own settings - keep this comment\r\n[wsl2]\r\n")
    assert "Memory=24GB\r\n" in text and "memory=" not in text  # the user's spelling
    assert "guiApplications=false\r\n" in text
    assert "vmIdleTimeout=0\r\n" in text and "localhostForwarding=true\r\n" in text
    assert "\n" not in text.replace("\r\n", "")


def test_wslconfig_merge_is_idempotent():
    once = merge_ini(USER_FILE, "wsl2", WANT)
    assert merge_ini(once, "wsl2", WANT) == once


def test_utf16_notepad_file_stays_utf16():
    notepad = b"\xff\xfe" + USER_FILE.decode().encode("utf-16-le")
    merged = merge_ini(notepad, "wsl2", WANT)
    assert merged.startswith(b"\xff\xfe")
    assert "vmIdleTimeout=0" in merged[2:].decode("utf-16-le")


def test_wsl_conf_gets_a_boot_section_beside_the_users():
    merged = merge_ini(b"[network]\nhostname=ws1\n", "boot", {"systemd": "true"}, WSLCONF)
    assert merged == b"[network]\nhostname=ws1\n\n[boot]\nsystemd=true\n"
    assert merge_ini(None, "boot", {"systemd": "true"}, WSLCONF) == b"[boot]\nsystemd=true\n"


def test_pin_blocks_every_driver_package_and_nothing_we_install():
    text = pin_text()
    assert "Pin-Priority: -1" in text
    globs = re.search(r"^Package: (.*)$", text, re.M).group(1).split()
    assert tuple(globs) == DRIVER_PACKAGE_GLOBS
    from fnmatch import fnmatchcase

    for name in (
        "cuda-drivers",
        "cuda-drivers-580",
        "nvidia-driver-580-open",
        "cuda-13-0",
        "cuda",
        "libnvidia-compute-580",
    ):
        assert any(fnmatchcase(name, g) for g in globs), name
    for name in Settings().cuda_packages + ["cuda-keyring"]:
        assert not any(fnmatchcase(name, g) for g in globs), name


def test_sources_line_uses_the_configured_repository():
    s = Settings(cuda_repo_url="http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64/")
    assert sources_line(s) == (
        "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
        "http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64/ /\n"
    )


def test_pip_conf_carries_mirrors():
    s = Settings(pip_index_url="http://10.213.0.1:8083/simple", pip_extra_index_urls=["http://m.example/simple"])
    assert "index-url = http://10.213.0.1:8083/simple" in pip_conf(s)
    assert "extra-index-url = http://m.example/simple" in pip_conf(s)
    assert "index-url" not in pip_conf(Settings())


def test_unit_runs_hardened_as_the_service_user_and_never_carries_the_key():
    s = Settings()
    unit = engine_unit(s, derive_plan(s, 16311, (12, 0)))
    for line in (
        "User=freetoken",
        "Restart=on-failure",
        "RestartForceExitStatus=SIGTERM",
        "TimeoutStartSec=300",
        "NoNewPrivileges=yes",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/dxg rw",
        "EnvironmentFile=/etc/freetoken/engine.env",
        "EnvironmentFile=/etc/freetoken/api-key.env",
        "ExecStartPre=/usr/bin/python3 /usr/local/lib/freetoken/fetch_model.py --check --repo nvidia/Qwen3.6-35B-A3B-NVFP4 "
        "--revision main --dest /var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia",
        "WantedBy=multi-user.target",
    ):
        assert line in unit.splitlines(), line
    assert "--moe-cache-size 256 --num-tokens 4096" in unit
    assert "API_KEY" not in unit.split("ExecStart=")[1].splitlines()[0]


def test_unit_file_is_valid_for_systemd_analyze(tmp_path):
    analyze = subprocess.run(["which", "systemd-analyze"], capture_output=True, text=True).stdout.strip()
    if not analyze:
        pytest.skip("systemd-analyze not installed (systemd package); the fleet tests load the unit for real")
    s = Settings()
    path = tmp_path / "freetoken.service"
    path.write_text(engine_unit(s, derive_plan(s, 16311, (12, 0))))
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    assert "Unknown key" not in out.stderr and "Unknown section" not in out.stderr, out.stderr


def test_environment_has_persistent_kernel_caches_and_hub_settings():
    env = dict(line.split("=", 1) for line in engine_environment(Settings()).splitlines())
    assert env["CUDA_HOME"] == "/usr/local/cuda-13.0"
    assert env["TVM_FFI_CACHE_DIR"].startswith("/var/cache/freetoken/")
    assert env["TRITON_CACHE_DIR"].startswith("/var/cache/freetoken/")
    assert env["HF_HUB_DISABLE_XET"] == "1" and env["LOG_LEVEL"] == "INFO"
    assert not any("KEY" in k for k in env)


def _odd_path_settings(tmp_path):
    """Paths with what systemd would expand (``%i``, ``$HOME``) and a space in them. Settings
    refuse such paths; built past validation here to prove the unit file escapes every
    word all the same (quoting at use, not only validation)."""
    base = tmp_path / "engines 100%i $HOME"
    python = base / "active" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    return Settings.model_construct(
        **{
            **Settings().model_dump(),
            "engine_base_dir": str(base),
            "model_dir": str(tmp_path / "models %n $USER" / "Qwen"),
        }
    )


def test_unit_escapes_every_exec_word_for_systemd(tmp_path):
    import shlex

    s = _odd_path_settings(tmp_path)
    plan = derive_plan(s, 16311, (12, 0))
    unit = engine_unit(s, plan)
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    words = shlex.split(exec_start[len("ExecStart=") :])  # systemd's quoting, as a shell reads it
    # systemd's own rules: %% is a literal %, $$ a literal $ in an argument; the executable
    # path has specifiers but no variables.
    argv = [words[0].replace("%%", "%")] + [w.replace("%%", "%").replace("$$", "$") for w in words[1:]]
    from freetoken_infra.core.launch import engine_command

    assert argv == engine_command(s, plan)
    assert "$$HOME" not in words[0] and "%%i" in words[0]
    assert "--model-path" in words and "%%n $$USER" in words[words.index("--model-path") + 1]


def test_unit_with_odd_paths_is_what_systemd_analyze_runs(tmp_path):
    analyze = subprocess.run(["which", "systemd-analyze"], capture_output=True, text=True).stdout.strip()
    if not analyze:
        pytest.skip("systemd-analyze not installed (systemd package); the escaping rules are checked above")
    s = _odd_path_settings(tmp_path)
    path = tmp_path / "freetoken.service"
    path.write_text(engine_unit(s, derive_plan(s, 16311, (12, 0))))
    out = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True)
    # systemd resolves the executable as it would start it: a wrong escape names another path.
    assert "is not executable" not in out.stderr and "specifier" not in out.stderr, out.stderr
