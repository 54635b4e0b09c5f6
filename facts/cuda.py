"""Fact about the CUDA toolchain FreeToken's JIT needs: nvcc (its major version must match
torch's CUDA major, and it must know the GPU's arch, e.g. ``compute_120`` for Blackwell: field
report pitfall 3) and ninja."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pyinfra.api import FactBase

from ._declare import DPKG_STATUS, PATH_OR_NONE, Inputs
from ._output import MARKER, quote, sections


@dataclass(frozen=True)
class NvccInfo:
    path: str
    source: Literal["CUDA_HOME", "usr_local", "PATH"]
    version: tuple[int, int] | None
    archs: tuple[str, ...]
    # The resolved path (candidates are deduplicated by it) and the "V13.0.88" build version.
    realpath: str = ""
    full_version: str | None = None


@dataclass(frozen=True)
class CudaToolchainInfo:
    nvcc: tuple[NvccInfo, ...]
    cuda_home: str | None
    ninja_version: str | None


def parse_nvcc_version(text: str) -> tuple[tuple[int, int] | None, str | None]:
    """``Cuda compilation tools, release 13.0, V13.0.88`` -> ``((13, 0), "13.0.88")``."""
    match = re.search(r"release (\d+)\.(\d+)(?:, V(\d+(?:\.\d+)*))?", text)
    if not match:
        return None, None
    return (int(match.group(1)), int(match.group(2))), match.group(3)


def parse_gpu_arch_list(text: str) -> tuple[str, ...]:
    """``nvcc --list-gpu-arch`` output: one ``compute_NN`` per line (errors yield nothing)."""
    return tuple(line.strip() for line in text.splitlines() if re.fullmatch(r"compute_\d+[a-z]?", line.strip()))


def parse_toolchain_output(lines: list[str]) -> CudaToolchainInfo:
    cuda_home = None
    ninja = None
    nvccs: list[NvccInfo] = []
    current: dict | None = None

    def flush() -> None:
        if current is not None:
            version, full = parse_nvcc_version("\n".join(current["version"]))
            nvccs.append(
                NvccInfo(
                    path=current["path"],
                    source=current["source"],
                    version=version,
                    archs=parse_gpu_arch_list("\n".join(current["archs"])),
                    realpath=current["realpath"],
                    full_version=full,
                )
            )

    for name, arg, body in sections(lines):
        if name == "cuda_home":
            cuda_home = arg or None
        elif name == "nvcc":
            flush()
            source, _, rest = arg.partition(" ")
            realpath, _, path = rest.partition(" ")
            current = {"source": source, "realpath": realpath, "path": path or realpath, "version": [], "archs": []}
        elif name == "version" and current is not None:
            current["version"] = body
        elif name == "archs" and current is not None:
            current["archs"] = body
        elif name == "ninja":
            match = re.search(r"\d+(?:\.\d+)+\S*", "\n".join(body))
            ninja = match.group(0) if match else None
    flush()
    return CudaToolchainInfo(tuple(nvccs), cuda_home, ninja)


def _inputs(kwargs: dict[str, Any]) -> Inputs:
    home = kwargs.get("cuda_home")
    paths = {DPKG_STATUS, "/usr/local/cuda", "/usr/local/cuda/bin/nvcc"}
    if isinstance(home, str) and home.startswith("/"):
        paths |= {home, f"{home}/bin", f"{home}/bin/nvcc"}
    return Inputs(paths=paths, globs={"/usr/local/cuda-*/bin/nvcc"})


class CudaToolchain(FactBase[CudaToolchainInfo]):
    """
    Returns ``CudaToolchainInfo``: every nvcc FreeToken could pick, in its search order
    (``$CUDA_HOME/bin``, ``/usr/local/cuda-*``, ``/usr/local/cuda``, PATH; deduplicated by real
    path), each with its release and supported ``compute_*`` archs, and ninja's version.

    + cuda_home: the CUDA_HOME the engine will run with (default: the target's ``$CUDA_HOME``)
    """

    argument_shapes = {"cuda_home": PATH_OR_NONE}
    fast_check_inputs = _inputs

    def command(self, cuda_home: str | None = None) -> str:
        home = quote(cuda_home) if cuda_home else '"${CUDA_HOME:-}"'
        return (
            f"H={home}; echo \"{MARKER}cuda_home $H\"; SEEN=' '; "
            'probe() { [ -f "$2" ] && [ -x "$2" ] || return 0; '
            'R=$(readlink -f "$2" 2>/dev/null || echo "$2"); '
            'case "$SEEN" in *" $R "*) return 0;; esac; SEEN="$SEEN$R "; '
            f'echo "{MARKER}nvcc $1 $R $2"; echo \'{MARKER}version\'; "$2" --version 2>&1 </dev/null; '
            f"echo '{MARKER}archs'; \"$2\" --list-gpu-arch 2>&1 </dev/null; }}; "
            'if [ -n "$H" ]; then probe CUDA_HOME "$H/bin/nvcc"; fi; '
            'for N in /usr/local/cuda-*/bin/nvcc /usr/local/cuda/bin/nvcc; do probe usr_local "$N"; done; '
            'N=$(command -v nvcc 2>/dev/null) && probe PATH "$N"; '
            f"if command -v ninja >/dev/null 2>&1; then echo '{MARKER}ninja'; ninja --version 2>&1 </dev/null; fi; "
            "true"
        )

    @staticmethod
    def default() -> CudaToolchainInfo:
        return CudaToolchainInfo((), None, None)

    def process(self, output: list[str]) -> CudaToolchainInfo:
        return parse_toolchain_output(output)
