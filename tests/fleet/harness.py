"""The simulated fleet: real Debian hosts (systemd as PID 1, sshd) in systemd-nspawn containers,
each in its own network namespace on one bridge, dressed up as Windows+WSL2 workstations with an
NVIDIA GPU by the stand-ins in tests/fleet/standins/ (README, Testing).

    up(n)    build/reuse the base root fs, start the bridge services and n hosts, write state.json
    down()   stop everything by the PIDs recorded in state.json, remove netns/links/host copies
    Fleet    the running fleet read from state.json: run(), reboot(), set_swap_used(), snapshot()

Everything the hosts fetch is served on the bridge address; they have no route beyond it.
Needs root. Paths: FREETOKEN_SIM_CACHE (default /var/cache/freetoken-sim: base root fs, host
copies, .deb cache, SSH key) and FREETOKEN_SIM_STATE (default /run/freetoken-sim: state.json,
PIDs, logs, served directories).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tests.fleet import profiles
from tests.fleet.profiles import (
    BRIDGE_ADDRESS,
    BRIDGE_NAME,
    BRIDGE_PREFIX,
    GATEWAY_ADDRESS,
    GATEWAY_NAME,
    HostProfile,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDINS = Path(__file__).resolve().parent / "standins"
SUITE = "bookworm"
BASE_PACKAGES = "systemd,systemd-sysv,dbus,openssh-server,python3,iproute2,ca-certificates"
NETNS_PREFIX = "ftsim-"  # netns and host-side veth names: ftsim-ws1, ...
COMPLETE_MARK = ".freetoken-sim-complete"
BOOT_TIMEOUT_S = float(os.environ.get("FREETOKEN_SIM_BOOT_TIMEOUT", "120"))

PORTS = {"apt_proxy": 3142, "cuda_repo": 8081, "hub": 8082, "wheelhouse": 8083, "vm_memory": 8084}
CUDA_REPO_PATH = "compute/cuda/repos/ubuntu2404/x86_64/"

# Host tools the harness needs, by command -> Debian package (installed when missing).
HOST_TOOLS = {
    "debootstrap": "debootstrap",
    "systemd-nspawn": "systemd-container",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "gcc": "gcc",
    "apt-ftparchive": "apt-utils",
    "gpg": "gnupg",
    "dpkg-deb": "dpkg",
}


class FleetError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("FREETOKEN_SIM_CACHE", "/var/cache/freetoken-sim"))


def state_dir() -> Path:
    return Path(os.environ.get("FREETOKEN_SIM_STATE", "/run/freetoken-sim"))


def state_file() -> Path:
    return state_dir() / "state.json"


def host_count() -> int:
    """How many hosts a fleet has unless told otherwise: FREETOKEN_SIM_HOSTS, by default one per
    profile (ws1..ws3). The CLI, the pytest fixture and the benchmark all ask here."""
    value = os.environ.get("FREETOKEN_SIM_HOSTS", str(len(profiles.PROFILES)))
    if not value.isdigit() or not 1 <= int(value) <= profiles.MAX_HOSTS:
        raise FleetError(
            f"FREETOKEN_SIM_HOSTS={value!r}: expected a whole number of hosts from 1 "
            f"to {profiles.MAX_HOSTS} (hosts beyond ws3 repeat the healthy profiles)"
        )
    return int(value)


def host_names(n_hosts: int) -> list[str]:
    return [f"ws{i}" for i in range(1, n_hosts + 1)]


LOCK_FD_ENV = "FREETOKEN_SIM_LOCK_FD"
_held_lock: list = []  # the lock file this process holds (nested exclusive() re-enter)


def _inherited_lock_fd(path: Path) -> int | None:
    """The fd named by FREETOKEN_SIM_LOCK_FD if it is the fleet lock file, inherited from a
    parent that holds the lock: flock belongs to the open file, so the child holds it too."""
    value = os.environ.get(LOCK_FD_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        st, want = os.fstat(fd), path.stat()
    except OSError:
        return None
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        return None
    try:  # succeeds at once only when this open file already holds the lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    return fd


@contextlib.contextmanager
def exclusive():
    """Hold the machine's one fleet: the bridge, addresses and container names are fixed, so two
    test sessions, benchmarks or hand-run `python -m tests.fleet up/down` wait for each other here
    instead of tearing each other's hosts down. Re-entrant: a nested call in the same process, or
    a child given the holder's lock by lock_for_child(), goes on without waiting."""
    path = cache_dir() / "fleet.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    if _held_lock or _inherited_lock_fd(path) is not None:
        yield  # the holder (this process or the parent) releases it
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"another session holds the simulated fleet ({path}); waiting")
            fcntl.flock(f, fcntl.LOCK_EX)
        _held_lock.append(f)
        try:
            yield
        finally:
            _held_lock.remove(f)  # closing the file releases the lock


def lock_for_child() -> tuple[dict, tuple[int]]:
    """(env, pass_fds) for a subprocess that should act under the lock this process holds, e.g.
    a `python -m tests.fleet up` started by a test of the session that holds the fleet."""
    if not _held_lock:
        raise FleetError("lock_for_child() outside harness.exclusive()")
    fd = _held_lock[-1].fileno()
    return {**os.environ, LOCK_FD_ENV: str(fd)}, (fd,)


def _log(msg: str) -> None:
    print(f"[fleet] {msg}", file=sys.stderr, flush=True)


def _sh(*cmd, check=True, quiet=False, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("text", True)
    if quiet:
        kw.setdefault("stdout", subprocess.DEVNULL)
        kw.setdefault("stderr", subprocess.DEVNULL)
    return subprocess.run([str(c) for c in cmd], check=check, **kw)


# ---------------------------------------------------------------------------- machine setup


def ensure_host_tools() -> None:
    if os.geteuid() != 0:
        raise FleetError("the simulated fleet needs root (systemd-nspawn, network namespaces)")
    missing = sorted({pkg for cmd, pkg in HOST_TOOLS.items() if shutil.which(cmd) is None})
    if not Path("/usr/include/stdio.h").exists():
        missing.append("libc6-dev")
    if missing:
        _log(f"installing host packages: {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _sh("apt-get", "update", quiet=True, check=False, env=env)
        _sh("apt-get", "install", "-y", "--no-install-recommends", *missing, env=env)


def apt_sources() -> list[tuple[str, list[str]]]:
    """(URI, suites) of this machine's apt sources (deb822 .sources and one-line .list)."""
    found: list[tuple[str, list[str]]] = []
    paths = [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*"))
    for path in paths:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".sources":
            for stanza in text.split("\n\n"):
                fields: dict[str, str] = {}
                for line in stanza.splitlines():
                    if line.startswith("#") or ":" not in line or line.startswith(" "):
                        continue
                    k, v = line.split(":", 1)
                    fields[k.strip().lower()] = v.strip()
                if "deb" in fields.get("types", "").split():
                    for uri in fields.get("uris", "").split():
                        found.append((uri, fields.get("suites", "").split()))
        elif path.suffix == ".list" or path.name == "sources.list":
            for line in text.splitlines():
                parts = line.split("#", 1)[0].split()
                if parts[:1] == ["deb"]:
                    parts = [p for p in parts[1:] if not p.startswith("[")]
                    if len(parts) >= 2:
                        found.append((parts[0], [parts[1]]))
    return found


def debian_mirror() -> str:
    """The machine's configured Debian mirror for SUITE (read at run time, never hard-coded)."""
    for uri, suites in apt_sources():
        if SUITE in suites and uri.startswith("http"):
            return uri.rstrip("/")
    raise FleetError(f"no Debian mirror for {SUITE} in this machine's apt sources")


def ensure_base_rootfs() -> Path:
    """Debootstrap the base root fs once; later runs reuse it from the cache."""
    base = cache_dir() / f"rootfs-{SUITE}"
    if (base / COMPLETE_MARK).exists():
        return base
    tmp = cache_dir() / f"rootfs-{SUITE}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    cache_dir().mkdir(parents=True, exist_ok=True)
    mirror = debian_mirror()
    _log(f"debootstrap {SUITE} from {mirror} (once; cached in {base})")
    t0 = time.monotonic()
    r = _sh(
        "debootstrap",
        "--variant=minbase",
        f"--include={BASE_PACKAGES}",
        SUITE,
        tmp,
        mirror,
        check=False,
        capture_output=True,
    )
    if r.returncode != 0:
        raise FleetError(f"debootstrap failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    tmp.rename(base)
    (base / COMPLETE_MARK).write_text(f"{mirror} {time.time()}\n")
    _log(f"debootstrap took {time.monotonic() - t0:.0f} s")
    return base


def ensure_ssh_key() -> Path:
    key = cache_dir() / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "freetoken-sim", "-f", key)
    return key


def build_libcuda() -> Path:
    src = STANDINS / "libcuda.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    out = cache_dir() / "build" / f"libcuda-{digest}.so.1"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _sh("gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-soname,libcuda.so.1", "-o", str(out) + ".tmp", src)
        os.replace(str(out) + ".tmp", out)
    return out


def build_libnvidia_ml() -> Path:
    """NVML's STAND-IN (tests/fleet/standins/libnvidia-ml.c), built as build_libcuda builds its."""
    src = STANDINS / "libnvidia-ml.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    out = cache_dir() / "build" / f"libnvidia-ml-{digest}.so.1"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        _sh("gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(out) + ".tmp", src)
        os.replace(str(out) + ".tmp", out)
    return out


# ---------------------------------------------------------------------------- state


def load_state() -> dict | None:
    try:
        return json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None


def _save_state(state: dict) -> None:
    state_dir().mkdir(parents=True, exist_ok=True)
    tmp = state_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, ensure_ascii=False))
    os.replace(tmp, state_file())


