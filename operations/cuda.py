"""CUDA 13 toolchain from NVIDIA's apt repository (field report, pitfall 3).

Blackwell (compute 12.0) needs nvcc 13: the distro's nvcc 12.0 fails with
`nvcc fatal: Unsupported gpu architecture 'compute_120'` when FreeToken JIT-compiles
its kernels. The pip package of nvcc was a placeholder on one mirror: apt is the
reliable source. Inside WSL the Windows driver is the driver, so an apt pin keeps
every Linux driver package out.
"""

from __future__ import annotations

import io
import shlex

from pyinfra import host
from pyinfra.api import operation
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files

from facts.apt_sources import AptSourceFiles
from facts.cuda import CudaToolchain
from facts.files import FileText
from freetoken_infra.core.layout import CUDA_KEYRING, CUDA_PIN_FILE, CUDA_PROFILE_FILE, CUDA_SOURCES_FILE
from freetoken_infra.core.settings import DRIVER_PACKAGE_GLOBS, Settings


def sources_line(settings: Settings) -> str:
    return f"deb [signed-by={CUDA_KEYRING}] {settings.cuda_repo_url} /\n"


def keyring_install_command(settings: Settings) -> str:
    """Download NVIDIA's keyring package into a fresh root-only folder (``mktemp -d``: 0700,
    a new random name), install it and remove the folder, whatever happened. Never a fixed path
    another user can write (the engine's cache was one: a file already there was installed
    as it was), and never a file from an earlier run."""
    url = shlex.quote(str(settings.cuda_keyring_url))
    return (
        "d=$(umask 077 && mktemp -d) && "
        f'{{ curl -fsSL --retry 3 -o "$d/cuda-keyring.deb" -- {url} && dpkg -i "$d/cuda-keyring.deb"; '
        'rc=$?; rm -rf -- "$d"; exit $rc; }'
    )


def pin_text() -> str:
    return (
        "# freetoken-infra: inside WSL the Windows NVIDIA driver is the driver; a Linux\n"
        "# driver package (pulled in by `cuda`, `cuda-X-Y` or `cuda-drivers`) breaks the GPU.\n"
        f"Package: {' '.join(DRIVER_PACKAGE_GLOBS)}\n"
        "Pin: release *\n"
        "Pin-Priority: -1\n"
    )


def profile_text(settings: Settings) -> str:
    # Sourced by every login shell: the value is one quoted word whatever it holds.
    return (
        f"export CUDA_HOME={shlex.quote(settings.cuda_home)}\n"
        'case ":$PATH:" in *":$CUDA_HOME/bin:"*) ;; *) PATH="$CUDA_HOME/bin:$PATH";; esac\n'
    )


@operation()
def packages_present(packages: list[str]):
    """
    Install Debian packages, running `apt-get update` only when one is missing
    (so a converged host's re-run changes and fetches nothing).

    + packages: package names
    """
    installed = host.get_fact(DebPackages) or {}
    missing = [p for p in packages if p not in installed]
    if not missing:
        host.noop(f"installed: {', '.join(packages)}")
        return
    yield from apt.update._inner()
    yield from apt.packages._inner(packages=missing, no_recommends=True)


@operation()
def repository(settings: Settings):
    """
    NVIDIA's keyring and repository, and the pin that blocks driver packages.

    The keyring package is installed once, whatever its version (1.0-1 answers 404 on
    ubuntu2404; a newer one may come); the repository entry is ours, from
    `cuda_repo_url`, so a mirror works, and the entry the keyring package ships for
    NVIDIA's own host is removed to avoid duplicate sources.

    + settings: the host's Settings
    """
    installed = host.get_fact(DebPackages) or {}
    changed = False
    if "cuda-keyring" not in installed:
        yield keyring_install_command(settings)
        changed = True
    sources = host.get_fact(AptSourceFiles) or {}
    for path, content in sources.items():
        if path != CUDA_SOURCES_FILE and ("cuda-archive-keyring" in content or "/compute/cuda/repos/" in content):
            yield from files.file._inner(path=path, present=False)
            changed = True
    # A keyring installed in this run ships its own entry, unknown at prepare time.
    if "cuda-keyring" not in installed:
        yield "rm -f $(dpkg -L cuda-keyring | grep '^/etc/apt/sources.list.d/') 2>/dev/null; true"
    if sources.get(CUDA_SOURCES_FILE) != sources_line(settings):
        yield from files.put._inner(src=_text(sources_line(settings)), dest=CUDA_SOURCES_FILE, mode="644")
        changed = True
    else:
        changed = (yield from _root_only_writes(CUDA_SOURCES_FILE)) or changed
    pin = host.get_fact(FileText, path=CUDA_PIN_FILE)
    if pin != pin_text():
        yield from files.put._inner(src=_text(pin_text()), dest=CUDA_PIN_FILE, mode="644")
        changed = True
    else:
        changed = (yield from _root_only_writes(CUDA_PIN_FILE)) or changed
    if not changed:
        host.noop("NVIDIA repository, keyring and driver pin in place")


def _root_only_writes(path: str):
    """A file whose text is right stays root's, 0644: apt reads the pin and the sources as root,
    and every login shell (root's too) sources the profile, so a file anyone could write is a way
    into root. Returns whether it had to be put right."""
    commands = list(files.file._inner(path=path, user="root", group="root", mode="644"))
    yield from commands
    return bool(commands)


@operation()
def toolkit(settings: Settings, gpu_arch: str | None):
    """
    The CUDA toolkit packages from settings (never a driver), `CUDA_HOME` for login
    shells, then a check that nvcc lists the GPU's architecture.

    + settings: the host's Settings (cuda_packages, cuda_home)
    + gpu_arch: e.g. ``compute_120``; None skips the check (no GPU seen)
    """
    installed = host.get_fact(DebPackages) or {}
    missing = [p for p in settings.cuda_packages if p not in installed]
    if missing:
        yield from apt.update._inner()
        yield from apt.packages._inner(packages=missing, no_recommends=True)
    if host.get_fact(FileText, path=CUDA_PROFILE_FILE) != profile_text(settings):
        yield from files.put._inner(src=_text(profile_text(settings)), dest=CUDA_PROFILE_FILE, mode="644")
    else:
        yield from _root_only_writes(CUDA_PROFILE_FILE)
    if gpu_arch:
        toolchain = host.get_fact(CudaToolchain, cuda_home=settings.cuda_home)
        ok = any(n.path.startswith(settings.cuda_home + "/") and gpu_arch in n.archs for n in toolchain.nvcc)
        if missing or not ok:
            nvcc = f"{settings.cuda_home}/bin/nvcc"
            why = shlex.quote(f"{nvcc} does not list {gpu_arch}: FreeToken cannot JIT its kernels")
            yield (
                f"{shlex.quote(nvcc)} --list-gpu-arch | grep -qx -- {shlex.quote(gpu_arch)} || "
                f"{{ echo {why} >&2; exit 1; }}"
            )


def _text(content: str) -> io.StringIO:
    return io.StringIO(content)
