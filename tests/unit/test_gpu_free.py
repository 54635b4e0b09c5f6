"""operations/scripts/gpu_free.py, the engine's ExecStartPre: run as uploaded (the script and
core/gpu_room.py alone in a folder, the host's python3), against an nvidia-smi on PATH that
prints the real query format (tests/fixtures/real/nvidia-smi-580-h200-query-20g.txt's line)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken_infra.core import gpu_room
from freetoken_infra.core.launch import derive_plan, estimated_vram_gb
from freetoken_infra.core.settings import Settings
from operations.service import gpu_free_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def lib(tmp_path) -> Path:
    d = tmp_path / "lib"
    d.mkdir()
    shutil.copy(ROOT / "operations" / "scripts" / "gpu_free.py", d / "gpu_free.py")
    shutil.copy(ROOT / "freetoken_infra" / "core" / "gpu_room.py", d / "gpu_room.py")
    return d


def smi(tmp_path: Path, body: str) -> Path:
    """A bin folder whose nvidia-smi runs ``body`` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def check(lib: Path, bin_dir: Path | None, *args: str) -> subprocess.CompletedProcess:
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    return subprocess.run(
        [sys.executable, "-I", "-S", str(lib / "gpu_free.py"), *args],
        capture_output=True,
        text=True,
        cwd="/",
        env={"PATH": path},
        timeout=60,
    )


def query_line(total: int, used: int) -> str:
    return f"echo '{total}, {used}'"


def test_the_real_h200_with_20_gib_held_starts(tmp_path, lib):
    # the plan's need on that card: ~19.4 GB; 20.6 GiB held leaves 105.8
    run = check(lib, smi(tmp_path, query_line(143771, 21099)), "--need-gb", "19.43")
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_a_game_holding_the_card_stops_the_start_in_one_line(tmp_path, lib):
    run = check(lib, smi(tmp_path, query_line(16311, 12 * 1024)), "--need-gb", "5.68")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "gpu_free: 12.0 GiB of 15.9 GiB held by other processes (under WSL the owner's Windows apps and games); "
        "the plan needs ~5.7 GB, 2.3 left: not starting until they let go (systemd tries again after RestartSec)"
    ]


def test_the_plan_s_memory_ratio_is_the_engine_s_share(tmp_path, lib):
    bin_dir = smi(tmp_path, query_line(16311, 9 * 1024))
    assert check(lib, bin_dir, "--need-gb", "5.68").returncode == 1
    assert check(lib, bin_dir, "--need-gb", "5.68", "--ratio", "1.0").returncode == 0


@pytest.mark.parametrize(
    "body",
    [
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'; exit 9",
        "echo '[N/A], [N/A]'",
        "exit 0",
    ],
)
def test_an_unreadable_nvidia_smi_is_not_judged(tmp_path, lib, body):
    run = check(lib, smi(tmp_path, body), "--need-gb", "5.68")
    assert run.returncode == 0 and run.stderr.startswith("gpu_free: not judged (")


def test_no_nvidia_smi_is_not_judged(lib):
    if shutil.which("nvidia-smi", path="/usr/bin:/bin") or os.access("/usr/lib/wsl/lib/nvidia-smi", os.X_OK):
        pytest.fail("this machine has an nvidia-smi: the case cannot be made here")
    run = check(lib, None, "--need-gb", "5.68")
    assert run.returncode == 0 and "not judged (no nvidia-smi)" in run.stderr


@pytest.mark.parametrize("mib", [12282, 16311, 32607, 143771])
def test_the_unit_asks_what_the_preflight_asks(mib):
    """The unit's --need-gb is the plan's estimate, and the script's formula is the rules' own."""
    s = Settings()
    plan = derive_plan(s, mib, (12, 0))
    argv = gpu_free_argv(plan)
    assert argv is not None and argv[-2:] == ["--need-gb", f"{estimated_vram_gb(plan):.2f}"]
    assert gpu_free_argv(derive_plan(Settings(launch_moe_cache_size="auto"), mib, (12, 0))) is None
    ratio = derive_plan(Settings(launch_memory_ratio=0.8), mib, (12, 0))
    assert gpu_free_argv(ratio)[-2:] == ["--ratio", "0.8"]
    assert gpu_room.room_gb(mib, 0, None) == pytest.approx(mib / 1024 * 0.9 - 1.0)
