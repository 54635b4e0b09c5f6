"""STAND-IN for NVIDIA's CUDA apt repository (https://developer.download.nvidia.com/compute/
cuda/repos/ubuntu2404/x86_64/): a signed FLAT repository with the same layout (Packages,
Packages.gz, Release, InRelease, Release.gpg and the .debs in one directory) and packages of the
same names, built with dpkg-deb, apt-ftparchive and gpg:

- cuda-keyring 1.1-1 (also offered as the file cuda-keyring_1.1-1_all.deb, as NVIDIA does):
  installs /usr/share/keyrings/cuda-archive-keyring.gpg and
  /etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list, like the real one;
- cuda-nvcc-13-0: /usr/local/cuda-13.0/bin/nvcc (a stand-in printing the real banner);
- cuda-toolkit-13-0-config-common-like /usr/local/cuda symlink (shipped in cuda-nvcc-13-0's
  dependency cuda-toolkit-config-common here);
- cuda-cudart-dev-13-0, cuda-cccl-13-0: a few headers under /usr/local/cuda-13.0/include;
- cuda-drivers: a marker file /usr/lib/cuda-drivers-STAND-IN; a correct deploy never installs it
  inside WSL. cuda-13-0 is the metapackage that Depends on it, as the real one does;
- more of the driver's package families the real repository carries (DRIVER_FAMILIES: the open
  kernel module metapackage nvidia-open, nvidia-utils-580, libnvidia-compute-580, cuda-compat-13-0),
  each only a marker file under /usr/lib/nvidia-driver-STAND-IN/; the apt pin must block them all;
- nvidia-container-toolkit: an NVIDIA package that is no driver (the pin names driver families
  one by one so that this one stays installable);
- an older keyring, cuda-keyring 1.0-1, only as the file cuda-keyring_1.0-1_all.deb beside the
  index (not in it), as hosts set up from an older NVIDIA guide have it installed.

Usage: python3 -m tests.fleet.standins.cuda_repo build OUTDIR REPO_URL
The signing key lives in OUTDIR/../gnupg (a throwaway key of the simulated fleet).
"""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

REPO_SUBDIR = "compute/cuda/repos/ubuntu2404/x86_64"
HERE = Path(__file__).resolve().parent

STANDIN_NOTE = "STAND-IN package of the simulated fleet (tests/fleet), not NVIDIA's."
KEYRING_VERSION, OLD_KEYRING_VERSION = "1.1-1", "1.0-1"
# name -> (version, Depends): Linux driver packages besides cuda-drivers, by family.
DRIVER_FAMILIES = {
    "nvidia-open": ("580.95.05-0ubuntu1", "nvidia-utils-580, libnvidia-compute-580"),
    "nvidia-utils-580": ("580.95.05-0ubuntu1", ""),
    "libnvidia-compute-580": ("580.95.05-0ubuntu1", ""),
    "cuda-compat-13-0": ("580.95.05-0ubuntu1", ""),
}
NOT_A_DRIVER = "nvidia-container-toolkit"


def keyring_deb(version: str = KEYRING_VERSION) -> str:
    """The keyring's file name in the repository's directory (NVIDIA's spelling)."""
    return f"cuda-keyring_{version}_all.deb"


def _deb(
    work: Path,
    out: Path,
    name: str,
    version: str,
    arch: str,
    files: dict[str, tuple],
    depends: str = "",
    description: str = "",
    postinst: str = "",
    symlinks=None,
) -> Path:
    root = work / f"{name}_{version}"
    if root.exists():
        shutil.rmtree(root)
    (root / "DEBIAN").mkdir(parents=True)
    for path, (content, mode) in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content if isinstance(content, bytes) else content.encode())
        target.chmod(mode)
    for link, dest in (symlinks or {}).items():
        target = root / link.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(dest)
    control = [
        f"Package: {name}",
        f"Version: {version}",
        f"Architecture: {arch}",
        "Maintainer: freetoken-infra simulated fleet <sim@invalid>",
        "Section: devel",
        "Priority: optional",
    ]
    if depends:
        control.append(f"Depends: {depends}")
    control.append(f"Description: {description or name}\n {STANDIN_NOTE}")
    (root / "DEBIAN" / "control").write_text("\n".join(control) + "\n")
    if postinst:
        p = root / "DEBIAN" / "postinst"
        p.write_text(postinst)
        p.chmod(0o755)
    deb = out / f"{name}_{version}_{arch}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return deb


def _gpg(home: Path, *args, **kw):
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", "--yes", *args], check=True, **kw)


