import glob
import os
import shutil
import subprocess
from pathlib import Path

from facts.cuda import CudaToolchain, parse_gpu_arch_list, parse_nvcc_version, parse_toolchain_output

FIX = Path(__file__).parent.parent / "fixtures" / "real"


def test_nvcc_13_banner():
    assert parse_nvcc_version((FIX / "nvcc-13.0-version.txt").read_text()) == ((13, 0), "13.0.88")


def test_nvcc_12_banner():
    assert parse_nvcc_version((FIX / "nvcc-12.0-version.txt").read_text()) == ((12, 0), "12.0.140")


def test_arch_lists():
    a13 = parse_gpu_arch_list((FIX / "nvcc-13.0-list-gpu-arch.txt").read_text())
    a12 = parse_gpu_arch_list((FIX / "nvcc-12.0-list-gpu-arch.txt").read_text())
    assert "compute_120" in a13 and "compute_50" not in a13
    assert "compute_120" not in a12 and a12[0] == "compute_50" and a12[-1] == "compute_90"


def test_errors_parse_to_nothing():
    assert parse_nvcc_version("sh: nvcc: not found") == (None, None)
    assert parse_gpu_arch_list("nvcc fatal   : Unknown option '--list-gpu-arch'") == ()


def test_full_output_two_nvccs():
    lines = [
        "@@ft:cuda_home /usr/local/cuda-13.0",
        "@@ft:nvcc CUDA_HOME /usr/local/cuda-13.0/bin/nvcc /usr/local/cuda-13.0/bin/nvcc",
        "@@ft:version",
        *(FIX / "nvcc-13.0-version.txt").read_text().splitlines(),
        "@@ft:archs",
        *(FIX / "nvcc-13.0-list-gpu-arch.txt").read_text().splitlines(),
        "@@ft:nvcc PATH /usr/lib/nvidia-cuda-toolkit/bin/nvcc /usr/bin/nvcc",
        "@@ft:version",
        *(FIX / "nvcc-12.0-version.txt").read_text().splitlines(),
        "@@ft:archs",
        *(FIX / "nvcc-12.0-list-gpu-arch.txt").read_text().splitlines(),
        "@@ft:ninja",
        "1.11.1.git.kitware.jobserver-1",
    ]
    info = parse_toolchain_output(lines)
    assert info.cuda_home == "/usr/local/cuda-13.0"
    assert [(n.source, n.path, n.version) for n in info.nvcc] == [
        ("CUDA_HOME", "/usr/local/cuda-13.0/bin/nvcc", (13, 0)),
        ("PATH", "/usr/bin/nvcc", (12, 0)),
    ]
    assert info.nvcc[1].realpath == "/usr/lib/nvidia-cuda-toolkit/bin/nvcc"
    assert info.ninja_version == "1.11.1.git.kitware.jobserver-1"


def test_nothing_installed():
    info = parse_toolchain_output(["@@ft:cuda_home "])
    assert info.nvcc == () and info.cuda_home is None and info.ninja_version is None


def _executable(path) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def test_command_on_this_machine():
    """Holds on any machine: the nvccs reported are the ones on disk, in the fact's order,
    each real file once (a /usr/local/cuda -> cuda-13.0 link is the same nvcc), each with the
    version its own banner gives; ninja is reported exactly when it is on PATH."""
    home = "/usr/local/cuda-13.0"
    fact = CudaToolchain()
    proc = subprocess.run(["sh", "-c", fact.command(home)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    info = fact.process(proc.stdout.splitlines())
    assert info.cuda_home == home

    candidates = [("CUDA_HOME", f"{home}/bin/nvcc")]
    candidates += [("usr_local", p) for p in sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"))]
    candidates += [("usr_local", "/usr/local/cuda/bin/nvcc"), ("PATH", shutil.which("nvcc"))]
    expected, seen = [], set()
    for source, path in candidates:
        if _executable(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            expected.append((source, path))
    assert [(n.source, n.path) for n in info.nvcc] == expected
    for n in info.nvcc:
        banner = subprocess.run([n.path, "--version"], capture_output=True, text=True, timeout=60)
        assert n.version == parse_nvcc_version(banner.stdout + banner.stderr)[0]
    assert (info.ninja_version is not None) == (shutil.which("ninja") is not None)