def _pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours counts as dead
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _stop_pid(pid: int, expect: str, term_wait: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the process `pid` if its command line still contains `expect`."""
    if not pid or expect not in _pid_cmdline(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + term_wait
    while time.monotonic() < deadline:
        _reap(pid)
        if not _alive(pid):
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(50):
        _reap(pid)
        if not _alive(pid):
            return
        time.sleep(0.1)


def _netns_names() -> list[str]:
    r = _sh("ip", "netns", "list", check=False, capture_output=True)
    return [
        line.split()[0] for line in r.stdout.splitlines() if line.split() and line.split()[0].startswith(NETNS_PREFIX)
    ]


def _kill_netns_processes(ns: str) -> None:
    """SIGKILL every process inside namespace `ns` (all of them are a container's)."""
    for _ in range(20):
        r = _sh("ip", "netns", "pids", ns, check=False, capture_output=True)
        pids = [int(p) for p in r.stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _our_stray_processes() -> list[int]:
    """PIDs of processes this harness starts, found by their exact command lines: nspawn on our
    host copies, servers bound to the bridge address (after a crash lost their PIDs), and
    copy/chroot helpers still writing into a host tree after their parent was killed."""
    hosts_dir = str(cache_dir() / "hosts") + "/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmd = _pid_cmdline(int(entry.name))
        if (
            ("systemd-nspawn" in cmd and f"-D {hosts_dir}" in cmd)
            or ("tests.fleet.standins" in cmd and BRIDGE_ADDRESS in cmd)
            or ("http.server" in cmd and f"--bind {BRIDGE_ADDRESS}" in cmd)
            or (os.path.basename(cmd.split(" ", 1)[0]) in ("cp", "chroot") and hosts_dir in cmd)
        ):
            found.append(int(entry.name))
    return found


def _teardown(state: dict | None, quiet: bool = False) -> None:
    """Stop and remove everything of ours: recorded PIDs first, then anything named like ours."""
    say = (lambda m: None) if quiet else _log
    state = state or {}
    hosts = state.get("hosts", {})
    extra = [(n, state[k]) for n, k in ((GATEWAY_NAME, "gateway"), (BARE_NAME, "bare")) if state.get(k)]
    for name, h in list(hosts.items()) + extra:
        if h.get("pid"):
            say(f"stopping {name} (nspawn pid {h['pid']})")
            _stop_pid(h["pid"], "systemd-nspawn", term_wait=15)
    for ns in _netns_names():
        _kill_netns_processes(ns)
    for name, svc in state.get("services", {}).items():
        if svc.get("pid"):
            say(f"stopping {name} (pid {svc['pid']})")
            _stop_pid(svc["pid"], svc.get("match", "python"), term_wait=5)
    for pid in _our_stray_processes():
        say(f"stopping leftover process {pid}: {_pid_cmdline(pid)[:100]}")
        _stop_pid(pid, "", term_wait=5)
    for ns in _netns_names():
        _sh("ip", "netns", "delete", ns, check=False, quiet=True)
    links = _sh("ip", "-o", "link", "show", check=False, capture_output=True).stdout
    for line in links.splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(NETNS_PREFIX):
            _sh("ip", "link", "delete", link, check=False, quiet=True)
    _sh("ip", "link", "delete", BRIDGE_NAME, check=False, quiet=True)
    shutil.rmtree(cache_dir() / "hosts", ignore_errors=True)
    shutil.rmtree(state_dir(), ignore_errors=True)


def down(quiet: bool = False) -> None:
    """Tear the fleet down by the PIDs recorded in state.json (and leftovers named like ours)."""
    _teardown(load_state(), quiet=quiet)


# ---------------------------------------------------------------------------- network


def _setup_bridge() -> None:
    _sh("ip", "link", "add", BRIDGE_NAME, "type", "bridge")
    _sh("ip", "addr", "add", f"{BRIDGE_ADDRESS}/{BRIDGE_PREFIX}", "dev", BRIDGE_NAME)
    _sh("ip", "link", "set", BRIDGE_NAME, "up")


def _setup_host_network(name: str, address: str) -> str:
    ns = NETNS_PREFIX + name
    _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns)
    _sh("ip", "link", "set", ns, "master", BRIDGE_NAME, "up")
    _sh("ip", "-n", ns, "addr", "add", f"{address}/{BRIDGE_PREFIX}", "dev", "eth0")
    _sh("ip", "-n", ns, "link", "set", "eth0", "up")
    _sh("ip", "-n", ns, "link", "set", "lo", "up")
    # no default route: the bridge's /24 is all a host can reach
    return ns


def _wait_port(address: str, port: int, timeout: float, what: str, log: Path | None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    raise FleetError(f"{what} did not listen on {address}:{port} within {timeout:.0f} s\n{tail}")


# ---------------------------------------------------------------------------- services


def _start_service(state: dict, name: str, argv: list[str], port: int, url: str, match: str) -> None:
    log = state_dir() / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    state["services"][name] = {"pid": proc.pid, "url": url, "port": port, "log": str(log), "match": match}
    _save_state(state)
    _wait_port(BRIDGE_ADDRESS, port, 30, name, log)


def _start_services(state: dict) -> None:
    py = sys.executable
    srv = state_dir() / "srv"
    srv.mkdir(parents=True, exist_ok=True)
    base = f"http://{BRIDGE_ADDRESS}"

    # Debian packages for the hosts, through a caching forward proxy to this machine's mirror.
    allow = sorted({u.split("/")[2].split(":")[0] for u, _ in apt_sources() if u.startswith("http")})
    argv = [
        py,
        "-m",
        "tests.fleet.standins.apt_proxy",
        "--bind",
        BRIDGE_ADDRESS,
        "--port",
        str(PORTS["apt_proxy"]),
        "--cache",
        str(cache_dir() / "debs"),
    ]
    for host in allow:
        argv += ["--allow", host]
    _start_service(
        state, "apt_proxy", argv, PORTS["apt_proxy"], f"{base}:{PORTS['apt_proxy']}", "tests.fleet.standins.apt_proxy"
    )

    # NVIDIA's CUDA apt repository (stand-in), signed, flat, served statically.
    cuda_url = f"{base}:{PORTS['cuda_repo']}/{CUDA_REPO_PATH}"
    from tests.fleet.standins import cuda_repo

    cuda_repo.build(srv / "cuda", cuda_url)
    _start_service(
        state,
        "cuda_repo",
        [py, "-m", "http.server", "--bind", BRIDGE_ADDRESS, "--directory", str(srv / "cuda"), str(PORTS["cuda_repo"])],
        PORTS["cuda_repo"],
        cuda_url,
        "http.server",
    )
    state["services"]["cuda_repo"]["keyring_url"] = cuda_url + "cuda-keyring_1.1-1_all.deb"

    # The hub and the wheelhouse: modules written by another helper (tests/fleet/standins/
    # hub.py + hub_repos.py, wheelhouse.py). Started when present, else recorded as missing.
    if (STANDINS / "hub.py").exists() and (STANDINS / "hub_repos.py").exists():
        _sh(
            py,
            "-m",
            "tests.fleet.standins.hub_repos",
            "build",
            srv / "hub",
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            quiet=True,
        )
        _start_service(
            state,
            "hub",
            [
                py,
                "-m",
                "tests.fleet.standins.hub",
                "--bind",
                BRIDGE_ADDRESS,
                "--port",
                str(PORTS["hub"]),
                "--repos",
                str(srv / "hub"),
            ],
            PORTS["hub"],
            f"{base}:{PORTS['hub']}",
            "tests.fleet.standins.hub",
        )
    else:
        state["services"]["hub"] = {"pid": None, "url": None, "missing": "standins/hub.py"}
        _log("note: tests/fleet/standins/hub.py not there yet; hub stand-in not started")
    # The VM kernel's memory accounting (stand-in): grows a host's swap use on its engine
    # stand-in's request (the `swap` fault), by rewriting that host's /.sim/meminfo.
    _start_service(
        state,
        "vm_memory",
        [
            py,
            "-m",
            "tests.fleet.standins.vm_memory",
            "--bind",
            BRIDGE_ADDRESS,
            "--port",
            str(PORTS["vm_memory"]),
            "--state",
            str(state_file()),
        ],
        PORTS["vm_memory"],
        f"{base}:{PORTS['vm_memory']}/swap/grow",
        "tests.fleet.standins.vm_memory",
    )
    if (STANDINS / "wheelhouse.py").exists():
        _sh(
            py,
            "-m",
            "tests.fleet.standins.wheelhouse",
            "build",
            srv / "wheelhouse",
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            quiet=True,
        )
        _start_service(
            state,
            "wheelhouse",
            [
                py,
                "-m",
                "http.server",
                "--bind",
                BRIDGE_ADDRESS,
                "--directory",
                str(srv / "wheelhouse"),
                str(PORTS["wheelhouse"]),
            ],
            PORTS["wheelhouse"],
            f"{base}:{PORTS['wheelhouse']}/simple/",
            "http.server",
        )
    else:
        state["services"]["wheelhouse"] = {"pid": None, "url": None, "missing": "standins/wheelhouse.py"}
        _log("note: tests/fleet/standins/wheelhouse.py not there yet; wheelhouse not started")
    _save_state(state)


# ---------------------------------------------------------------------------- host root fs


def meminfo_text(profile: HostProfile, swap_used: int = 0) -> str:
    """/proc/meminfo as the WSL VM of `profile` reports it (real layout: 16-column label,
    8-column right-aligned value, ' kB')."""
    kb = lambda b: int(b // 1024)  # noqa: E731
    total = profile.mem_total_bytes
    used = 1_400 * 1024**2
    cached = 900 * 1024**2
    swap_total = profile.swap_total_bytes
    swap_used = max(0, min(swap_used, swap_total))
    rows = [
        ("MemTotal", kb(total)),
        ("MemFree", kb(total - used - cached)),
        ("MemAvailable", kb(total - used)),
        ("Buffers", 40_212),
        ("Cached", kb(cached)),
        ("SwapCached", kb(min(swap_used, 64 * 1024**2))),
        ("Active", 612_104),
        ("Inactive", 1_024_388),
        ("Active(anon)", 402_816),
        ("Inactive(anon)", 0),
        ("Active(file)", 209_288),
        ("Inactive(file)", 1_024_388),
        ("Unevictable", 0),
        ("Mlocked", 0),
        ("SwapTotal", kb(swap_total)),
        ("SwapFree", kb(swap_total - swap_used)),
        ("Zswap", 0),
        ("Zswapped", 0),
        ("Dirty", 112),
        ("Writeback", 0),
        ("AnonPages", 398_220),
        ("Mapped", 187_404),
        ("Shmem", 3_320),
        ("KReclaimable", 61_932),
        ("Slab", 132_848),
        ("SReclaimable", 61_932),
        ("SUnreclaim", 70_916),
        ("KernelStack", 6_496),
        ("PageTables", 9_876),
        ("SecPageTables", 0),
        ("NFS_Unstable", 0),
        ("Bounce", 0),
        ("WritebackTmp", 0),
        ("CommitLimit", kb(total // 2 + swap_total)),
        ("Committed_AS", 2_131_468),
        ("VmallocTotal", 34_359_738_367),
        ("VmallocUsed", 28_132),
        ("VmallocChunk", 0),
        ("Percpu", 5_888),
        ("AnonHugePages", 0),
        ("ShmemHugePages", 0),
        ("ShmemPmdMapped", 0),
        ("FileHugePages", 0),
        ("FilePmdMapped", 0),
    ]
    lines = [f"{k + ':':<16}{v:>8} kB" for k, v in rows]
    lines += [
        f"{'HugePages_Total:':<16}{0:>8}",
        f"{'HugePages_Free:':<16}{0:>8}",
        f"{'HugePages_Rsvd:':<16}{0:>8}",
        f"{'HugePages_Surp:':<16}{0:>8}",
        f"{'Hugepagesize:':<16}{2048:>8} kB",
        f"{'Hugetlb:':<16}{0:>8} kB",
        f"{'DirectMap4k:':<16}{120_832:>8} kB",
        f"{'DirectMap2M:':<16}{6_170_624:>8} kB",
        f"{'DirectMap1G:':<16}{kb(total) // 1024 // 1024 * 1024 * 1024:>8} kB",
    ]
    return "\n".join(lines) + "\n"


def write_meminfo(path: Path, profile: dict, swap_used: int) -> None:
    """Rewrite a host's /.sim/meminfo in place (same inode, so the bind mount over /proc/meminfo
    sees it; the values are fixed-width, so a reader never sees a half-written file)."""
    text = meminfo_text(HostProfile(**{**profile, "gpu": profiles.GpuProfile(**profile["gpu"])}), swap_used=swap_used)
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(text.encode())
        f.truncate()


def proc_version_text(profile: HostProfile) -> str:
    return (
        f"Linux version {profile.kernel_release} (root@af282157c79e) (gcc (GCC) 11.2.0, "
        f"GNU ld (GNU Binutils) 2.37) #1 SMP PREEMPT_DYNAMIC Thu Jun  5 18:30:46 UTC 2025\n"
    )


def gpu_conf_text(profile: HostProfile) -> str:
    g = profile.gpu
    return (
        "# STAND-IN GPU description for the simulated fleet's libcuda.so.1 and nvidia-smi\n"
        f"name={g.name}\nmemory_total_mib={g.memory_total_mib}\n"
        f"memory_used_mib={g.memory_used_mib}\ncompute_cap={g.compute_cap}\n"
        f"allocation_locked={int(g.allocation_locked)}\nlocked_free_mib={g.locked_free_mib}\n"
        f"cuda_driver_api_version={g.cuda_driver_api_version}\n"
    )


WSLCONFIG = "# my own settings - keep this comment\n[wsl2]\nmemory=16GB\nguiApplications=false\n"

# The Windows programs of the stand-ins, each run through the interop stand-ins.
WINDOWS_PROGRAMS = ("wsl.exe", "cmd.exe", "schtasks.exe", "powercfg.exe", "tasklist.exe", "reg.exe", "powershell.exe")
PE_STANDIN = b"#!/.sim/binfmt/handler\0 STAND-IN of a Windows program: run through WSL interop (tests/fleet/standins)\n"
OWNER_UID = 1000  # WSL's default user, whose uid DrvFs shows on every file of the drives

WSL_BINFMT_UNIT = """\
# STAND-IN for WSL's init registering its interop handler before systemd starts (a new table
# each boot, as the kernel's is new with each VM): tests/fleet/standins/bin/binfmt.
[Unit]
Description=STAND-IN: WSL's binfmt registration (WSLInterop)
DefaultDependencies=no
Before=sysinit.target systemd-binfmt.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/.sim/bin/binfmt boot
"""

WSL_INTEROP_UNIT = """\
# STAND-IN for WSL init's interop server (/run/WSL/<pid>_interop, 0777, linked as 1_interop):
# tests/fleet/standins/bin/wsl-interop-server.
[Unit]
Description=STAND-IN: WSL interop server
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=notify
ExecStart=/.sim/bin/wsl-interop-server
"""


def drvfs_defaults(root: Path, user: str) -> None:
    """The C: drive as DrvFs shows it with WSL's default automount options (no `metadata`): every
    file and folder the default user's (uid 1000) and mode 0777, so every Linux account can read,
    write and replace what is there (microsoft/WSL docs, "File permissions for WSL"; DrvFs
    mount options uid=1000,gid=1000,umask=000 by default). Windows' own folder stays root's and
    0755 here: Windows' ACLs deny the owner's unelevated token, with which every access is made,
    any write there. The default user exists in the distro, as WSL's setup makes it."""
    for line, name in (
        (f"{user}:x:{OWNER_UID}:{OWNER_UID}::/home/{user}:/bin/bash\n", "passwd"),
        (f"{user}:x:{OWNER_UID}:\n", "group"),
        (f"{user}:!:20000::::::\n", "shadow"),
    ):
        path = root / "etc" / name
        if f"\n{user}:" not in "\n" + path.read_text():
            with open(path, "a") as f:
                f.write(line)
    home = root / "home" / user
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, OWNER_UID, OWNER_UID)
    drive = root / "mnt/c"
    for d, dirs, names in os.walk(drive):
        here = Path(d)
        if here == drive / "Windows" or here == drive / ".sim":
            dirs[:] = []
            continue
        for p in [here, *(here / n for n in names)]:
            os.chown(p, OWNER_UID, OWNER_UID, follow_symlinks=False)
            p.chmod(0o777)
        dirs[:] = [x for x in dirs if not (here / x).is_symlink()]


def _write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    path.chmod(mode)


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


def prepare_root(root: Path, profile: HostProfile, pubkey: str, libcuda: Path, nvml: Path | None = None) -> None:
    """Dress a fresh copy of the base root fs up as the profile's WSL2 workstation."""
    nvml = nvml if nvml is not None else build_libnvidia_ml()
    sim = root / ".sim"
    _write(
        sim / "README",
        "STAND-IN data of the simulated fleet (tests/fleet/harness.py): "
        "profile, /proc/version and /proc/meminfo sources, stand-in tools.\n",
    )
    _write(sim / "version", proc_version_text(profile))
    _write(sim / "meminfo", meminfo_text(profile))
    _write(sim / "profile.json", json.dumps(profile.to_dict(), indent=1, ensure_ascii=False))
    _write(sim / "gpu.conf", gpu_conf_text(profile))
    # Linux-side WSL tools and the interop machinery (STAND-INs, tests/fleet/standins/bin): the
    # binfmt table and systemd-binfmt, the interop client (WSL's /init in its binfmt role), its
    # server, binfmt-support's run-detectors.
    for tool in ("_simwin.py", "wslinfo", "wslpath", "init", "wsl-interop-server", "binfmt", "run-detectors"):
        _write(sim / "bin" / tool, (STANDINS / "bin" / tool).read_bytes(), 0o755)
    # The Windows programs themselves, run only by the interop server stand-in (root's folder:
    # no Linux account reaches Windows but through interop).
    (sim / "windows").mkdir(mode=0o700, parents=True, exist_ok=True)
    for tool in ("_simwin.py", *WINDOWS_PROGRAMS):
        _write(sim / "windows" / tool, (STANDINS / "bin" / tool).read_bytes(), 0o755)
    (sim / "switches").mkdir(parents=True, exist_ok=True)
    (sim / "binfmt_misc").mkdir(parents=True, exist_ok=True)  # bound over /proc/sys/fs/binfmt_misc
    # A file of no executable format: what runs a Windows program while no registration claims
    # `MZ` (tests/fleet/standins/bin/binfmt), so execve fails with ENOEXEC as on WSL.
    _write(sim / "binfmt/noexec", b"MZ\x90\x00\x03" + bytes(59), 0o755)
    _link(root / "usr/lib/systemd/systemd-binfmt", "/.sim/bin/binfmt")
    _write(root / "etc/systemd/system/wsl-binfmt-standin.service", WSL_BINFMT_UNIT)
    _write(root / "etc/systemd/system/wsl-interop-standin.service", WSL_INTEROP_UNIT)
    for unit in ("wsl-binfmt-standin.service", "wsl-interop-standin.service"):
        _link(root / "etc/systemd/system/sysinit.target.wants" / unit, f"/etc/systemd/system/{unit}")

    # Windows side (STAND-INs): C: drive, the user's profile, interop executables. The .exe
    # files are only in System32, not on PATH: a real distro reached over SSH (sshd under
    # systemd) gets no Windows folders on PATH, so the deploy must find them there itself.
    # Each is a program of Windows' format to Linux: its first line hands it to the binfmt
    # handler (a NUL ends that line, so a shell, like the kernel, never reads it as a script).
    system32 = root / "mnt/c/Windows/System32"
    for exe in WINDOWS_PROGRAMS:
        where = system32 / ("WindowsPowerShell/v1.0" if exe == "powershell.exe" else "") / exe
        _write(where, PE_STANDIN, 0o755)
    _link(root / "usr/bin/wslinfo", "/.sim/bin/wslinfo")
    _link(root / "usr/bin/wslpath", "/.sim/bin/wslpath")
    user_dir = root / "mnt/c/Users" / profile.windows_user
    _write(user_dir / ".wslconfig", WSLCONFIG)
    (user_dir / "Desktop").mkdir(parents=True, exist_ok=True)  # where the owner's shortcuts go
    (root / "mnt/c/.sim").mkdir(parents=True, exist_ok=True)
    drvfs_defaults(root, profile.windows_user)

    # GPU (STAND-INs): WSL's driver library directory, nvidia-smi, libcuda, NVML (what the host
    # agent reads the card's memory through), /dev/dxg.
    wsl_lib = root / "usr/lib/wsl/lib"
    _write(wsl_lib / "nvidia-smi", (STANDINS / "bin" / "nvidia-smi").read_bytes(), 0o755)
    for so in ("libcuda.so", "libcuda.so.1", "libcuda.so.1.1"):
        _write(wsl_lib / so, libcuda.read_bytes(), 0o755)
    _write(wsl_lib / "libnvidia-ml.so.1", nvml.read_bytes(), 0o755)
    _write(
        root / "etc/ld.so.conf.d/ld.wsl.conf",
        "# This file was automatically generated by WSL. To stop automatic generation of "
        "this file, add the following entry to /etc/wsl.conf:\n# [automount]\n"
        "# ldconfig = false\n/usr/lib/wsl/lib\n",
    )
    _write(
        root / "etc/tmpfiles.d/wsl-dxg.conf",
        "# STAND-IN for WSL's /dev/dxg (the GPU paravirtualisation device), made at boot\n"
        "c /dev/dxg 0666 root root - 10:63\n",
    )
    _sh("chroot", root, "ldconfig", quiet=True)

    # Engine stand-in: pace, the GPU its CUDA OOM line names, where its `swap` fault asks for
    # swap growth (read by tests/fleet/standins/engine).
    g = profile.gpu
    gpu_free_mib = g.locked_free_mib if g.allocation_locked else g.memory_total_mib - g.memory_used_mib
    _write(
        root / "etc/freetoken-standin.json",
        json.dumps(
            {
                "tokens_per_s": profile.tokens_per_s,
                "load_seconds": profile.load_seconds,
                "gpu_total_mib": g.memory_total_mib,
                "gpu_free_mib": gpu_free_mib,
                "swap_url": f"http://{BRIDGE_ADDRESS}:{PORTS['vm_memory']}/swap/grow",
            }
        )
        + "\n",
    )

    prepare_plain_root(root, profile.name, pubkey)


def prepare_plain_root(root: Path, name: str, pubkey: str) -> None:
    """What every simulated host gets, the gateway too: apt through the bridge, root's SSH key,
    its name."""
    # apt: Debian through the bridge proxy, the bridge's own repos directly.
    _write(
        root / "etc/apt/apt.conf.d/01freetoken-sim-proxy",
        "// simulated fleet: the host reaches the Debian mirror only through the harness's\n"
        "// caching proxy on the bridge; repositories on the bridge itself are direct.\n"
        f'Acquire::http::Proxy "http://{BRIDGE_ADDRESS}:{PORTS["apt_proxy"]}";\n'
        f'Acquire::http::Proxy::{BRIDGE_ADDRESS} "DIRECT";\n',
    )

    # root login with the harness's key; hostname.
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(ssh_dir / "authorized_keys", pubkey, 0o600)
    _write(root / "etc/hostname", name + "\n")
    _write(root / "etc/hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{name}\n{BRIDGE_ADDRESS}\tftsim-bridge\n")


# ---------------------------------------------------------------------------- containers


def _nspawn_argv(name: str, root: Path, ns: str, wsl: bool = True) -> list[str]:
    argv = [
        "systemd-nspawn",
        "--register=no",
        "--keep-unit",
        "--quiet",
        "-b",
        "-D",
        str(root),
        "-M",
        name,
        f"--network-namespace-path=/run/netns/{ns}",
        "--console=pipe",
        "--resolv-conf=off",
        "--timezone=off",
    ]
    if wsl:  # the gateway is a plain Debian host: no WSL kernel or VM memory stand-ins
        argv += [
            # The deploy's firewall (operations/firewall.py) loads nftables rules, as root in a
            # WSL VM may; nspawn keeps CAP_NET_ADMIN only when asked (the netns is the host's own).
            "--capability=CAP_NET_ADMIN",
            "--bind-ro=/.sim/version:/proc/version",  # source must be inside the tree
            "--bind-ro=/.sim/meminfo:/proc/meminfo",
            # The binfmt_misc table, as WSL's (tests/fleet/standins/bin/binfmt).
            "--bind=/.sim/binfmt_misc:/proc/sys/fs/binfmt_misc",
        ]
    return argv


def _record(state: dict, name: str) -> dict:
    """A container's record in state.json: a workstation's, or the gateway's."""
    if name == GATEWAY_NAME and state.get("gateway"):
        return state["gateway"]
    if name == BARE_NAME and state.get("bare"):
        return state["bare"]
    return state["hosts"][name]


def _start_container(state: dict, name: str) -> None:
    h = _record(state, name)
    log = Path(h["console_log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            _nspawn_argv(name, Path(h["root"]), h["netns"], h.get("wsl", True)),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    h["pid"] = proc.pid
    _save_state(state)


def _ssh_argv(key: str, address: str, known_hosts: str, timeout: int = 5) -> list[str]:
    return [
        "ssh",
        "-i",
        key,
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={timeout}",
        "-o",
        f"UserKnownHostsFile={known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "LogLevel=ERROR",
        f"root@{address}",
    ]


def _wait_booted(state: dict, names: list[str], timeout: float = BOOT_TIMEOUT_S) -> None:
    pending = set(names)
    deadline = time.monotonic() + timeout
    last: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            h = _record(state, name)
            if not _alive(h["pid"]):
                _reap(h["pid"])
                raise FleetError(f"{name}: systemd-nspawn exited during boot\n" + _tail(h["console_log"]))
            r = subprocess.run(
                _ssh_argv(h["ssh_key"], h["address"], state["known_hosts"], 2) + ["systemctl", "is-system-running"],
                capture_output=True,
                text=True,
                timeout=15,
            )
            last[name] = (r.stdout + r.stderr).strip()
            if r.stdout.strip() in ("running", "degraded"):
                pending.discard(name)
        if pending:
            time.sleep(0.5)
    if pending:
        details = "\n".join(
            f"--- {n}: last answer {last.get(n)!r}\n" + _tail(_record(state, n)["console_log"]) for n in sorted(pending)
        )
        raise FleetError(f"hosts not up within {timeout:.0f} s: {', '.join(sorted(pending))}\n" + details)


def _tail(path: str, n: int = 40) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no console log)"
    return "console log tail:\n" + "\n".join(lines[-n:])


def up(n_hosts: int | None = None, gateway: bool = False) -> Fleet:
    """Bring up the bridge services and hosts ws1..wsN (N: host_count()), and the gateway host
    when asked; return the Fleet."""
    n_hosts = host_count() if n_hosts is None else n_hosts
    if not 1 <= n_hosts <= profiles.MAX_HOSTS:
        raise FleetError(f"{n_hosts} hosts: the simulated fleet has 1 to {profiles.MAX_HOSTS}")
    t0 = time.monotonic()
    ensure_host_tools()
    stale = load_state()
    if stale or _netns_names() or Path(f"/sys/class/net/{BRIDGE_NAME}").exists():
        _log("cleaning leftovers of an earlier run")
    _teardown(stale, quiet=True)
    base = ensure_base_rootfs()
    key = ensure_ssh_key()
    libcuda = build_libcuda()
    nvml = build_libnvidia_ml()
    state: dict = {
        "version": 1,
        "started": time.time(),
        "bridge": {"name": BRIDGE_NAME, "address": BRIDGE_ADDRESS, "prefix": BRIDGE_PREFIX},
        "ssh_key": str(key),
        "known_hosts": str(state_dir() / "known_hosts"),
        "cache_dir": str(cache_dir()),
        "state_dir": str(state_dir()),
        "services": {},
        "hosts": {},
    }
    _save_state(state)
    hostkey = (base / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
    names = host_names(n_hosts)
    Path(state["known_hosts"]).write_text("".join(f"{profiles.host_address(n)} {' '.join(hostkey)}\n" for n in names))
    try:
        _setup_bridge()
        _start_services(state)
        pubkey = Path(str(key) + ".pub").read_text()
        for name in names:
            profile = profiles.profile_for(name)
            address = profiles.host_address(name)
            root = cache_dir() / "hosts" / name
            root.parent.mkdir(parents=True, exist_ok=True)
            _sh("cp", "-a", "--reflink=auto", base, root)
            (root / COMPLETE_MARK).unlink(missing_ok=True)
            prepare_root(root, profile, pubkey, libcuda, nvml)
            ns = _setup_host_network(name, address)
            state["hosts"][name] = {
                "name": name,
                "address": address,
                "profile": profile.to_dict(),
                "hardware_class": profile.hardware_class,
                "ssh_key": str(key),
                "ssh_user": "root",
                "root": str(root),
                "netns": ns,
                "pid": None,
                "console_log": str(state_dir() / "logs" / f"{name}.console.log"),
            }
            _start_container(state, name)
        _wait_booted(state, names)
    except BaseException:
        _log("bring-up failed; tearing down")
        _teardown(load_state() or state, quiet=True)
        raise
    state["up_seconds"] = round(time.monotonic() - t0, 1)
    _save_state(state)
    _log(f"{n_hosts} hosts up in {state['up_seconds']} s")
    if gateway:
        start_gateway()
    return Fleet(state)


def start_gateway() -> dict:
    """Boot the gateway host (GATEWAY_NAME at GATEWAY_ADDRESS: plain Debian, reached over SSH
    like the workstations) on the running fleet; nothing when it already runs."""
    state = load_state()
    if not state:
        raise FleetError("simulated fleet not running: python -m tests.fleet up")
    gw = state.get("gateway")
    if gw and gw.get("pid") and _alive(gw["pid"]):
        return gw
    root = cache_dir() / "hosts" / GATEWAY_NAME
    if not gw:
        base = ensure_base_rootfs()
        shutil.rmtree(root, ignore_errors=True)
        _sh("cp", "-a", "--reflink=auto", base, root)
        (root / COMPLETE_MARK).unlink(missing_ok=True)
        prepare_plain_root(root, GATEWAY_NAME, Path(state["ssh_key"] + ".pub").read_text())
        ns = _setup_host_network(GATEWAY_NAME, GATEWAY_ADDRESS)
        hostkey = (base / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
        with open(state["known_hosts"], "a") as f:
            f.write(f"{GATEWAY_ADDRESS} {' '.join(hostkey)}\n")
        state["gateway"] = {
            "name": GATEWAY_NAME,
            "address": GATEWAY_ADDRESS,
            "ssh_key": state["ssh_key"],
            "ssh_user": "root",
            "root": str(root),
            "netns": ns,
            "pid": None,
            "wsl": False,
            "console_log": str(state_dir() / "logs" / f"{GATEWAY_NAME}.console.log"),
        }
        _save_state(state)
    _start_container(state, GATEWAY_NAME)
    _wait_booted(state, [GATEWAY_NAME])
    _log(f"gateway {GATEWAY_NAME} up at {GATEWAY_ADDRESS}")
    return state["gateway"]


def stop_gateway() -> None:
    """Power the gateway host off and remove it (its tree, namespace and link): the fleet is
    back to its workstations, as other tests expect it."""
    state = load_state()
    gw = (state or {}).get("gateway")
    if not gw:
        return
    if gw.get("pid"):
        _stop_pid(gw["pid"], "systemd-nspawn", term_wait=15)
    _kill_netns_processes(gw["netns"])
    _sh("ip", "netns", "delete", gw["netns"], check=False, quiet=True)
    _sh("ip", "link", "delete", gw["netns"], check=False, quiet=True)
    shutil.rmtree(gw["root"], ignore_errors=True)
    del state["gateway"]
    _save_state(state)
    _log(f"gateway {GATEWAY_NAME} removed")


# A workstation as it comes to its owner (tests/fleet/test_enrol.py): dressed like the others,
# but with no sshd, no controller key and systemd off in /etc/wsl.conf. It is reached through
# its console (nsenter into the container) until operations/scripts/enrol.py made it reachable.
# Not a member of the session's fleet: booted only by start_bare(), never in host_names().
BARE_NAME = "ws190"


def console_argv(pid: int) -> list[str]:
    """Run a command inside the container whose systemd-nspawn has ``pid``, as root at its
    console would: its namespaces, root and a clean environment (WSL's own variables only)."""
    inner = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    if not inner:
        raise FleetError(f"container of nspawn pid {pid} has no init process")
    return [
        "nsenter",
        "-t",
        inner[0],
        "-m",
        "-u",
        "-i",
        "-n",
        "-p",
        "-r",
        "-w",
        "env",
        "-i",
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/root",
        "LANG=C.UTF-8",
        # As WSL gives every process it starts (a terminal's shell): its interop socket. A process
        # entered from outside has no parent inside to find it by (tests/fleet/standins/bin/init).
        "WSL_INTEROP=/run/WSL/1_interop",
    ]


def _wait_console_booted(h: dict, timeout: float = BOOT_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = subprocess.run(
                console_argv(h["pid"]) + ["systemctl", "is-system-running"], capture_output=True, text=True, timeout=10
            )
            if r.stdout.strip() in ("running", "degraded"):
                return
        except (FleetError, subprocess.TimeoutExpired):
            pass
        if time.monotonic() > deadline:
            raise FleetError(f"{h['name']}: not booted after {timeout:.0f} s\n{_tail(h['console_log'])}")
        time.sleep(1)


def start_bare() -> dict:
    """Boot the bare workstation BARE_NAME on the running fleet (a fresh tree each time)."""
    state = load_state()
    if not state:
        raise FleetError("simulated fleet not running: python -m tests.fleet up")
    if state.get("bare"):
        stop_bare()
        state = load_state() or state
    root = cache_dir() / "hosts" / BARE_NAME
    shutil.rmtree(root, ignore_errors=True)
    _sh("cp", "-a", "--reflink=auto", ensure_base_rootfs(), root)
    (root / COMPLETE_MARK).unlink(missing_ok=True)
    profile = profiles.profile_for(BARE_NAME)
    prepare_root(root, profile, Path(state["ssh_key"] + ".pub").read_text(), build_libcuda())
    # As it comes to its owner: no controller key, no sshd, systemd off in wsl.conf.
    (root / "root/.ssh/authorized_keys").unlink()
    _sh("chroot", root, "dpkg", "--purge", "openssh-server", quiet=True)
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    _write(root / "etc/wsl.conf", "[boot]\nsystemd=false\n")
    address = profiles.host_address(BARE_NAME)
    ns = _setup_host_network(BARE_NAME, address)
    state["bare"] = {
        "name": BARE_NAME,
        "address": address,
        "profile": profile.to_dict(),
        "hardware_class": profile.hardware_class,
        "ssh_key": state["ssh_key"],
        "ssh_user": "root",
        "root": str(root),
        "netns": ns,
        "pid": None,
        "console_log": str(state_dir() / "logs" / f"{BARE_NAME}.console.log"),
    }
    _save_state(state)
    _start_container(state, BARE_NAME)
    _wait_console_booted(load_state()["bare"])
    _log(f"bare workstation {BARE_NAME} up at {address} (console only)")
    return load_state()["bare"]


def reboot_bare() -> None:
    """What `wsl.exe --shutdown` and opening the distro again do to the bare workstation: its
    processes end, the same tree boots again (waited for through its console)."""
    state = load_state()
    h = (state or {}).get("bare")
    if not h:
        raise FleetError(f"{BARE_NAME} is not running: start_bare() first")
    _stop_pid(h["pid"], "systemd-nspawn", term_wait=20)
    _kill_netns_processes(h["netns"])
    _start_container(state, BARE_NAME)
    _wait_console_booted(load_state()["bare"])


def stop_bare() -> None:
    """Power the bare workstation off and remove it (tree, namespace, link)."""
    state = load_state()
    h = (state or {}).get("bare")
    if not h:
        return
    if h.get("pid"):
        _stop_pid(h["pid"], "systemd-nspawn", term_wait=15)
    _kill_netns_processes(h["netns"])
    _sh("ip", "netns", "delete", h["netns"], check=False, quiet=True)
    _sh("ip", "link", "delete", h["netns"], check=False, quiet=True)
    shutil.rmtree(h["root"], ignore_errors=True)
    del state["bare"]
    _save_state(state)
    _log(f"bare workstation {BARE_NAME} removed")


# ---------------------------------------------------------------------------- running fleet

SNAPSHOT_SCRIPT = r"""
import json, os, subprocess
# What a deploy may touch: system config and state, the Windows side (C: drive: .wslconfig,
# scheduled tasks), apt keyrings, users' homes, caches.
ROOTS = ["/etc", "/opt", "/usr/local", "/var/lib", "/var/cache", "/usr/share/keyrings", "/home",
         "/mnt/c"]
# Changed by the system, by a mere look or by a running service's own data (Prometheus' and
# Alertmanager's under /var/lib/prometheus), never by a deploy alone. The Windows stand-ins' call
# log is not Windows state: the calls that change Windows are listed on their own below.
VOLATILE = ("/var/lib/apt/lists", "/var/lib/systemd/timers", "/var/lib/systemd/random-seed",
            "/var/lib/systemd/coredump", "/var/lib/systemd/catalog", "/var/lib/dhcp",
            "/var/lib/logrotate", "/var/lib/private", "/var/lib/dpkg/lock",
            "/var/lib/dpkg/triggers/Lock", "/etc/ld.so.cache", "/var/lib/dbus/machine-id",
            "/var/lib/systemd/deb-systemd-user-helper-enabled", "/var/lib/systemd/linger",
            "/var/lib/systemd/pstore", "/var/lib/systemd/backlight", "/var/lib/ucf/cache",
            "/var/lib/prometheus", "/mnt/c/.sim/calls.jsonl")
QUERIES = ("wsl.exe --version", "wsl.exe --status", "wsl.exe --list", "wsl.exe -l",
           "cmd.exe /c echo", "schtasks.exe /Query", "wslinfo", "wslpath",
           "powershell.exe -NoProfile -NonInteractive -Command Get-", "powercfg.exe /devicequery")
files = {}
for top in ROOTS:
    for d, dirs, names in os.walk(top):
        if d.startswith(VOLATILE):
            dirs[:] = []
            continue
        if d != top:   # a directory: that it exists and its mode (its mtime follows its files)
            try:
                files[d] = ["dir", oct(os.lstat(d).st_mode)]
            except OSError:
                continue
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            p = os.path.join(d, n)
            if p.startswith(VOLATILE):
                continue
            try:
                st = os.lstat(p)
            except OSError:
                continue
            files[p] = [st.st_size, int(st.st_mtime), oct(st.st_mode)]
calls = set()
try:
    with open("/mnt/c/.sim/calls.jsonl", encoding="utf-8") as f:
        for line in f:
            call = json.loads(line)
            text = " ".join([call["tool"]] + call["argv"])
            if not text.startswith(QUERIES):
                calls.add(text)
except (OSError, ValueError):
    pass
pk = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version} ${db:Status-Abbrev}\n"],
                    capture_output=True, text=True).stdout.splitlines()
units = subprocess.run(["systemctl", "list-unit-files", "--no-legend", "--no-pager"],
                       capture_output=True, text=True).stdout.splitlines()
print(json.dumps({"files": files, "packages": sorted(pk), "windows_calls": sorted(calls),
                  "unit_files": sorted(" ".join(u.split()) for u in units)}))
"""


@dataclass
class SimHost:
    name: str
    address: str
    profile: dict
    ssh_key: str
    root: str
    hardware_class: str
    netns: str


def host_mac(name: str) -> str:
    """The MAC address of a host's network card (its eth0, inside its network namespace)."""
    state = load_state() or {}
    out = _sh("ip", "-n", _record(state, name)["netns"], "-j", "link", "show", "eth0", stdout=subprocess.PIPE).stdout
    return json.loads(out)[0]["address"]


def set_wake_on_lan(name: str, on: bool = True) -> str | None:
    """Give a host's MAC to the inventory (inventories/sim.py: its `wake_on_lan_mac`), or take it
    back; returns the MAC."""
    state = load_state()
    if not state:
        raise FleetError("simulated fleet not running: python -m tests.fleet up")
    mac = host_mac(name) if on else None
    if on:
        state["hosts"][name]["wake_on_lan_mac"] = mac
    else:
        state["hosts"][name].pop("wake_on_lan_mac", None)
    _save_state(state)
    return mac


class WakeListener:
    """STAND-IN for the network cards of sleeping PCs with Wake-on-LAN armed: a UDP listener on
    the bridge (port 9, where magic packets go) run by the harness. A magic packet for the MAC of
    a powered-off host (Fleet.power_off) boots that host (Fleet.power_on); every packet seen is
    recorded (time, MAC, sender) in ``packets``, every boot in ``boots`` (name, packet time,
    booted time). Nothing in a packet but its MAC is read."""

    def __init__(self, fleet: Fleet, port: int = 9):
        self.fleet = fleet
        self.port = port
        self.packets: list[tuple[float, str, str]] = []
        self.boots: list[tuple[str, float, float | None]] = []
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __enter__(self) -> WakeListener:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, BRIDGE_NAME.encode())
        sock.bind(("0.0.0.0", self.port))
        sock.settimeout(0.5)
        self._sock = sock
        self._thread = threading.Thread(target=self._listen, name="wake-listener", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)
        if self._sock:
            self._sock.close()

    def _listen(self) -> None:
        from freetoken_infra.core.wol import packet_mac

        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, sender = self._sock.recvfrom(2048)
            except TimeoutError:
                continue
            except OSError:
                return
            mac = packet_mac(data)
            if mac is None:
                continue
            at = time.time()
            self.packets.append((at, mac, sender[0]))
            state = self.fleet.state
            for name, h in state["hosts"].items():
                if h.get("wake_on_lan_mac") == mac and not (h.get("pid") and _alive(h["pid"])):
                    _log(f"magic packet for {name} ({mac}) from {sender[0]}: booting it")
                    threading.Thread(target=self._boot, args=(name, at), daemon=True).start()

    def _boot(self, name: str, at: float) -> None:
        try:
            self.fleet.power_on(name)
            self.boots.append((name, at, time.time()))
        except FleetError as exc:
            _log(f"{name} did not boot: {exc}")
            self.boots.append((name, at, None))


class Fleet:
    """The running simulated fleet, as recorded in state.json."""

    def __init__(self, state: dict | None = None):
        if not (state or load_state()):
            raise FleetError("simulated fleet not running: python -m tests.fleet up")

    @property
    def state(self) -> dict:
        """state.json, re-read on each use (a later `up` or `reboot` changes the PIDs)."""
        state = load_state()
        if not state:
            raise FleetError("simulated fleet not running: python -m tests.fleet up")
        return state

    @property
    def state_path(self) -> Path:
        return Path(self.state["state_dir"]) / "state.json"

    @property
    def hosts(self) -> dict[str, SimHost]:
        return {
            n: SimHost(n, h["address"], h["profile"], h["ssh_key"], h["root"], h["hardware_class"], h["netns"])
            for n, h in self.state["hosts"].items()
        }

    @property
    def services(self) -> dict[str, dict]:
        return self.state["services"]

    def url(self, service: str) -> str | None:
        return self.state["services"].get(service, {}).get("url")

    def _host(self, host) -> dict:
        name = host if isinstance(host, str) else host.name
        return _record(self.state, name)

    @property
    def gateway(self) -> dict | None:
        """The gateway host's record (name, address, ...), None unless start_gateway() ran."""
        return self.state.get("gateway")

    def ssh_argv(self, host) -> list[str]:
        h = self._host(host)
        return _ssh_argv(h["ssh_key"], h["address"], self.state["known_hosts"])

    def run(
        self, host, cmd: str, check: bool = False, timeout: float = 300, binary: bool = False
    ) -> subprocess.CompletedProcess:
        """Run shell command `cmd` as root on `host` over SSH."""
        r = subprocess.run(self.ssh_argv(host) + [cmd], capture_output=True, text=not binary, timeout=timeout)
        if check and r.returncode != 0:
            raise FleetError(f"{self._host(host)['name']}: {cmd!r} exited {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def console(
        self, host, argv: list[str], timeout: float = 600, input: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host`` through its console (no SSH), as root."""
        return subprocess.run(
            console_argv(self._host(host)["pid"]) + argv, capture_output=True, text=True, timeout=timeout, input=input
        )

    # How WSL interop breaks on a real workstation (tests/fleet/standins/bin: init, binfmt,
    # wsl-interop-server), each a command run as root on the host; "ok" puts it right again.
    INTEROP_MODES = {
        # systemd-binfmt on a WSL whose `status` is not kept read-only: WSLInterop flushed
        # (microsoft/WSL#8843, systemd/systemd#28126): every .exe fails with Exec format error.
        "unregistered": "touch /.sim/binfmt/unprotected && systemctl restart systemd-binfmt",
        # WSL's entry removed by hand or by a tool (`echo -1 > .../WSLInterop`): Exec format error
        # until something registers it again.
        "removed": "/.sim/bin/binfmt unregister WSLInterop",
        # A package's `MZ` handler (mono, wine) registered after WSL's (microsoft/WSL#9180).
        "taken": "/.sim/bin/binfmt register ':cli:M::MZ::/usr/lib/binfmt-support/run-detectors:'",
        # The interop server gone, its socket left behind (microsoft/WSL#6799): connect failed 111.
        "dead": "systemctl stop wsl-interop-standin.service",
        # The Windows side takes the request and never answers (microsoft/WSL#8677, #7001).
        "hang": "echo hang > /.sim/switches/interop",
        "ok": (
            "rm -f /.sim/switches/interop /.sim/binfmt/unprotected; "
            "/.sim/bin/binfmt unregister cli 2>/dev/null; "
            "grep -qx enabled /proc/sys/fs/binfmt_misc/WSLInterop 2>/dev/null || "
            "/.sim/bin/binfmt register ':WSLInterop:M::MZ::/init:FP'; "
            "systemctl start wsl-interop-standin.service"
        ),
    }

    def interop(self, host, mode: str) -> None:
        """Break the host's WSL interop one way (INTEROP_MODES), or put it right ("ok")."""
        self.run(host, self.INTEROP_MODES[mode], check=True)

    def reboot(self, host, timeout: float = BOOT_TIMEOUT_S) -> None:
        """Stop the container (as a power-off would) and boot the same tree again."""
        self.power_off(host)
        self.power_on(host, timeout)

    def power_off(self, host) -> None:
        """Stop the container as a power-off would: every process of the host ends; its address
        stays on the bridge and answers nothing until power_on()."""
        h = self._host(host)
        _stop_pid(h["pid"], "systemd-nspawn", term_wait=20)
        _kill_netns_processes(h["netns"])

    def power_on(self, host, timeout: float = BOOT_TIMEOUT_S) -> None:
        """Boot a powered-off host's same tree again and wait until it runs."""
        state = self.state
        name = host if isinstance(host, str) else host.name
        _start_container(state, name)
        _wait_booted(state, [name], timeout)

    def set_network(self, host, up: bool) -> None:
        """Cut (up=False) or restore a host's network as a PC that falls asleep does: whatever is
        sent to it vanishes, nothing is refused; its processes keep running."""
        h = self._host(host)
        _sh("ip", "-n", h["netns"], "link", "set", "eth0", "up" if up else "down")

    def set_swap_used(self, host, used_bytes: int) -> None:
        """Make the host's /proc/meminfo report `used_bytes` of swap in use, at once. (Swap use
        that grows while an engine runs: the engine stand-in's `swap` fault, client.fault.)"""
        h = self._host(host)
        write_meminfo(Path(h["root"]) / ".sim" / "meminfo", h["profile"], used_bytes)

    def snapshot(self, host) -> dict:
        """A comparable picture of the host: files (size, mtime, mode) under /etc /opt
        /usr/local /var/lib /var/cache /usr/share/keyrings /home and the C: drive /mnt/c minus
        volatile paths, dpkg packages, systemd unit files, and the Windows stand-ins' calls that
        change Windows (anything but a query)."""
        r = subprocess.run(
            self.ssh_argv(host) + ["python3", "-"], input=SNAPSHOT_SCRIPT, capture_output=True, text=True, timeout=120
        )
        if r.returncode != 0:
            raise FleetError(f"snapshot failed on {self._host(host)['name']}: {r.stderr}")
        return json.loads(r.stdout)


def snapshot_diff(before: dict, after: dict) -> list[str]:
    """Human-readable differences between two snapshots (empty list: nothing changed)."""
    out = []
    for key in ("files",):
        b, a = before[key], after[key]
        out += [f"removed {p}" for p in sorted(set(b) - set(a))]
        out += [f"added {p}" for p in sorted(set(a) - set(b))]
        out += [f"changed {p}: {b[p]} -> {a[p]}" for p in sorted(set(a) & set(b)) if a[p] != b[p]]
    for key in ("packages", "unit_files", "windows_calls"):
        b, a = set(before[key]), set(after[key])
        out += [f"{key} -{x}" for x in sorted(b - a)] + [f"{key} +{x}" for x in sorted(a - b)]
    return out


def status() -> dict:
    state = load_state()
    if not state:
        return {"running": False}
    hosts = {
        n: {"address": h["address"], "pid": h["pid"], "alive": bool(h["pid"]) and _alive(h["pid"])}
        for n, h in state["hosts"].items()
    }
    services = {
        n: {"url": s.get("url"), "pid": s.get("pid"), "alive": bool(s.get("pid")) and _alive(s["pid"])}
        for n, s in state["services"].items()
    }
    return {"running": True, "state": str(state_file()), "hosts": hosts, "services": services}
