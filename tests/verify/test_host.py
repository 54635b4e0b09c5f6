"""Is this host what the deploy promised? One named check per promise, for every host of the
inventory (see conftest.py for the options), against the deploy's own settings of that host.

Each check reads the host itself (facts, systemd, dpkg, sockets, the API) and says in its
failure what it saw and what was expected. The checks that need a serving engine (listening
socket, /health, chat, decode speed) fail together when the engine is down.
"""

from __future__ import annotations

import configparser
import urllib.parse

import pytest

from facts.cuda import CudaToolchain
from facts.engine import EngineHealth, EngineInstall
from facts.gpu import NvidiaGpus
from facts.init import InitSystem
from facts.model_manifest import ModelManifest
from facts.windows import WindowsUserProfile, WslConfFile, WslConfigFile
from facts.wsl import WslVersion
from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.layout import (
    CUDA_PIN_FILE,
    DEFAULT_DRIVE_ROOT,
    ENGINE_UNIT,
    GUARD_TIMER,
    WSLCONFIG_NAME,
    HostLayout,
)
from freetoken_infra.core.settings import DRIVER_PACKAGE_RE
from freetoken_infra.core.wsl_ini import drive_root
from operations.health import gate_url
from operations.service import engine_unit, env_path, key_path
from tests.verify.probes import (
    DPKG_QUERY,
    apt_policy,
    key_exposure,
    listeners,
    model_hash_mismatches,
    present_packages,
    unit_pids,
)


def _v(version) -> str:
    return ".".join(str(p) for p in version)


def _same(seen, wanted: str) -> bool:
    # WSL reads .wslconfig values case-insensitively (true/True, 24GB/24gb).
    return seen is not None and seen.strip().lower() == wanted.strip().lower()


def _gpu(facts):
    report = facts.get(NvidiaGpus)
    assert report.gpus, f"no GPU: {report.error}"
    return report.gpus[0]


# --------------------------------------------------------------------------- WSL


def test_wsl_version_at_or_above_the_floor(facts, settings):
    wsl = facts.get(WslVersion)
    assert wsl.status == "ok" and wsl.version, f"WSL version unknown ({wsl.status}: {wsl.detail})"
    assert wsl.version >= settings.wsl_floor_tuple, (
        f"WSL {_v(wsl.version)} is below the floor {settings.wsl_min_version} (wsl.exe --update)"
    )


def test_systemd_is_pid_1(facts):
    init = facts.get(InitSystem)
    assert init.systemd_pid1, f"PID 1 is {init.pid1!r}, not systemd"


def test_wslconfig_holds_the_configured_values(facts, settings):
    # As WSL reads the file (freetoken_infra/core/wsl_ini.py): inline comments and quotes removed, the
    # first of duplicate keys, networkingMode also in WSL 2.0's [experimental] place. The profile
    # is looked for under wsl.conf's [automount] root (C: at /c with `root = /`).
    wslconf = facts.get(WslConfFile)
    root = drive_root(wslconf.ini) if wslconf.ini is not None else DEFAULT_DRIVE_ROOT
    profile = (
        facts.get(WindowsUserProfile) if root == DEFAULT_DRIVE_ROOT else facts.get(WindowsUserProfile, drive_root=root)
    )
    assert profile.path, f"no Windows user profile: {profile.error}"
    ini = facts.get(WslConfigFile, path=f"{profile.path}/{WSLCONFIG_NAME}")
    assert ini.exists and not ini.error and ini.ini is not None, f"{ini.path}: {ini.error or 'missing'}"
    wrong = {
        key: (ini.ini.value("wsl2", key), value)
        for key, value in settings.wslconfig_values().items()
        if not _same(ini.ini.value("wsl2", key), value)
    }
    assert not wrong, f"{ini.path} [wsl2]: " + ", ".join(
        f"{k}={have!r} (want {want!r})" for k, (have, want) in wrong.items()
    )
    twice = [key for key in settings.wslconfig_values() if len(ini.ini.duplicates("wsl2", key)) > 1]
    assert not twice, f"{ini.path}: WSL warns about duplicated keys {', '.join(twice)}"


