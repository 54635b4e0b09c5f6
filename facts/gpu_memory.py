"""Fact that proves the GPU can really allocate memory (field report, pitfall 4B).

Under old WSL, WDDM memory accounting can lock a process's usable GPU memory at zero:
``cuMemGetInfo`` reports gigabytes free while a 32 MiB ``cuMemAlloc`` fails with
CUDA_ERROR_OUT_OF_MEMORY. Only a real allocation shows it, so this probe makes one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pyinfra.api import FactBase

from ._declare import BOOT_ONLY
from ._output import MARKER, quote

SMALL_ALLOC_BYTES = 32 * 1024 * 1024
LARGE_ALLOC_MAX_BYTES = 1024 * 1024 * 1024
CUDA_ERROR_OUT_OF_MEMORY = 2

# Runs on the target with python3's standard library only. Uses only these driver API
# symbols (the test fleet's stand-in libcuda.so.1 implements exactly them): cuInit,
# cuDeviceGet, cuCtxCreate_v2, cuMemGetInfo_v2, cuMemAlloc_v2, cuMemFree_v2, cuCtxDestroy_v2.
PROBE_SCRIPT = r"""
import ctypes, json
NAMES = {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
         3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED",
         34: "CUDA_ERROR_STUB_LIBRARY", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
         100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
         201: "CUDA_ERROR_INVALID_CONTEXT", 304: "CUDA_ERROR_OPERATING_SYSTEM",
         801: "CUDA_ERROR_NOT_SUPPORTED", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
         999: "CUDA_ERROR_UNKNOWN"}
r = {"lib": None, "failed_step": None, "code": None, "free": None, "total": None,
     "small_bytes": SMALL, "small_ok": None, "large_bytes": None, "large_ok": None,
     "large_code": None, "small_code": None, "error": None}
def err(code):
    return "%s (%d)" % (NAMES.get(code, "CUDA_ERROR"), code)
