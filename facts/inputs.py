"""What on the host each fact's answer depends on: the inputs of the no-op fast check.

A converge reads some 90 facts per host; on a host nothing touched since its last converge they
answer what they answered then. The host lock's script (``operations/scripts/host_lock.py``,
``digest``) records, at the end of a converge that changed nothing (or of a run the preflight
refused by a blocker that stands until the next boot), a cheap signature of every input of
every fact that run read, and the next run compares it in the same round trip as the lock,
before any fact is read. Only while every input is unchanged (and the controller's
settings and code are the same: ``preflight.fingerprint``) does the run skip the facts.

The inputs, as ``host_lock.py`` reads them (none of them run anything the host's users wrote):

- ``paths``: ``lstat`` of each (type, mode, owner, size, inode, mtime and ctime in ns). A non-root
  user cannot set a file's ctime: any change of content, mode or owner shows, also one undone.
- ``dirs``: type, mode, owner and inode only, for the facts that read a folder's own metadata
  (a folder's times change with every file made in it: the guard writes its samples every 30 s).
- ``globs``: each pattern's matches (sorted), each ``lstat``-ed.
- ``trees``: every entry below a folder (``lstat``, links not followed), up to a cap.
- ``units``: systemd's ActiveState, UnitFileState and LoadState of each (one ``systemctl show``).
- ``health``: the engine's ``/health`` answer (HTTP status and its status, version and model).
- ``nft``: nftables tables (``inet freetoken``): what ``nft list table`` prints for each now.
- always: the boot (``boot_id`` and PID 1's start): a WSL or Windows restart, a new GPU, driver
  or WSL version (each needs a restart of the WSL VM) is a new boot, so the facts that ask
  Windows, the GPU or the kernel (whose answers change only with a boot) need nothing else.

``inputs_of`` maps one fact request (the learned-request form of ``facts/batch.py``: "module:Class"
and its keyword arguments) to its inputs, and answers None for a fact it does not know: a
converge that read such a fact records no signature, so every run after it reads every fact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from facts.ownership import components
from facts.windows import OWNER_SHORTCUTS
from freetoken_infra.core.layout import BINFMT_DIR, FIREWALL_LOADED, FIREWALL_TABLE, INTEROP_BINFMT_NAMES

DPKG_STATUS = "/var/lib/dpkg/status"
ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow")
APT_SOURCES_DIR = "/etc/apt/sources.list.d"


@dataclass
class Inputs:
    """What one or more facts depend on (merged with ``add``); ``to_json`` is what the host's
    script is given."""

    paths: set[str] = field(default_factory=set)
    dirs: set[str] = field(default_factory=set)
    globs: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    units: set[str] = field(default_factory=set)
    health: set[str] = field(default_factory=set)
    nft: set[str] = field(default_factory=set)  # nftables tables (`inet freetoken`): their live listing

    def add(self, other: Inputs) -> None:
        self.paths |= other.paths
        self.dirs |= other.dirs
        self.globs |= other.globs
        self.trees |= other.trees
        self.units |= other.units
        self.health |= other.health
        self.nft |= other.nft

    def to_json(self) -> dict[str, list[str]]:
        return {k: sorted(getattr(self, k)) for k in ("paths", "dirs", "globs", "trees", "units", "health", "nft")}

    def __len__(self) -> int:
        return sum(len(v) for v in self.to_json().values())


def _path_arg(kwargs: dict[str, Any], name: str) -> str | None:
    value = kwargs.get(name)
    return value if isinstance(value, str) and value.startswith("/") else None


def _paths(*paths: str | None) -> Inputs:
    return Inputs(paths={p for p in paths if p})


BOOT_ONLY = Inputs()  # answers that change only with a boot (always part of the signature)


def _engine_install(kwargs: dict[str, Any]) -> Inputs | None:
    base = _path_arg(kwargs, "base_dir")
    if base is None:
        return None
    return Inputs(
        paths={base, f"{base}/active"},
        globs={
            f"{base}/*",
            f"{base}/*/pyvenv.cfg",
            f"{base}/*/lib/python3*/site-packages",
            f"{base}/*/lib/python3*/site-packages/freetoken-*.dist-info/METADATA",
        },
    )


def _cuda(kwargs: dict[str, Any]) -> Inputs:
    home = kwargs.get("cuda_home")
    paths = {DPKG_STATUS, "/usr/local/cuda", "/usr/local/cuda/bin/nvcc"}
    if isinstance(home, str) and home.startswith("/"):
        paths |= {home, f"{home}/bin", f"{home}/bin/nvcc"}
    return Inputs(paths=paths, globs={"/usr/local/cuda-*/bin/nvcc"})


def _health(kwargs: dict[str, Any]) -> Inputs | None:
    host, port = kwargs.get("host", "127.0.0.1"), kwargs.get("port", 8000)
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    netloc = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return Inputs(health={f"http://{netloc}:{port}/health"})


def _units(kwargs: dict[str, Any]) -> Inputs | None:
    services = kwargs.get("services")
    if kwargs.get("user_mode") or kwargs.get("machine") or not isinstance(services, list):
        return None
    return Inputs(units={s for s in services if isinstance(s, str)})


def _ownership(kwargs: dict[str, Any]) -> Inputs | None:
    path = _path_arg(kwargs, "path")
    if path is None:
        return None
    # Adopting asks whether anything below is still the old user's: every entry's owner.
    return Inputs(dirs=set(components(path)), trees={path} if kwargs.get("adopt_from") else set())


def _restart(kwargs: dict[str, Any]) -> Inputs | None:
    paths = kwargs.get("paths")
    if not isinstance(paths, list) or not all(isinstance(p, str) and p.startswith("/") for p in paths):
        return None
    return Inputs(paths=set(paths))


def _tree(name: str):
    def inputs(kwargs: dict[str, Any]) -> Inputs | None:
        path = _path_arg(kwargs, name)
        return None if path is None else Inputs(paths={path}, trees={path})

    return inputs


def _one_path(name: str):
    def inputs(kwargs: dict[str, Any]) -> Inputs | None:
        path = _path_arg(kwargs, name)
        return None if path is None else _paths(path)

    return inputs


def _shortcuts(kwargs: dict[str, Any]) -> Inputs | None:
    desktop = _path_arg(kwargs, "path")
    if desktop is None:
        return None
    # The Desktop's own times move with every file the owner saves there: its owner and mode only.
    return Inputs(dirs={desktop}, paths={f"{desktop}/{name}" for name in OWNER_SHORTCUTS})


def _one_dir(kwargs: dict[str, Any]) -> Inputs | None:
    path = _path_arg(kwargs, "path")
    return None if path is None else Inputs(dirs={path})


_FIXED: dict[str, Inputs] = {
    # Answers of the kernel, WSL, Windows and the GPU: a change needs a restart of the WSL VM.
    "facts.wsl:WslKernel": BOOT_ONLY,
    "facts.wsl:WslVersion": BOOT_ONLY,
    "facts.gpu:NvidiaGpus": BOOT_ONLY,
    "facts.windows:WindowsUserProfile": BOOT_ONLY,
    "facts.init:InitSystem": BOOT_ONLY,
    # Memory, cores and the model disk's free space: the preflight's findings only, which the
    # no-op run does not repeat (the doctor does).
    "facts.resources:HostResources": BOOT_ONLY,
    # Read only while the engine does not serve (a serving engine proves allocations work): the
    # engine's /health and unit state are inputs of the same run, and its answer is the card's.
    "facts.gpu_memory:GpuMemoryProbe": BOOT_ONLY,
    # Wake-on-LAN readiness (Windows' adapters, powercfg): a warning of the preflight only, which
    # the no-op run does not repeat (the doctor does).
    "facts.wake_on_lan:WakeOnLanReadiness": BOOT_ONLY,
    # Interop as a service sees it: read by the doctor only, never by a converge.
    "facts.wsl:InteropAsService": BOOT_ONLY,
    "facts.windows:WslConfFile": _paths("/etc/wsl.conf"),
    # The firewall's live table (a flush leaves its oneshot unit `active`) and its loaded listing.
    "facts.firewall:FirewallTable": Inputs(paths={FIREWALL_LOADED}, nft={f"inet {FIREWALL_TABLE}"}),
    # The binfmt_misc table's entries: one gone, re-registered or added (another `MZ` handler).
    "facts.wsl:InteropRegistration": Inputs(
        paths={f"{BINFMT_DIR}/{name}" for name in INTEROP_BINFMT_NAMES}, globs={f"{BINFMT_DIR}/*"}
    ),
    "facts.apt_sources:AptSourceFiles": Inputs(paths={APT_SOURCES_DIR}, trees={APT_SOURCES_DIR}),
    "pyinfra.facts.deb:DebPackages": _paths(DPKG_STATUS),
    "pyinfra.facts.server:Users": Inputs(paths=set(ACCOUNT_FILES)),
    "pyinfra.facts.server:Groups": _paths("/etc/group"),
    "pyinfra.facts.server:Os": BOOT_ONLY,
    "pyinfra.facts.server:TmpDir": BOOT_ONLY,
    "pyinfra.facts.server:Which": _paths(DPKG_STATUS, "/usr/local/bin", "/usr/bin", "/bin"),
}
_BY_ARGUMENTS = {
    "facts.account:Account": lambda kwargs: Inputs(paths=set(ACCOUNT_FILES)),
    "facts.cuda:CudaToolchain": _cuda,
    "facts.engine:EngineInstall": _engine_install,
    "facts.engine:EngineHealth": _health,
    "facts.files:FileText": _one_path("path"),
    "facts.files:FileBytes": _one_path("path"),
    "facts.guard:GuardState": _one_path("state_file"),
    "facts.model:ModelDirectory": _tree("path"),
    "facts.model_manifest:ModelManifest": _tree("model_dir"),
    "facts.ownership:DirOwnership": _ownership,
    "facts.restart:RestartPending": _restart,
    "facts.windows:WslConfigFile": _one_path("path"),
    # The same file as WslConfigFile, as bytes for the merge. A folder on the way swapped for a
    # link shows in the file's lstat (another inode); and a run the fast check skips reads and
    # writes nothing there at all.
    "facts.windows:WindowsFile": _one_path("path"),
    # The Desktop and its two shortcuts; the distro's name changes only with a boot.
    "facts.windows:OwnerShortcuts": _shortcuts,
    "pyinfra.facts.files:File": _one_path("path"),
    "pyinfra.facts.files:Directory": _one_dir,
    "pyinfra.facts.files:Link": _one_path("path"),
    "pyinfra.facts.files:Sha1File": _one_path("path"),
    "pyinfra.facts.files:Sha256File": _one_path("path"),
    "pyinfra.facts.systemd:SystemdStatus": _units,
    "pyinfra.facts.systemd:SystemdEnabled": _units,
}


def inputs_of(fact: str, kwargs: dict[str, Any]) -> Inputs | None:
    """The inputs of one fact request (None: not known, so no signature can stand for it)."""
    if fact in _FIXED:
        fixed = _FIXED[fact]
        return Inputs(*(set(getattr(fixed, k)) for k in ("paths", "dirs", "globs", "trees", "units", "health", "nft")))
    inputs = _BY_ARGUMENTS.get(fact)
    return inputs(kwargs) if inputs is not None else None


def inputs_of_run(requests: list[dict[str, Any]]) -> Inputs | str:
    """Every input of a run's fact requests (``facts.batch.asked``), or why there is none."""
    merged = Inputs()
    for request in requests:
        fact, kwargs = request.get("fact"), request.get("kwargs")
        found = inputs_of(fact, kwargs) if isinstance(fact, str) and isinstance(kwargs, dict) else None
        if found is None:
            return f"the run read {fact!r}, whose inputs are not known"
        merged.add(found)
    return merged