def test_wsl_conf_boots_systemd(facts):
    ini = facts.get(WslConfFile)
    assert ini.exists and not ini.error and ini.ini is not None, f"/etc/wsl.conf: {ini.error or 'missing'}"
    value = ini.ini.value("boot", "systemd")
    assert _same(value, "true"), f"/etc/wsl.conf [boot] systemd={value!r} as WSL reads it (want 'true')" + (
        f"; {'; '.join(ini.problems)}" if ini.problems else ""
    )


# --------------------------------------------------------------------------- CUDA


def test_cuda_toolkit_packages_installed(host, settings):
    missing = [p for p in settings.cuda_packages if not host.package(p).is_installed]
    assert not missing, f"not installed: {', '.join(missing)}"


def test_no_driver_package_installed(host):
    drivers = [p for p in present_packages(host.check_output(DPKG_QUERY)) if DRIVER_PACKAGE_RE.match(p)]
    assert not drivers, f"Linux NVIDIA driver package(s) inside WSL: {', '.join(drivers)} (apt purge them)"


def test_driver_packages_pinned_out(host):
    known = [p for p in host.check_output("apt-cache pkgnames").split() if DRIVER_PACKAGE_RE.match(p)]
    assert known, (
        "apt knows no NVIDIA driver package, so the pin cannot be shown to block one "
        "(is NVIDIA's repository configured?)"
    )
    table = apt_policy(host.check_output("apt-cache policy " + " ".join(sorted(known))))
    # Installable: a version not installed yet (an installed one is the previous check's
    # business) that some repository offers with a priority apt would act on.
    installable = sorted(
        f"{pkg} {version} (priority {prio})"
        for pkg, rows in table.items()
        for version, prio, installed, origins in rows
        if prio >= 0 and not installed and any(not o.endswith("/var/lib/dpkg/status") for o in origins)
    )
    assert not installable, f"apt could install a driver package ({CUDA_PIN_FILE} missing or wrong): " + "; ".join(
        installable[:5]
    )


def test_nvcc_lists_the_gpu_arch(facts, settings):
    cap = _gpu(facts).compute_cap
    assert cap, "nvidia-smi reports no compute capability"
    arch = f"compute_{cap[0]}{cap[1]}"
    toolchain = facts.get(CudaToolchain, cuda_home=settings.cuda_home)
    ours = [n for n in toolchain.nvcc if n.path.startswith(settings.cuda_home + "/")]
    assert ours, f"no nvcc under {settings.cuda_home} (found: {[n.path for n in toolchain.nvcc]})"
    assert arch in ours[0].archs, f"{ours[0].path} does not list {arch} (lists {', '.join(ours[0].archs)})"


# --------------------------------------------------------------------------- engine and model


def test_engine_environment_holds_the_configured_version(host, facts, settings):
    install = facts.get(EngineInstall, base_dir=settings.engine_base_dir)
    version = settings.engine_version
    assert install.versions.get(version) == version, (
        f"{HostLayout.of(settings).engine_venv} holds {settings.engine_package} {install.versions.get(version)} "
        f"(want {version}; environments: {install.versions})"
    )
    assert install.active == version, (
        f"{HostLayout.of(settings).engine_active_link} points to {install.active_target!r}, "
        f"not {HostLayout.of(settings).engine_venv}"
    )
    probe = host.run(
        "%s -c %s %s",
        f"{HostLayout.of(settings).engine_active_link}/bin/python",
        "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))",
        settings.engine_package,
    )
    assert probe.rc == 0 and probe.stdout.strip() == version, (
        f"the active environment's python reports {probe.stdout.strip() or probe.stderr.strip()[-200:]!r}"
    )


