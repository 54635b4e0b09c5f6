"""Every operation against faked facts (tests/unit/fakehost.py): nothing to do on a converged
host, and the right commands for each drift. Operations with their own test module are tested
there the same way: firewall (test_firewall), node_exporter (test_node_exporter), guard and
clear_guard_state (test_guard), the engine's pip.conf (test_trust_secrets). The way they all
write their files and units (operations/managed.py) is tested at the end, with what each reads on
a no-op run. The fleet tests run each for real over SSH, twice."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, replace

import pytest
from pyinfra.api import FunctionCommand
from pyinfra.api.exceptions import OperationError

from facts.cuda import CudaToolchainInfo, NvccInfo
from facts.engine import EngineInstallInfo
from freetoken_infra.core.gate_record import Gated, GateResult
from freetoken_infra.core.launch import derive_plan
from freetoken_infra.core.layout import (
    ALERTMANAGER_CONFIG,
    ALERTMANAGER_DEFAULTS,
    ALERTMANAGER_SMTP_PASSWORD,
    ALERTMANAGER_UNIT,
    CACHE_NGINX_CONF,
    CACHE_SCRIPT,
    CACHE_UNIT,
    CUDA_PIN_FILE,
    CUDA_PROFILE_FILE,
    CUDA_SOURCES_FILE,
    DEPLOY_STATE_DIR,
    DEPLOY_STATE_MODE,
    ENGINE_COMPLETE_MARKER,
    FETCH_SCRIPT,
    FETCH_UNIT,
    GATE_RECORD_FILE,
    GATE_RECORD_MODULE,
    GATE_SCRIPT,
    GATEWAY_ALERT_RULES,
    GATEWAY_CONFIG,
    GATEWAY_ENGINE_KEY_MAP,
    GATEWAY_KEYS_MAP,
    GATEWAY_METRICS_KEYS_MAP,
    GATEWAY_SCRAPE_CONFIG,
    GATEWAY_TLS_PEM,
    GPU_FREE_SCRIPT,
    GPU_ROOM_MODULE,
    HOSTIO_MODULE,
    LIB_DIR,
    MANIFEST_MODULE,
    OWN_DIR_SCRIPT,
    PROMETHEUS_CONFIG,
    PROMETHEUS_DEFAULTS,
    PROMETHEUS_SCRAPE_KEY,
    PROMETHEUS_UNIT,
    PROMETHEUS_USER,
    QUANT_MODULE,
    UNIT_DIR,
)
from freetoken_infra.core.settings import Settings
from operations import cuda, engine, firewall, guard, health, managed, model, node_exporter, service, windows
from operations import gateway as gw
from operations.managed import ManagedFile
from tests.unit.fakehost import FakeHost

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def uploaded(path: str, mode: str = "644", owner: bool = True) -> list[str]:
    """What pyinfra's ``files.put`` yields for a file it writes: the upload, then owner and mode."""
    return [f"upload {path}", *([f"chown root:root {path}"] if owner else []), f"chmod {mode} {path}"]


