import json
import subprocess

from facts.gpu_memory import PROBE_SCRIPT, GpuMemoryProbe, classify_probe, parse_probe_output

GIB = 1024 ** 3


def result(**kw):
    base = {"lib": "libcuda.so.1", "failed_step": None, "code": None, "free": 11 * GIB, "total": 16 * GIB,
            "small_bytes": 32 << 20, "small_ok": True, "small_code": 0, "large_bytes": GIB,
            "large_ok": True, "large_code": 0, "error": None}
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
    r = classify_probe(result(free=None, total=None, small_ok=None, large_ok=None, large_bytes=None,
                              failed_step="cuInit", code=100, error="CUDA_ERROR_NO_DEVICE (100)"))
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
    assert used == {"cuInit", "cuDeviceGet", "cuCtxCreate_v2", "cuMemGetInfo_v2", "cuMemAlloc_v2",
                    "cuMemFree_v2", "cuCtxDestroy_v2"}


def test_command_on_this_machine():
    proc = subprocess.run(["sh", "-c", GpuMemoryProbe().command()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    r = GpuMemoryProbe().process(proc.stdout.splitlines())
    assert r.status == "no_cuda"  # no GPU driver on the build machine
    assert "libcuda" in r.error or "CUDA_ERROR" in r.error