def test_model_files_match_the_verified_manifest(host, facts, settings):
    manifest = facts.get(ModelManifest, model_dir=settings.model_dir)
    covered, why = manifest.covers(settings.model_repo, settings.model_revision)
    assert covered, why
    hashed = model_hash_mismatches(host, settings.model_dir)
    assert not hashed.get("error"), hashed["error"]
    assert hashed["files"] > 0 and not hashed["bad"], f"{settings.model_dir}: " + "; ".join(hashed["bad"])


def test_the_model_is_read_only_to_the_engine(host, settings):
    """The engine's user can change nothing in the model or on the way to it (docs/security.md):
    the model belongs to the download's user, the folders above it to root or to whoever owned them
    before, none writable by the engine's user."""
    user, parts = settings.service_user, [p for p in settings.model_dir.split("/") if p]
    wrong = []
    for i in range(len(parts)):
        path = "/" + "/".join(parts[: i + 1])
        f = host.file(path)
        if not f.exists:
            wrong.append(f"{path} missing")
        elif f.is_symlink:
            wrong.append(f"{path} is a symbolic link")
        elif f.user == user or (f.group == user and f.mode & 0o020) or f.mode & 0o002:
            wrong.append(f"{path} is {f.mode:o} {f.user}:{f.group} (writable by {user})")
    leaf = host.file(settings.model_dir)
    if leaf.exists and leaf.user != settings.fetch_user:
        wrong.append(f"{settings.model_dir} belongs to {leaf.user} (want {settings.fetch_user})")
    found = host.run(
        "find -P %s '(' -user %s -o -group %s -perm -g+w -o -perm -o+w ')' -print -quit", settings.model_dir, user, user
    )
    if found.stdout.strip():
        wrong.append(f"{found.stdout.strip()} is writable by {user}")
    assert not wrong, "; ".join(wrong)


# --------------------------------------------------------------------------- the service


def _show(host, unit: str, *props: str) -> dict[str, str]:
    out = host.check_output("systemctl show %s " + " ".join(f"-p {p}" for p in props), unit)
    return dict(line.partition("=")[::2] for line in out.splitlines() if "=" in line)


def _is_active(host, unit: str) -> str:
    out = host.run("systemctl is-active %s", unit)
    return out.stdout.strip() or out.stderr.strip()[:200] or "not active"


def test_service_enabled(host):
    assert host.service(ENGINE_UNIT).is_enabled, f"{ENGINE_UNIT} is not enabled (it will not start at boot)"


def test_service_active(host):
    service = host.service(ENGINE_UNIT)
    assert service.is_running, f"{ENGINE_UNIT} is {_is_active(host, ENGINE_UNIT)}"


def test_service_runs_as_the_service_user(host, settings):
    props = _show(host, ENGINE_UNIT, "User", "MainPID")
    assert props.get("User") == settings.service_user, f"User={props.get('User')!r} (want {settings.service_user})"
    pid = props.get("MainPID", "0")
    assert pid not in ("", "0"), f"{ENGINE_UNIT} has no running process"
    owner = host.check_output("ps -o user= -p %s", pid).strip()
    assert owner == settings.service_user, f"the engine (pid {pid}) runs as {owner!r}"


def _expected_unit(facts, settings) -> configparser.ConfigParser:
    """The deploy's own unit text for this host (operations/service.engine_unit), parsed."""
    gpu = _gpu(facts)
    text = engine_unit(settings, derive_plan(settings, gpu.memory_total_mib, gpu.compute_cap or (0, 0)))
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(text)
    return parser


def test_service_restart_policy(host, facts, settings):
    wanted = _expected_unit(facts, settings)["Service"]
    props = _show(host, ENGINE_UNIT, "Restart", "RestartForceExitStatus")
    assert props.get("Restart") == wanted["Restart"], f"Restart={props.get('Restart')!r} (want {wanted['Restart']})"
    if "RestartForceExitStatus" in wanted:
        # systemctl show spells signals without "SIG" (SIGTERM -> TERM).
        def words(value: str) -> set[str]:
            return {w.removeprefix("SIG") for w in value.split()}

        seen = props.get("RestartForceExitStatus", "")
        assert words(wanted["RestartForceExitStatus"]) <= words(seen), (
            f"RestartForceExitStatus={seen!r} (want {wanted['RestartForceExitStatus']})"
        )