def build(outdir: Path, repo_url: str) -> Path:
    """Build the signed flat repository under outdir/REPO_SUBDIR; return that directory."""
    repo = outdir / REPO_SUBDIR
    if outdir.exists():
        shutil.rmtree(outdir)
    repo.mkdir(parents=True)
    work = outdir.parent / (outdir.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    home = work / "gnupg"
    home.mkdir(mode=0o700)
    _gpg(
        home,
        "--passphrase",
        "",
        "--quick-gen-key",
        "cuda-repo STAND-IN (simulated fleet) <sim@invalid>",
        "rsa3072",
        "sign",
        "never",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    keyring = _gpg(home, "--export", capture_output=True).stdout

    nvcc = (HERE / "bin" / "nvcc").read_bytes()
    header = (
        "/* STAND-IN header of the simulated fleet's cuda-%s-13-0 package; the real one\n"
        " * comes from NVIDIA's CUDA repository. */\n"
    )
    keyring_files = {
        "/usr/share/keyrings/cuda-archive-keyring.gpg": (keyring, 0o644),
        "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list": (
            f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {repo_url} /\n",
            0o644,
        ),
    }
    _deb(
        work,
        repo,
        "cuda-keyring",
        KEYRING_VERSION,
        "all",
        keyring_files,
        description="GPG keyring for the CUDA repository (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-toolkit-config-common",
        "13.0.96-1",
        "all",
        {},
        symlinks={"/usr/local/cuda": "/etc/alternatives/cuda"},
        postinst="#!/bin/sh\nset -e\n[ -e /etc/alternatives/cuda ] || "
        "ln -s /usr/local/cuda-13.0 /etc/alternatives/cuda\n",
        description="Common config package for CUDA Toolkit (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-nvcc-13-0",
        "13.0.88-1",
        "amd64",
        {
            "/usr/local/cuda-13.0/bin/nvcc": (nvcc, 0o755),
        },
        depends="cuda-toolkit-config-common",
        description="CUDA nvcc (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-cudart-dev-13-0",
        "13.0.96-1",
        "amd64",
        {
            "/usr/local/cuda-13.0/include/cuda_runtime_api.h": (header % "cudart-dev", 0o644),
            "/usr/local/cuda-13.0/include/cuda_runtime.h": (header % "cudart-dev", 0o644),
            "/usr/local/cuda-13.0/lib64/libcudart_static.a.STAND-IN": (b"", 0o644),
        },
        depends="cuda-toolkit-config-common",
        description="CUDA Runtime native dev links, headers (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-cccl-13-0",
        "13.0.85-1",
        "amd64",
        {
            "/usr/local/cuda-13.0/include/cuda/std/version": (header % "cccl", 0o644),
            "/usr/local/cuda-13.0/include/thrust/version.h": (header % "cccl", 0o644),
            "/usr/local/cuda-13.0/include/cub/version.cuh": (header % "cccl", 0o644),
        },
        description="CUDA CCCL (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-drivers",
        "580.95.05-1",
        "amd64",
        {
            "/usr/lib/cuda-drivers-STAND-IN": (
                "STAND-IN for NVIDIA's Linux driver metapackage. Installed inside WSL means the "
                "deploy broke the rule 'never install a Linux NVIDIA driver inside WSL'.\n",
                0o644,
            ),
        },
        description="CUDA Driver meta-package (stand-in)",
    )
    _deb(
        work,
        repo,
        "cuda-13-0",
        "13.0.2-1",
        "amd64",
        {},
        depends="cuda-nvcc-13-0, cuda-cudart-dev-13-0, cuda-cccl-13-0, cuda-drivers",
        description="CUDA 13.0 meta-package (stand-in; pulls in the driver like the real one)",
    )
    for name, (version, depends) in DRIVER_FAMILIES.items():
        _deb(
            work,
            repo,
            name,
            version,
            "amd64",
            {
                f"/usr/lib/nvidia-driver-STAND-IN/{name}": (
                    f"STAND-IN for NVIDIA's Linux driver package {name}. Installed inside WSL means the "
                    "deploy's apt pin failed to keep the Linux driver out.\n",
                    0o644,
                ),
            },
            depends=depends,
            description=f"NVIDIA driver package {name} (stand-in)",
        )
    _deb(
        work,
        repo,
        NOT_A_DRIVER,
        "1.17.8-1",
        "amd64",
        {
            f"/usr/share/doc/{NOT_A_DRIVER}/STAND-IN": ("no driver: the pin leaves it installable\n", 0o644),
        },
        description="NVIDIA container toolkit (stand-in; not a driver)",
    )

    packages = subprocess.run(["apt-ftparchive", "packages", "."], cwd=repo, check=True, capture_output=True).stdout
    (repo / "Packages").write_bytes(packages)
    with gzip.open(repo / "Packages.gz", "wb") as f:
        f.write(packages)
    release = subprocess.run(
        [
            "apt-ftparchive",
            "-o",
            "APT::FTPArchive::Release::Origin=NVIDIA",
            "-o",
            "APT::FTPArchive::Release::Label=NVIDIA CUDA",
            "-o",
            "APT::FTPArchive::Release::Codename=ubuntu2404",
            "-o",
            "APT::FTPArchive::Release::Suite=ubuntu2404",
            "release",
            ".",
        ],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    (repo / "Release").write_bytes(release)
    _gpg(home, "--armor", "--detach-sign", "-o", str(repo / "Release.gpg"), str(repo / "Release"))
    _gpg(home, "--clearsign", "-o", str(repo / "InRelease"), str(repo / "Release"))
    # After the index: the older keyring is a file to download, not a package apt offers.
    _deb(
        work,
        repo,
        "cuda-keyring",
        OLD_KEYRING_VERSION,
        "all",
        keyring_files,
        description="GPG keyring for the CUDA repository (stand-in, older release)",
    )
    shutil.rmtree(work, ignore_errors=True)
    return repo


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "build":
        sys.exit("usage: python3 -m tests.fleet.standins.cuda_repo build OUTDIR REPO_URL")
    print(build(Path(sys.argv[2]), sys.argv[3]))
