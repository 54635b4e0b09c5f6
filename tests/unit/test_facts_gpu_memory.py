import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from facts.gpu_memory import (
    PROBE_SCRIPT,
    GpuMemoryProbe,
    GpuMemoryProbeResult,
    classify_probe,
    parse_probe_output,
)
from tests.fleet.harness import gpu_conf_text
from tests.fleet.profiles import PROFILES

GIB = 1024**3
MIB = 1024**2


def result(**kw):
    base = {
        "lib": "libcuda.so.1",
        "failed_step": None,
        "code": None,
        "free": 11 * GIB,
        "total": 16 * GIB,
        "small_bytes": 32 << 20,
        "small_ok": True,
        "small_code": 0,
        "large_bytes": GIB,
        "large_ok": True,
        "large_code": 0,
        "error": None,
    }
    base.update(kw)
    return base


def line(r):
    return "@@ft:probe " + json.dumps(r)


def test_healthy():
    r = parse_probe_output([line(result())])
    assert r.status == "healthy" and r.free_bytes == 11 * GIB and r.large_alloc_bytes == GIB and r.error is None


def test_wddm_lock_small_alloc_fails():
    r = parse_probe_output([line(result(small_ok=False, small_code=2, large_ok=False, large_code=2))])
    assert r.status == "allocation_locked" and r.small_alloc_ok is False
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in r.error


def test_large_alloc_fails_only():
    r = classify_probe(result(large_ok=False, large_code=2))
    assert r.status == "allocation_locked" and r.small_alloc_ok is True and r.large_alloc_ok is False


def test_no_device():
    r = classify_probe(
        result(
            free=None,
            total=None,
            small_ok=None,
            large_ok=None,
            large_bytes=None,
            failed_step="cuInit",
            code=100,
            error="CUDA_ERROR_NO_DEVICE (100)",
        )
    )
    assert r.status == "no_cuda" and r.error == "CUDA_ERROR_NO_DEVICE (100)"


def test_lib_missing_and_no_python():
    r = classify_probe(result(free=None, failed_step="dlopen", error="cannot load libcuda.so.1: x"))
    assert r.status == "no_cuda" and "libcuda" in r.error
    assert parse_probe_output(["@@ft:no-python"]).error == "python3 not found"


def test_garbage_and_empty():
    r = parse_probe_output(["Traceback (most recent call last):", "SyntaxError: bad"])
    assert r.status == "no_cuda" and "SyntaxError" in r.error
    assert parse_probe_output(["@@ft:probe {not json"]).status == "no_cuda"
    assert GpuMemoryProbe.default().status == "no_cuda"


def test_script_uses_only_the_stand_in_symbols():
    import re

    used = set(re.findall(r"\bcu[A-Z]\w+", PROBE_SCRIPT))
    assert used == {
        "cuInit",
        "cuDeviceGet",
        "cuCtxCreate_v2",
        "cuMemGetInfo_v2",
        "cuMemAlloc_v2",
        "cuMemFree_v2",
        "cuCtxDestroy_v2",
    }


# ---- the fact's real command and probe script, run against the fleet's libcuda.so.1 stand-in

ROOT = Path(__file__).resolve().parents[2]
STANDIN_SRC = ROOT / "tests" / "fleet" / "standins" / "libcuda.c"


@pytest.fixture(scope="module")
def standin_libcuda(tmp_path_factory) -> Path:
    """A directory holding the stand-in compiled as libcuda.so.1, as harness.build_libcuda does."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (tests/run.sh installs it): cannot build the libcuda stand-in")
    out = tmp_path_factory.mktemp("libcuda")
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out / "libcuda.so.1"),
            str(STANDIN_SRC),
        ],
        check=True,
        capture_output=True,
    )
    return out


def run_probe(libdir: Path, gpu_conf: Path) -> GpuMemoryProbeResult:
    """The fact's command as pyinfra runs it, with the stand-in first on the loader's path."""
    fact = GpuMemoryProbe()
    env = {**os.environ, "LD_LIBRARY_PATH": str(libdir), "FREETOKEN_SIM_GPU_CONF": str(gpu_conf)}
    proc = subprocess.run(["sh", "-c", fact.command()], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return fact.process(proc.stdout.splitlines())


def gpu_conf(tmp_path: Path, host: str) -> Path:
    """The GPU description the harness writes for a simulated host (ws1 healthy, ws3 locked)."""
    conf = tmp_path / f"{host}-gpu.conf"
    conf.write_text(gpu_conf_text(PROFILES[host]))
    return conf


def test_probe_on_a_healthy_gpu(standin_libcuda, tmp_path):
    gpu = PROFILES["ws1"].gpu
    r = run_probe(standin_libcuda, gpu_conf(tmp_path, "ws1"))
    assert r.status == "healthy", r
    assert r.total_bytes == gpu.memory_total_mib * MIB
    assert r.free_bytes == (gpu.memory_total_mib - gpu.memory_used_mib) * MIB
    assert r.small_alloc_ok is True and r.large_alloc_ok is True
    assert r.large_alloc_bytes == min(GIB, r.free_bytes // 4) and r.error is None


def test_probe_on_an_allocation_locked_gpu(standin_libcuda, tmp_path):
    # Pitfall 4B: gigabytes reported free, yet even 32 MiB cannot be allocated.
    gpu = PROFILES["ws3"].gpu
    assert gpu.allocation_locked
    r = run_probe(standin_libcuda, gpu_conf(tmp_path, "ws3"))
    assert r.status == "allocation_locked", r
    assert r.free_bytes == gpu.locked_free_mib * MIB
    assert r.small_alloc_ok is False and r.large_alloc_ok is False
    assert r.error.startswith(f"{gpu.locked_free_mib * MIB} B reported free but ")
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in r.error


def test_probe_with_a_driver_that_sees_no_device(standin_libcuda, tmp_path):
    # libcuda.so.1 loads but has no GPU behind it (the stand-in without its description).
    r = run_probe(standin_libcuda, tmp_path / "absent-gpu.conf")
    assert r.status == "no_cuda", r
    assert r.error == "CUDA_ERROR_NO_DEVICE (100)"
    assert r.free_bytes is None and r.small_alloc_ok is None


def test_probe_without_libcuda(tmp_path):
    # No libcuda.so.1 at all: a machine without NVIDIA's driver. Only where none is installed.
    if _libcuda_loadable():
        pytest.skip("this machine has a libcuda.so.1: the no-driver case needs a machine without one")
    r = run_probe(tmp_path, tmp_path / "absent-gpu.conf")
    assert r.status == "no_cuda" and r.error.startswith("cannot load libcuda.so.1")


def _libcuda_loadable() -> bool:
    for name in ("libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return False


def test_command_on_this_machine():
    """Whatever this machine is: no driver gives no_cuda naming libcuda; a driver gives a probe
    that got past loading it (healthy, allocation-locked, or a CUDA error such as no device)."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "FREETOKEN_SIM_GPU_CONF")}
    proc = subprocess.run(
        ["sh", "-c", GpuMemoryProbe().command()], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0
    r = GpuMemoryProbe().process(proc.stdout.splitlines())
    if _libcuda_loadable():
        assert r.status in ("healthy", "allocation_locked") or "CUDA_ERROR" in (r.error or ""), r
    else:
        assert r.status == "no_cuda" and r.error.startswith("cannot load libcuda.so.1"), r