# --------------------------------------------------------------------------- the API


def test_api_listens_only_on_the_configured_address_and_port(host, settings):
    address, port = str(settings.listen_host), settings.listen_port
    engine = unit_pids(host, ENGINE_UNIT)
    sockets = listeners(host)
    on_port = [s for s in sockets if s.port == port]
    assert on_port, f"nothing listens on port {port}"
    assert {s.address for s in on_port} == {address}, (
        f"port {port} is open on {sorted({s.address for s in on_port})} (want only {address})"
    )
    assert all(set(s.pids) & engine for s in on_port), (
        f"port {port} belongs to pids {[s.pids for s in on_port]}, not {ENGINE_UNIT} ({sorted(engine)})"
    )
    # The engine's own helper sockets (FreeToken binds 127.0.0.1:<port+1> for gloo) stay on loopback.
    elsewhere = [f"{s.address}:{s.port}" for s in sockets if set(s.pids) & engine and s.port != port and not s.loopback]
    assert not elsewhere, f"{ENGINE_UNIT} also listens on {', '.join(elsewhere)}"


def test_health_ok(facts, settings):
    url = urllib.parse.urlsplit(gate_url(settings))
    health = facts.get(EngineHealth, host=url.hostname, port=url.port)
    assert health.reachable, f"{gate_url(settings)}/health: {health.error}"
    assert health.status == "ok", (
        f"/health status {health.status!r} (phase {health.phase}, message {health.message!r}, {health.error or ''})"
    )


def test_chat_completion_answers(gate):
    assert gate.get("phase") in ("stream", "done"), (
        f"no chat completion (stopped in the {gate.get('phase')} phase): {gate.get('error')}"
    )


def test_decode_tokens_per_s_at_or_above_the_floor(gate, settings):
    floor = settings.decode_floor_tps
    if floor is None:
        pytest.skip("no decode_floor_tps for this host (set it in its hardware class's group_data)")
    assert gate.get("ok"), f"no decode measurement (stopped in the {gate.get('phase')} phase): {gate.get('error')}"
    tps = gate.get("decode_tps")
    assert tps is not None and tps >= floor, f"decode {tps} tok/s is below the floor {floor:g}"


# --------------------------------------------------------------------------- secrets and guard


def test_secret_files_are_0600(host, settings):
    paths = [env_path(settings)] + ([] if settings.api_key_source == "none" else [key_path(settings)])
    wrong = []
    for path in paths:
        f = host.file(path)
        if not f.exists:
            wrong.append(f"{path} missing")
        elif (f.mode, f.user) != (0o600, "root"):
            wrong.append(f"{path} is {f.mode:o} {f.user}:{f.group} (want 600 root)")
    assert not wrong, "; ".join(wrong)


def test_api_key_in_neither_ps_nor_the_journal(host, settings):
    if settings.api_key_source == "none":
        pytest.skip("api_key_source = none: the engine has no key")
    seen = key_exposure(host, key_path(settings))
    assert not seen.get("error"), seen["error"]
    # A journal that could not be read has no key lines either: that must not pass as clean.
    assert seen["journal_rc"] == 0, f"journalctl failed (exit status {seen['journal_rc']}): the journal was not read"
    assert not seen["ps"], f"the API key is on the command line of pid(s) {seen['ps']}"
    assert seen["journal_lines"] == 0, f"the API key is in {seen['journal_lines']} journal line(s)"


def test_guard_timer_active(host, settings):
    if not settings.guard_enabled:
        pytest.skip("guard_enabled = false")
    timer = host.service(GUARD_TIMER)
    assert timer.is_running, f"{GUARD_TIMER} is {_is_active(host, GUARD_TIMER)}"
    assert timer.is_enabled, f"{GUARD_TIMER} is not enabled"