def main():
    lib = None
    for name in ("libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"):
        try:
            lib = ctypes.CDLL(name)
            r["lib"] = name
            break
        except OSError as e:
            r["error"] = "cannot load libcuda.so.1: %s" % e
    if lib is None:
        r["failed_step"] = "dlopen"
        return
    r["error"] = None
    def call(step, *args):
        code = getattr(lib, step)(*args)
        if code != 0:
            r["failed_step"], r["code"], r["error"] = step, code, err(code)
        return code
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    lib.cuCtxCreate_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int]
    lib.cuCtxDestroy_v2.argtypes = [ctypes.c_void_p]
    dev, ctx = ctypes.c_int(0), ctypes.c_void_p()
    if call("cuInit", 0) or call("cuDeviceGet", ctypes.byref(dev), 0):
        return
    if call("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev):
        return
    try:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        if call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total)):
            return
        r["free"], r["total"] = free.value, total.value
        ptr = ctypes.c_uint64(0)
        code = lib.cuMemAlloc_v2(ctypes.byref(ptr), SMALL)
        r["small_ok"], r["small_code"] = code == 0, code
        if code == 0:
            lib.cuMemFree_v2(ptr)
        large = min(LARGE, free.value // 4)
        if large > 0:
            r["large_bytes"] = large
            ptr = ctypes.c_uint64(0)
            code = lib.cuMemAlloc_v2(ctypes.byref(ptr), large)
            r["large_ok"], r["large_code"] = code == 0, code
            if code == 0:
                lib.cuMemFree_v2(ptr)
    finally:
        lib.cuCtxDestroy_v2(ctx)
try:
    main()
except Exception as e:
    r["failed_step"] = r["failed_step"] or "python"
    r["error"] = "%s: %s" % (type(e).__name__, e)
print("@@ft:probe " + json.dumps(r))
""".replace("SMALL", str(SMALL_ALLOC_BYTES)).replace("LARGE", str(LARGE_ALLOC_MAX_BYTES))


@dataclass(frozen=True)
class GpuMemoryProbeResult:
    status: Literal["healthy", "allocation_locked", "no_cuda"]
    free_bytes: int | None
    total_bytes: int | None
    small_alloc_ok: bool | None
    large_alloc_ok: bool | None
    large_alloc_bytes: int | None
    error: str | None


def _name(code: int) -> str:
    names = {2: "CUDA_ERROR_OUT_OF_MEMORY", 1: "CUDA_ERROR_INVALID_VALUE"}
    return f"{names.get(code, 'CUDA_ERROR')} ({code})"


def classify_probe(result: dict) -> GpuMemoryProbeResult:
    """Classify the probe script's JSON result."""
    free, total = result.get("free"), result.get("total")
    small_ok, large_ok = result.get("small_ok"), result.get("large_ok")
    large_bytes = result.get("large_bytes")
    error = result.get("error")
    if free is None or result.get("failed_step") in {
        "dlopen",
        "cuInit",
        "cuDeviceGet",
        "cuCtxCreate_v2",
        "cuMemGetInfo_v2",
        "python",
    }:
        return GpuMemoryProbeResult(
            "no_cuda",
            free,
            total,
            small_ok,
            large_ok,
            large_bytes,
            error or f"CUDA probe failed at {result.get('failed_step')}",
        )
    if small_ok is False or large_ok is False:
        failed = []
        if small_ok is False:
            failed.append(
                f"{result.get('small_bytes', SMALL_ALLOC_BYTES)} B allocation failed: "
                f"{_name(int(result.get('small_code') or 0))}"
            )
        if large_ok is False:
            failed.append(f"{large_bytes} B allocation failed: {_name(int(result.get('large_code') or 0))}")
        detail = "; ".join(failed)
        if not free:
            # Really full, not the WDDM lock-up: nothing reported free either.
            detail = "no free GPU memory reported; " + detail
        else:
            detail = f"{free} B reported free but " + detail
        return GpuMemoryProbeResult("allocation_locked", free, total, small_ok, large_ok, large_bytes, detail)
    return GpuMemoryProbeResult("healthy", free, total, small_ok, large_ok, large_bytes, None)


def parse_probe_output(lines: list[str]) -> GpuMemoryProbeResult:
    for line in reversed(lines):
        if line.startswith(MARKER + "no-python"):
            return GpuMemoryProbeResult("no_cuda", None, None, None, None, None, "python3 not found")
        if line.startswith(MARKER + "probe "):
            try:
                result = json.loads(line[len(MARKER + "probe ") :])
            except ValueError:
                break
            if isinstance(result, dict):
                return classify_probe(result)
            break
    tail = " ".join(line.strip() for line in lines[-5:] if not line.startswith(MARKER))
    return GpuMemoryProbeResult(
        "no_cuda",
        None,
        None,
        None,
        None,
        None,
        f"probe gave no result: {tail[:300]}" if tail else "probe gave no result",
    )


class GpuMemoryProbe(FactBase[GpuMemoryProbeResult]):
    """
    Returns ``GpuMemoryProbeResult``: whether GPU memory that is reported free can really be
    allocated (32 MiB, then min(1 GiB, free/4)).

    The one expensive fact: it creates a CUDA context on GPU 0 (about a second and a few
    hundred MiB of GPU memory while it runs). Run it only when needed, e.g. in the preflight
    and never while the engine is loading.
    """

    # Never folded into a batch of facts (facts/batch.py): it runs only when asked for.
    batchable = False

    # Read only while the engine does not serve (a serving engine proves allocations work): the
    # engine's /health and unit state are inputs of the same run, and its answer is the card's.
    fast_check_inputs = BOOT_ONLY

    def command(self) -> str:
        return (
            "if command -v python3 >/dev/null 2>&1; then "
            f"python3 -c {quote(PROBE_SCRIPT)} 2>&1 </dev/null; "
            "else echo '@@ft:no-python'; fi; true"
        )

    @staticmethod
    def default() -> GpuMemoryProbeResult:
        return GpuMemoryProbeResult("no_cuda", None, None, None, None, None, "no output")

    def process(self, output: list[str]) -> GpuMemoryProbeResult:
        return parse_probe_output(output)