def source(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


# --------------------------------------------------------------------------- cuda


def test_packages_present_installs_only_what_is_missing_and_updates_only_then():
    assert FakeHost(packages={"curl", "jq"}).commands(cuda.packages_present, ["curl", "jq"]) == []
    cmds = FakeHost(packages={"curl"}).commands(cuda.packages_present, ["curl", "jq"])
    assert cmds[0] == "apt-get update"
    assert [c for c in cmds if "install" in c] == [
        'DEBIAN_FRONTEND=noninteractive apt-get -y -o Dpkg::Options::="--force-confdef" '
        '-o Dpkg::Options::="--force-confold" install --no-install-recommends jq'
    ]


def cuda_repo_host(settings: Settings, **drift) -> FakeHost:
    sources = {CUDA_SOURCES_FILE: cuda.sources_line(settings), **drift.pop("sources", {})}
    return FakeHost(
        files={**sources, CUDA_PIN_FILE: drift.pop("pin", cuda.pin_text())},
        packages=drift.pop("packages", {"cuda-keyring"}),
        facts={"AptSourceFiles": sources},
    )


def test_cuda_repository_converged_then_each_drift():
    s = Settings()
    assert cuda_repo_host(s).commands(cuda.repository, s) == []
    # NVIDIA's own entry beside ours is removed (duplicate sources).
    theirs = "/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list"
    cmds = cuda_repo_host(
        s, sources={theirs: "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] x /"}
    ).commands(cuda.repository, s)
    assert cmds == [f"rm -f {theirs}"]
    # A changed mirror rewrites our entry; a changed pin is put back.
    mirror = Settings(cuda_repo_url="http://10.213.0.1:8081/compute/cuda/repos/ubuntu2404/x86_64/")
    assert cuda_repo_host(s).commands(cuda.repository, mirror) == uploaded(CUDA_SOURCES_FILE, owner=False)
    assert cuda_repo_host(s, pin="Pin-Priority: 500\n").commands(cuda.repository, s) == uploaded(
        CUDA_PIN_FILE, owner=False
    )
    # No keyring yet: fetched into a fresh folder, and the entry it ships removed in the same run.
    cmds = cuda_repo_host(s, packages=set()).commands(cuda.repository, s)
    assert cmds == [cuda.keyring_install_command(s), cmds[1]] and "dpkg -L cuda-keyring" in cmds[1]


def cuda_host(settings: Settings, archs=("compute_120",), packages=None, profile=None) -> FakeHost:
    nvcc = NvccInfo(path=f"{settings.cuda_home}/bin/nvcc", source="CUDA_HOME", version=(13, 0), archs=tuple(archs))
    return FakeHost(
        files={CUDA_PROFILE_FILE: cuda.profile_text(settings) if profile is None else profile},
        packages=settings.cuda_packages if packages is None else packages,
        facts={"CudaToolchain": CudaToolchainInfo(nvcc=(nvcc,), cuda_home=settings.cuda_home, ninja_version=None)},
    )


def test_cuda_toolkit_converged_then_each_drift():
    s = Settings()
    assert cuda_host(s).commands(cuda.toolkit, s, "compute_120") == []
    assert cuda_host(s).commands(cuda.toolkit, s, None) == []
    cmds = cuda_host(s, packages=s.cuda_packages[1:]).commands(cuda.toolkit, s, "compute_120")
    assert cmds[0] == "apt-get update" and s.cuda_packages[0] in cmds[1] and "--list-gpu-arch" in cmds[2]
    assert cuda_host(s, profile="").commands(cuda.toolkit, s, None) == uploaded(CUDA_PROFILE_FILE, owner=False)
    # An nvcc that does not list the GPU's architecture fails the run, naming it.
    (check,) = cuda_host(s, archs=("compute_90",)).commands(cuda.toolkit, s, "compute_120")
    assert "grep -qx -- compute_120" in check and "cannot JIT its kernels" in check


# --------------------------------------------------------------------------- engine


def engine_host(settings: Settings, built=True, active=True, dirs=None, account=True) -> FakeHost:
    v, base = settings.engine_version, settings.engine_base_dir
    venv = f"{base}/{v}"
    files: dict = {OWN_DIR_SCRIPT: source("operations", "scripts", "own_dir.py")}
    files[f"{venv}/pip.conf"] = (engine.pip_conf(settings), 600)
    if built:
        files |= {f"{venv}/bin/ninja": "", f"{venv}/{ENGINE_COMPLETE_MARKER}": ""}
    user = settings.service_user
    owned = {
        settings.state_dir: ("root", "root", "755"),
        settings.cache_dir: (user, user, "755"),
        settings.config_dir: ("root", "root", "755"),
        DEPLOY_STATE_DIR: ("root", "root", DEPLOY_STATE_MODE),
    }
    return FakeHost(
        files=files,
        dirs={**owned, **(dirs or {})},
        accounts={user: settings.state_dir} if account else {},
        facts={
            "EngineInstall": EngineInstallInfo(
                base, {v: v} if built else {}, v if active else None, venv if active else None
            )
        },
    )


def test_service_user_converged_then_each_drift():
    s = Settings()
    assert engine_host(s).commands(engine.service_user, s) == []
    assert engine_host(s, account=False).commands(engine.service_user, s) == [
        f"useradd -d {s.state_dir} -s /usr/sbin/nologin -r -M {s.service_user}"
    ]
    # The cache handed to root by mistake goes back to the engine's user, through own_dir.py.
    (cmd,) = engine_host(s, dirs={s.cache_dir: ("root", "root", "755")}).commands(engine.service_user, s)
    assert cmd.startswith(f"/usr/bin/python3 {OWN_DIR_SCRIPT} --path {s.cache_dir} --owner {s.service_user}")


def test_environment_converged_then_unbuilt_then_inactive():
    s = Settings()
    venv = f"{s.engine_base_dir}/{s.engine_version}"
    assert engine_host(s).commands(engine.environment, s) == []
    cmds = engine_host(s, built=False, active=False).commands(engine.environment, s)
    assert cmds[0] == f"python3 -m venv {venv}" and "bin/pip install" in cmds[1]
    assert cmds[1].endswith(f"> {venv}/{ENGINE_COMPLETE_MARKER}")  # the marker last
    assert cmds[2:] == [engine.active_link_command(s, s.engine_version)]  # switched to a built one only
    assert engine_host(s, active=False).commands(engine.environment, s) == [
        engine.active_link_command(s, s.engine_version)
    ]
    assert engine_host(s, active=False).commands(engine.environment, s, activate=False) == []


def test_an_environment_missing_only_bin_ninja_gets_ninja_again_not_a_rebuild():
    """bin/ninja removed by hand: a rebuild's `pip install ... ninja` found ninja's dist-info
    ('already satisfied'), restored nothing and wrote the marker again, so every later run rebuilt.
    Now ninja alone is installed again, and the engine is not rebuilt."""
    s = Settings()
    venv = f"{s.engine_base_dir}/{s.engine_version}"
    host = engine_host(s)
    del host.files[f"{venv}/bin/ninja"]
    assert host.commands(engine.environment, s) == [
        f"{venv}/bin/pip install --progress-bar off --force-reinstall --no-deps ninja"
    ]


# --------------------------------------------------------------------------- gateway

GATEWAY_FILES = {
    GATEWAY_CONFIG: "global\n",
    GATEWAY_KEYS_MAP: "k alice\n",
    GATEWAY_ENGINE_KEY_MAP: "engine e\n",
    GATEWAY_METRICS_KEYS_MAP: "m prometheus\n",
    GATEWAY_SCRAPE_CONFIG: "scrape_configs: []\n",
}
GATEWAY_ARGS = {
    "config": "global\n",
    "client_keys": "k alice\n",
    "engine_keys": "engine e\n",
    "metrics_keys": "m prometheus\n",
    "scrape": "scrape_configs: []\n",
}


def gateway_host(up: bool = True, **changed) -> FakeHost:
    files = {p: (t, 644 if p in (GATEWAY_CONFIG, GATEWAY_SCRAPE_CONFIG) else 600) for p, t in GATEWAY_FILES.items()}
    units = {"haproxy.service"} if up else set()
    return FakeHost(files={**files, **changed}, running=units, enabled=units)


def test_gateway_converged_then_each_drift():
    assert gateway_host().commands(gw.gateway, **GATEWAY_ARGS) == []
    # A changed key map: uploaded, HAProxy reloaded; no config check (the config is as it was).
    cmds = gateway_host().commands(gw.gateway, **{**GATEWAY_ARGS, "client_keys": "k2 alice\n"})
    assert cmds[0] == f"upload {GATEWAY_KEYS_MAP}" and cmds[-1] == gw.RELOAD
    assert not any("haproxy -c" in c for c in cmds)
    # A changed config is validated before it replaces the running one.
    cmds = gateway_host().commands(gw.gateway, **{**GATEWAY_ARGS, "config": "global\n  maxconn 10\n"})
    assert cmds[0] == f"upload {GATEWAY_CONFIG}.new"
    assert cmds[-2] == f"haproxy -c -q -f {GATEWAY_CONFIG}.new && mv -f {GATEWAY_CONFIG}.new {GATEWAY_CONFIG}"
    assert cmds[-1] == gw.RELOAD
    # A new secret file is made 0600 before anything is written into it.
    cmds = gateway_host().commands(gw.gateway, **GATEWAY_ARGS, tls="PEM\n")
    assert cmds[:2] == [f"install -m 600 -o root -g root /dev/null {GATEWAY_TLS_PEM}", f"upload {GATEWAY_TLS_PEM}"]
    # Back to plain HTTP: the PEM goes; a key map left world-readable is closed.
    assert gateway_host(**{GATEWAY_TLS_PEM: ("PEM\n", 600)}).commands(gw.gateway, **GATEWAY_ARGS) == [
        f"rm -f {GATEWAY_TLS_PEM}"
    ]
    assert gateway_host(**{GATEWAY_KEYS_MAP: ("k alice\n", 644)}).commands(gw.gateway, **GATEWAY_ARGS) == [
        f"chmod 600 {GATEWAY_KEYS_MAP}"
    ]
    # HAProxy down (and not enabled): started and enabled, nothing rewritten.
    assert gateway_host(up=False).commands(gw.gateway, **GATEWAY_ARGS) == [
        "systemctl start haproxy.service",
        "systemctl enable haproxy.service",
    ]


ALERTING_ARGS = dict(prometheus="p\n", alertmanager="a\n", rules="r\n", scrape_key="k", smtp_password="pw")


def alerting_host(**changed) -> FakeHost:
    files = {
        PROMETHEUS_SCRAPE_KEY: ("k\n", 640),
        ALERTMANAGER_SMTP_PASSWORD: ("pw\n", 640),
        PROMETHEUS_DEFAULTS: gw.service_defaults(gw.PROMETHEUS_ARGS),
        ALERTMANAGER_DEFAULTS: gw.service_defaults(gw.ALERTMANAGER_ARGS),
        PROMETHEUS_CONFIG: "p\n",
        ALERTMANAGER_CONFIG: ("a\n", 640),
        GATEWAY_ALERT_RULES: "r\n",
    }
    units = {f"{PROMETHEUS_UNIT}.service", f"{ALERTMANAGER_UNIT}.service"}
    return FakeHost(files={**files, **changed}, running=units, enabled=units)


def test_alerting_converged_then_each_drift():
    # The fake host's files are root:root, so the secrets get their group back, and nothing else.
    regroup = [f"chown root:{PROMETHEUS_USER} {p}" for p in (PROMETHEUS_SCRAPE_KEY, ALERTMANAGER_SMTP_PASSWORD)]
    assert alerting_host().commands(gw.alerting, **ALERTING_ARGS) == regroup
    # A new secret file is made 0640 before anything is written into it.
    cmds = FakeHost().commands(gw.alerting, **ALERTING_ARGS)
    assert cmds[0] == f"install -m 640 -o root -g {PROMETHEUS_USER} /dev/null {PROMETHEUS_SCRAPE_KEY}"
    assert cmds.index(f"upload {PROMETHEUS_SCRAPE_KEY}") > 0
    # A changed secret: uploaded, Prometheus reloaded.
    cmds = alerting_host().commands(gw.alerting, **{**ALERTING_ARGS, "scrape_key": "k2"})
    assert cmds[0] == f"upload {PROMETHEUS_SCRAPE_KEY}" and cmds[-1].startswith(
        f"if systemctl is-active -q {PROMETHEUS_UNIT}; then systemctl reload {PROMETHEUS_UNIT};"
    )
    # No smarthost password: its file goes.
    cmds = alerting_host().commands(gw.alerting, **{**ALERTING_ARGS, "smtp_password": None})
    assert cmds == [regroup[0], f"rm -f {ALERTMANAGER_SMTP_PASSWORD}"]
    # A changed alertmanager.yml is made 0640, checked, then replaces the running one.
    cmds = alerting_host().commands(gw.alerting, **{**ALERTING_ARGS, "alertmanager": "b\n"})
    new = f"{ALERTMANAGER_CONFIG}.new"
    assert cmds[2:4] == [f"install -m 640 -o root -g {PROMETHEUS_USER} /dev/null {new}", f"upload {new}"]
    assert cmds[-2] == f"amtool check-config {new} && mv -f {new} {ALERTMANAGER_CONFIG}"
    assert f"systemctl reload {ALERTMANAGER_UNIT}" in cmds[-1]
    # Changed rules (written by the gateway operation) are checked before Prometheus reloads.
    cmds = alerting_host(**{GATEWAY_ALERT_RULES: "old\n"}).commands(gw.alerting, **ALERTING_ARGS)
    assert cmds[2] == f"promtool check rules {GATEWAY_ALERT_RULES}"
    assert f"systemctl reload {PROMETHEUS_UNIT}" in cmds[3]
    # Changed service defaults (the listen address): a restart, not a reload.
    cmds = alerting_host(**{PROMETHEUS_DEFAULTS: "x"}).commands(gw.alerting, **ALERTING_ARGS)
    assert cmds[2] == f"upload {PROMETHEUS_DEFAULTS}" and cmds[-1] == f"systemctl restart {PROMETHEUS_UNIT}"


# --------------------------------------------------------------------------- model


def fetcher_host(settings: Settings, sources=(), **changed) -> FakeHost:
    user = settings.fetch_user
    files = {
        FETCH_SCRIPT: source("operations", "scripts", "fetch_model.py"),
        QUANT_MODULE: source("freetoken_infra", "core", "quant.py"),
        MANIFEST_MODULE: source("freetoken_infra", "core", "manifest.py"),
        HOSTIO_MODULE: source("freetoken_infra", "core", "hostio.py"),
        OWN_DIR_SCRIPT: source("operations", "scripts", "own_dir.py"),
        f"{UNIT_DIR}/{FETCH_UNIT}": model.fetch_unit(settings, sources),
    }
    dirs = {d: ("root", "root", "755") for d in ("/var/lib/freetoken", "/var/lib/freetoken/models")} | {
        settings.model_dir: (user, user, "755"),
        model.fetch_status_dir(settings): (user, user, "755"),
    }
    dirs[settings.config_dir] = ("root", "root", "755")
    return FakeHost(files={**files, **changed}, dirs=dirs, accounts={user: settings.state_dir})


def test_model_fetcher_converged_then_each_drift():
    s = Settings()
    assert fetcher_host(s).commands(model.model_fetcher, s) == []
    # New cache sources: the unit is rewritten and systemd reloaded, nothing else.
    cmds = fetcher_host(s).commands(model.model_fetcher, s, ["http://ws2:8090"])
    assert cmds == [*uploaded(f"{UNIT_DIR}/{FETCH_UNIT}"), "systemctl daemon-reload"]
    assert not any(c.startswith("upload") and FETCH_SCRIPT in c for c in cmds)
    cmds = fetcher_host(s, **{FETCH_SCRIPT: "old"}).commands(model.model_fetcher, s)
    assert cmds[0] == f"upload {FETCH_SCRIPT}" and "systemctl daemon-reload" not in cmds
    # An endpoint with credentials: its root-only env file is made 0600 before it is written.
    cred = Settings(hub_endpoint="https://u:pw@hub.example")
    cmds = fetcher_host(cred).commands(model.model_fetcher, cred)
    env_file = model.fetch_env_path(cred)
    assert cmds[:4] == [f"install -m 600 -o root -g root /dev/null {env_file}", *uploaded(env_file, "600")]
    assert not any("pw@" in c for c in cmds)


def cache_host(settings: Settings, bind: str, installed=True, **changed) -> FakeHost:
    files = {
        CACHE_SCRIPT: source("operations", "scripts", "model_cache.py"),
        CACHE_NGINX_CONF: model.cache_nginx_conf(settings, bind),
        f"{UNIT_DIR}/{CACHE_UNIT}": model.cache_unit(settings, bind),
    }
    return FakeHost(
        files={**files, **changed},
        packages={"nginx"} if installed else set(),
        running={CACHE_UNIT},
        enabled={CACHE_UNIT},
        accounts={settings.cache_user: "/nonexistent"},  # the workers' own account
    )


def test_model_cache_converged_then_each_drift():
    s = Settings(model_cache_host="ws1")
    assert cache_host(s, "192.0.2.11").commands(model.model_cache, s, bind="192.0.2.11") == []
    # A new bind: nginx's conf rewritten and the cache restarted (its unit is as it was).
    cmds = cache_host(s, "192.0.2.11").commands(model.model_cache, s, bind="192.0.2.12")
    assert cmds == [*uploaded(CACHE_NGINX_CONF), f"systemctl restart {CACHE_UNIT}"]
    # A changed unit: systemd reloads before the restart.
    cmds = cache_host(s, "192.0.2.11", **{f"{UNIT_DIR}/{CACHE_UNIT}": "old"}).commands(
        model.model_cache, s, bind="192.0.2.11"
    )
    assert cmds == [*uploaded(f"{UNIT_DIR}/{CACHE_UNIT}"), "systemctl daemon-reload", f"systemctl restart {CACHE_UNIT}"]
    # Not installed yet: Debian's nginx is masked before the package can start it.
    cmds = cache_host(s, "192.0.2.11", installed=False).commands(model.model_cache, s, bind="192.0.2.11")
    mask = cmds.index(f"ln -s /dev/null {UNIT_DIR}/nginx.service")
    assert mask < cmds.index("apt-get update") < next(i for i, c in enumerate(cmds) if "install" in c and "nginx" in c)
    # No longer the cache host: stopped, its files removed; nothing when it was never there.
    cmds = cache_host(s, "192.0.2.11").commands(model.model_cache, s, present=False)
    assert cmds[:2] == [f"systemctl stop {CACHE_UNIT}", f"systemctl disable {CACHE_UNIT}"]
    assert cmds[-1] == "systemctl daemon-reload" and f"rm -f {UNIT_DIR}/{CACHE_UNIT}" in cmds
    assert FakeHost().commands(model.model_cache, s, present=False) == []


def test_model_cache_reload_always_reloads():
    # An action, not a state: the deploy runs it only when model_present changed the model.
    assert FakeHost().commands(model.model_cache_reload) == [f"systemctl reload-or-restart {CACHE_UNIT}"]


@dataclass
class Manifest:
    covered: bool

    def covers(self, repo: str, revision: str) -> tuple[bool, str]:
        return self.covered, "" if self.covered else "missing"


def test_model_present_converged_then_missing_then_reverify():
    s = Settings()
    assert FakeHost(facts={"ModelManifest": Manifest(True)}).commands(model.model_present, s) == []
    missing = FakeHost(facts={"ModelManifest": Manifest(False)})
    assert missing.commands(model.model_present, s) == ["call wait_for_fetch"]
    assert missing.commands(model.model_present, s, wait=False) == [f"systemctl start --no-block {FETCH_UNIT}"]
    again = Settings(model_reverify=True)
    assert FakeHost(facts={"ModelManifest": Manifest(True)}).commands(model.model_present, again) == [
        "call wait_for_fetch"
    ]


# --------------------------------------------------------------------------- service


def test_api_key_generated_once_copied_or_removed(tmp_path):
    s = Settings()
    path = service.key_path(s)
    assert FakeHost(files={path: ("API_KEY=x\n", 600)}).commands(service.api_key, s) == []
    (gen,) = FakeHost().commands(service.api_key, s)
    assert gen.startswith("umask 077 && key=$(head -c 32 /dev/urandom") and gen.endswith(f"mv {path}.tmp {path}")
    assert FakeHost(files={path: ("API_KEY=x\n", 644)}).commands(service.api_key, s) == [f"chmod 600 {path}"]
    none = Settings(api_key_source="none")
    assert FakeHost(files={path: "API_KEY=x\n"}).commands(service.api_key, none) == [f"rm -f {path}"]
    assert FakeHost().commands(service.api_key, none) == []
    key_file = tmp_path / "key"
    key_file.write_text("controller-key-0123456789\n")
    copied = Settings(api_key_source=f"file:{key_file}")
    content = f"{service.KEY_VAR}=controller-key-0123456789\n"
    assert FakeHost(files={path: (content, 600)}).commands(service.api_key, copied) == []
    assert FakeHost(files={path: ("API_KEY=old\n", 600)}).commands(service.api_key, copied) == uploaded(path, "600")


LIB_DIRS = {"/usr/local/lib/freetoken"}


def engine_files(s: Settings, plan) -> dict:
    """What ``service.unit`` converges: the start-time GPU check and its formula, the environment, the unit."""
    return {
        GPU_ROOM_MODULE: source("freetoken_infra", "core", "gpu_room.py"),
        GPU_FREE_SCRIPT: source("operations", "scripts", "gpu_free.py"),
        service.env_path(s): (service.engine_environment(s), 600),
        service.UNIT_PATH: service.engine_unit(s, plan),
    }


def test_engine_unit_converged_then_each_drift():
    s = Settings()
    plan = derive_plan(s, 16311, (12, 0))
    env, unit = service.env_path(s), service.UNIT_PATH
    files = engine_files(s, plan)
    assert FakeHost(files=files, dirs=LIB_DIRS).commands(service.unit, s, plan) == []
    # The GPU check missing (a host converged before it existed): uploaded, the unit's reload with it.
    bare = {k: v for k, v in files.items() if k not in (GPU_ROOM_MODULE, GPU_FREE_SCRIPT)}
    cmds = FakeHost(files=bare, dirs=LIB_DIRS).commands(service.unit, s, plan)
    assert [c for c in cmds if c.startswith("upload")] == [f"upload {GPU_ROOM_MODULE}", f"upload {GPU_FREE_SCRIPT}"]
    # A changed unit is written beside and renamed over (atomic), then systemd reloads.
    other = derive_plan(Settings(listen_port=8100), 16311, (12, 0))
    assert FakeHost(files=files, dirs=LIB_DIRS).commands(service.unit, Settings(listen_port=8100), other) == [
        *uploaded(f"{unit}.new"),
        f"mv -f {unit}.new {unit}",
        "systemctl daemon-reload",
    ]
    # A changed environment: atomic too, and no reload (systemd reads it at start).
    changed = {**files, env: ("LOG_LEVEL=DEBUG\n", 600)}
    assert FakeHost(files=changed, dirs=LIB_DIRS).commands(service.unit, s, plan) == [
        *uploaded(f"{env}.new", "600"),
        f"mv -f {env}.new {env}",
    ]
    loose = {**files, env: (service.engine_environment(s), 644)}
    assert FakeHost(files=loose, dirs=LIB_DIRS).commands(service.unit, s, plan) == [f"chmod 600 {env}"]


# --------------------------------------------------------------------------- windows

WSLCONF = "/etc/wsl.conf"


def test_ini_values_converged_then_missing_then_unmergeable():
    host = FakeHost(files={WSLCONF: b"[boot]\nsystemd=true\n"})
    assert host.commands(windows.ini_values, WSLCONF, "boot", {"systemd": "true"}) == []
    assert host.noops and "already holds systemd" in host.noops[0]
    assert FakeHost(files={WSLCONF: b"[network]\nhostname=ws1\n"}).commands(
        windows.ini_values, WSLCONF, "boot", {"systemd": "true"}
    ) == [f"upload {WSLCONF}"]
    assert FakeHost().commands(windows.ini_values, WSLCONF, "boot", {"systemd": "true"}) == [f"upload {WSLCONF}"]


def test_windows_autostart_exists_then_created_then_refused():
    assert (
        FakeHost(facts={"ScheduledTaskExists": True}).commands(windows.windows_autostart, "FreeToken", "Debian") == []
    )
    (cmd,) = FakeHost(facts={"ScheduledTaskExists": False}).commands(windows.windows_autostart, "FreeToken", "Debian")
    assert cmd == windows.autostart_command("@local", "FreeToken", "Debian")
    with pytest.raises(OperationError, match="distro's name is unknown"):
        FakeHost(facts={"ScheduledTaskExists": False}).commands(windows.windows_autostart, "FreeToken", "")
    with pytest.raises(OperationError, match="is not a WSL distribution name"):
        FakeHost(facts={"ScheduledTaskExists": False}).commands(windows.windows_autostart, "FreeToken", "a;b")


# --------------------------------------------------------------------------- health gate
def gate_host(**files) -> FakeHost:
    """A host with the gate script and its schema uploaded as the operation leaves them."""
    uploaded_files = {
        GATE_SCRIPT: (source("operations", "scripts", "health_gate.py"), 755),
        GATE_RECORD_MODULE: (source("freetoken_infra", "core", "gate_record.py"), 644),
    }
    return FakeHost(files={**uploaded_files, **files})


def test_health_gate_uploads_its_script_and_schema_then_always_gates():
    """The gate never decides it has nothing to do (its skip is the plan's ``_if``, below): on a
    bare host it uploads the script and the schema it imports, on a converged one only the
    check runs, with the plan's values and the host's previous record."""
    s = Settings()
    key = "/etc/freetoken/api.env"
    subject = Gated(engine_version=s.engine_version, unit_sha256="u1")
    previous = GateResult(ok=True, phase="done", gated=subject)
    args = (s, key, GATE_SCRIPT, "0.2.0", subject, previous, GATE_RECORD_FILE)
    assert FakeHost(dirs=[LIB_DIR]).commands(health._health_gate, *args) == [
        *uploaded(GATE_SCRIPT, "755"),
        *uploaded(GATE_RECORD_MODULE),
        "call run_gate",
    ]
    assert gate_host().commands(health._health_gate, *args) == ["call run_gate"]
    stale = gate_host(**{GATE_RECORD_MODULE: ("# an older schema\n", 644)})
    assert stale.commands(health._health_gate, *args) == [*uploaded(GATE_RECORD_MODULE), "call run_gate"]
    (gate,) = [c for c in gate_host().yielded(health._health_gate, *args) if isinstance(c, FunctionCommand)]
    assert gate.function is health.run_gate and gate.args == (s, key, GATE_SCRIPT, {})
    assert gate.kwargs == {
        "rollback_to": "0.2.0",
        "result_path": GATE_RECORD_FILE,
        "subject": subject,
        "previous": previous,
    }


def test_health_gate_reads_the_previous_record_from_the_host():
    s = Settings()
    record = GateResult(ok=True, phase="done", decode_tps=23.5, gated=Gated(engine_version=s.engine_version))
    seen: list = []

    def read(path):
        seen.append(health.gate_record(s, path))
        yield from ()

    reader = type("Op", (), {"_inner": staticmethod(read)})
    gate_host(**{GATE_RECORD_FILE: record.to_json() + "\n"}).yielded(reader, GATE_RECORD_FILE)
    FakeHost().yielded(reader, GATE_RECORD_FILE)
    assert seen == [record, None]


def test_health_gate_is_skipped_when_the_last_passed_gate_is_for_exactly_what_serves():
    """Converged: nothing changed and the host's last passed gate was for exactly what is
    installed and serving now, so the gate's ``_if`` is false and pyinfra does not run it; the
    same host with any reason to gate (here a failed last gate) gates whatever changed."""
    from tests.unit.test_plan import passed_record, planned, serving
    from tests.unit.test_rules import healthy

    def nothing_changed() -> bool:
        return False

    record = passed_record(planned())
    c = planned(obs=healthy(health=serving(), gate_record=record)).converge
    assert c is not None and c.gate.why is None
    conditions = c.gate.run_if(nothing_changed)
    assert conditions and not any(condition() for condition in conditions)
    failed = planned(obs=healthy(health=serving(), gate_record=replace(record, ok=False, phase="answer"))).converge
    assert failed is not None and failed.gate.run_if(nothing_changed) == []  # no condition: it runs


# --------------------------------------------------------------------------- managed files
# operations/managed.py: the one way every operation above writes its files and units.

UNIT_A, UNIT_B = f"{UNIT_DIR}/a.service", f"{UNIT_DIR}/b.timer"
CONF, ENV = "/etc/freetoken/a.conf", "/etc/freetoken/a.env"


def managed_put(*files_):
    """``managed.put`` as an operation of its own, and what it returned (the paths written)."""
    said: list = []

    def run():
        said.append((yield from managed.put(*files_)))

    return type("Op", (), {"_inner": staticmethod(run)}), said


def managed_files(**text):
    return [
        ManagedFile(CONF, text=text.get("conf", "a=1\n")),
        ManagedFile(UNIT_A, text=text.get("a", "[Unit]\n"), unit=True),
        ManagedFile(UNIT_B, text=text.get("b", "[Timer]\n"), unit=True),
        ManagedFile(ENV, text=text.get("env", "API_KEY=k1\n"), mode="600", atomic=True, secret=True),
    ]


def managed_host(**files_) -> FakeHost:
    on_host = {CONF: "a=1\n", UNIT_A: "[Unit]\n", UNIT_B: "[Timer]\n", ENV: ("API_KEY=k1\n", 600)}
    return FakeHost(files={**on_host, **files_})


def test_managed_put_on_a_converged_host_yields_nothing_and_reads_what_files_put_reads():
    host = managed_host()
    op, said = managed_put(*managed_files())
    assert host.commands(op) == [] and said == [frozenset()]
    asked = Counter(name for name, _ in host.asked)
    # files.put's size and hash for three; the atomic secret file's text, then its owner and mode
    assert asked == {"File": 4, "Sha1File": 3, "FileText": 1, "Directory": 3}


def test_managed_put_writes_what_differs_then_reloads_systemd_once():
    op, said = managed_put(*managed_files(a="[Unit]\nX=1\n", b="[Timer]\nY=1\n"))
    assert managed_host().commands(op) == [*uploaded(UNIT_A), *uploaded(UNIT_B), "systemctl daemon-reload"]
    assert said == [frozenset({UNIT_A, UNIT_B})]
    # Not a unit: no reload. A unit's mode put right counts as a change (systemd may have refused it).
    op, said = managed_put(*managed_files(conf="a=2\n"))
    assert managed_host().commands(op) == uploaded(CONF) and said == [frozenset({CONF})]
    op, said = managed_put(*managed_files())
    assert managed_host(**{UNIT_A: ("[Unit]\n", 664)}).commands(op) == [
        f"chmod 644 {UNIT_A}",
        "systemctl daemon-reload",
    ]


def test_managed_put_atomically_writes_beside_and_renames_over():
    op, said = managed_put(*managed_files(env="API_KEY=k2\n"))
    assert managed_host().commands(op) == [*uploaded(f"{ENV}.new", "600"), f"mv -f {ENV}.new {ENV}"]
    # An atomic file's mode is checked even when its text is right: a secret's (a leak) and a
    # unit's that anyone could edit (a way into root; tests/fleet/test_drift.py).
    op, _ = managed_put(*managed_files())
    assert managed_host(**{ENV: ("API_KEY=k1\n", 644)}).commands(op) == [f"chmod 600 {ENV}"]
    plain = ManagedFile(UNIT_A, text="[Unit]\n", atomic=True, unit=True)
    op, said = managed_put(plain)
    assert managed_host(**{UNIT_A: ("[Unit]\n", 666)}).commands(op) == [
        f"chmod 644 {UNIT_A}",
        "systemctl daemon-reload",
    ]
    assert said == [frozenset({UNIT_A})]
    op, said = managed_put(plain)
    assert managed_host(**{UNIT_A: ("[Unit]\n", 644)}).commands(op) == [] and said == [frozenset()]
    # A path with a space is one shell word.
    odd = ManagedFile("/etc/free token/x.env", text="A=1\n", atomic=True)
    op, _ = managed_put(odd)
    assert FakeHost().commands(op)[-1] == "mv -f '/etc/free token/x.env.new' '/etc/free token/x.env'"


def test_managed_put_shows_every_diff_before_its_first_command_and_never_a_secret(caplog):
    """pyinfra's change detection reads an operation up to its first command: every file's diff
    must be printed by then. A secret's diff says that it changes, never its value."""
    changed = managed_files(conf="a=2\n", b="[Timer]\nY=1\n", env="API_KEY=k2\n")

    def up_to_the_first_command():
        yield next(managed.put(*changed))

    op = type("Op", (), {"_inner": staticmethod(up_to_the_first_command)})
    host = managed_host()
    host.diff = True
    with caplog.at_level("INFO"):
        assert host.commands(op) == [f"upload {CONF}"]
    logged = caplog.text
    for path in (CONF, UNIT_B, ENV):
        assert f"Will modify {path}" in logged
    assert "k1" not in logged and "k2" not in logged


def test_managed_running_restarts_or_reloads_only_what_changed():
    up = FakeHost(running={"a.service"}, enabled={"a.service"})
    op = type("Op", (), {"_inner": staticmethod(lambda changed, reload: managed.running("a.service", changed, reload))})
    assert up.commands(op, False, False) == []
    assert up.commands(op, True, False) == ["systemctl restart a.service"]
    assert up.commands(op, True, True) == ["systemctl reload a.service"]
    assert FakeHost().commands(op, True, False) == ["systemctl start a.service", "systemctl enable a.service"]


def test_a_managed_file_is_text_or_a_local_file_and_only_text_is_written_atomically():
    with pytest.raises(ValueError):
        ManagedFile(CONF)
    with pytest.raises(ValueError):
        ManagedFile(CONF, text="x", local="/tmp/x")
    with pytest.raises(ValueError):
        ManagedFile(CONF, local="/tmp/x", atomic=True)


def _noop_hosts():
    """Each operation that writes managed files, on a host where all of it is in place."""
    from tests.unit import test_firewall, test_guard, test_node_exporter

    s = Settings()
    plan = derive_plan(s, 16311, (12, 0))
    engine = engine_files(s, plan)
    cache = Settings(model_cache_host="ws1")
    return {
        "service.unit": (FakeHost(files=engine, dirs=LIB_DIRS), service.unit, (s, plan), {}),
        "guard": (test_guard.guard_host(test_guard.converged_files(s), timer_on=True), guard.guard, (s,), {}),
        "firewall": (test_firewall.converged(), firewall.firewall, (test_firewall.ON_LAN, test_firewall.GW), {}),
        "model_fetcher": (fetcher_host(s), model.model_fetcher, (s,), {}),
        "model_cache": (cache_host(cache, "192.0.2.11"), model.model_cache, (cache,), {"bind": "192.0.2.11"}),
        "node_exporter": (test_node_exporter.converged(s), node_exporter.node_exporter, (s, "127.0.0.1"), {}),
    }


# The facts each reads on a no-op run, counted before its files went through operations/managed.py:
# a no-op run costs no more than it did (bench/converge.py measures what a no-op run costs). The guard
# and the downloader each check core/hostio.py beside their scripts since it became one module
# (one File, Sha1File and Directory more each; the same three reads, answered once per run).
NOOP_FACTS = {
    # the unit's own mode too (one File): a unit any user could edit is a way into root
    "service.unit": {"Directory": 2, "File": 4, "FileText": 2, "Sha1File": 2},
    "guard": {"Directory": 5, "File": 4, "Sha1File": 4, "SystemdEnabled": 1, "SystemdStatus": 1},
    # The live table: a flush leaves the unit `active` (FirewallTable, one read).
    "firewall": {
        "DebPackages": 1,
        "Directory": 2,
        "File": 2,
        "FirewallTable": 1,
        "Sha1File": 2,
        "SystemdEnabled": 1,
        "SystemdStatus": 1,
    },
    "model_fetcher": {"Account": 1, "DirOwnership": 2, "Directory": 6, "File": 7, "Sha1File": 6},
    "model_cache": {
        "Account": 1,  # the workers' own account (cache_user)
        "DebPackages": 1,
        "Directory": 3,
        "File": 3,
        "Sha1File": 3,
        "SystemdEnabled": 1,
        "SystemdStatus": 1,
    },
    "node_exporter": {
        "DebPackages": 1,
        "Directory": 2,
        "File": 1,
        "Sha1File": 1,
        "SystemdEnabled": 1,
        "SystemdStatus": 1,
    },
}


@pytest.mark.parametrize("name", sorted(NOOP_FACTS))
def test_a_no_op_run_yields_nothing_and_reads_no_more_facts_than_before(name):
    host, op, args, kwargs = _noop_hosts()[name]
    assert host.commands(op, *args, **kwargs) == []
    assert Counter(fact for fact, _ in host.asked) == NOOP_FACTS[name]


# --------------------------------------------------------------------------- the waker (gateway host)
def waker_host(gw: Settings, hosts: list[dict], **changed) -> FakeHost:
    from freetoken_infra.core.layout import OWNER_MODULE, WAKER_CONFIG, WAKER_SCRIPT, WAKER_UNIT, WOL_MODULE
    from operations import waker

    files = {
        WOL_MODULE: source("freetoken_infra", "core", "wol.py"),
        OWNER_MODULE: source("freetoken_infra", "core", "owner.py"),
        WAKER_SCRIPT: (source("operations", "scripts", "waker.py"), 755),
        WAKER_CONFIG: waker.waker_config(gw, hosts),
        waker.UNIT_PATH: waker.waker_unit(),
    }
    return FakeHost(files={**files, **changed}, running={WAKER_UNIT}, enabled={WAKER_UNIT})


def test_waker_converged_then_each_drift_and_gone_with_no_host_to_wake():
    from freetoken_infra.core.layout import WAKER_CONFIG, WAKER_SCRIPT, WAKER_UNIT
    from operations import waker

    gw = Settings(wake_on_lan_broadcast="10.213.0.255")
    hosts = waker.targets({"ws2": Settings(wake_on_lan_mac="52:54:00:12:34:56")})
    assert waker_host(gw, hosts).commands(waker.waker, gw, hosts) == []
    # A bare gateway: every file, then systemd reloaded and the unit enabled and started.
    bare = FakeHost().commands(waker.waker, gw, hosts)
    for path in (WAKER_SCRIPT, WAKER_CONFIG, waker.UNIT_PATH):
        assert f"upload {path}" in bare, bare
    assert "systemctl daemon-reload" in bare
    assert any(WAKER_UNIT in c and "start" in c for c in bare), bare
    # A new cooldown: only the config, and the waker restarted to read it.
    slower = Settings(wake_on_lan_broadcast="10.213.0.255", wake_on_lan_cooldown_s=1800)
    cmds = waker_host(gw, hosts).commands(waker.waker, slower, hosts)
    assert cmds[0] == f"upload {WAKER_CONFIG}" and not [c for c in cmds if c.startswith("upload") and c != cmds[0]]
    assert any(WAKER_UNIT in c and "restart" in c for c in cmds), cmds
    # A script changed on the host (by hand, or an older release): put back, the waker restarted.
    cmds = waker_host(gw, hosts, **{WAKER_SCRIPT: ("# edited\n", 755)}).commands(waker.waker, gw, hosts)
    assert cmds[0] == f"upload {WAKER_SCRIPT}" and any(WAKER_UNIT in c and "restart" in c for c in cmds), cmds
    # No host to wake: the unit is stopped and disabled, and nothing is uploaded.
    cmds = waker_host(gw, hosts).commands(waker.waker, gw, [])
    assert cmds and not [c for c in cmds if c.startswith("upload")]
    assert any("stop" in c and WAKER_UNIT in c for c in cmds) and any("disable" in c for c in cmds), cmds
    # ...and on a gateway that never had it, nothing at all.
    assert FakeHost().commands(waker.waker, gw, []) == []


def test_waker_user_is_a_system_account_without_login_made_once():
    from freetoken_infra.core.layout import WAKER_USER
    from operations import waker

    made = FakeHost(facts={"Users": {}, "Groups": set()}).commands(waker.user)
    (useradd,) = made  # the account alone: no home made for it (pyinfra's default would make /nonexistent)
    assert "-r" in useradd.split() or "--system" in useradd, useradd
    assert "/usr/sbin/nologin" in useradd and WAKER_USER in useradd, useradd
    account = {"home": "/nonexistent", "shell": "/usr/sbin/nologin", "group": WAKER_USER, "groups": []}
    assert FakeHost(facts={"Users": {WAKER_USER: account}, "Groups": {WAKER_USER}}).commands(waker.user) == []
