"""Where things live on a host: unit names, directories, scripts, state files.

One home for every name and path the deploy, the facts, the rules, the verify suite and the
tests use on a target, derived once from a host's ``Settings`` (``HostLayout.of(settings)``).
Core: imports nothing of ours but the settings.

Ownership (the trust model in docs/security.md): the engine's service user writes only ``cache_dir``
(its kernel caches and working directory); the model and the download's status belong to the
download's own user (``fetch_user``), so the engine only reads the model; ``state_dir`` and every
folder above those leaves is root's (a setting under a folder root did not create gets only its
leaf). Root creates and re-owns these folders without following links
(``scripts/own_dir.py``) and never writes, reads or sources a path inside a less-trusted
user's folder; what root keeps for itself lives in ``deploy_state_dir`` (root-owned, outside
every unit's ``ReadWritePaths``).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken_infra.core.manifest import MANIFEST_NAME
from freetoken_infra.core.settings import Settings

UNIT_DIR = "/etc/systemd/system"
# Scripts the operations upload and run on the target with its own python3 (root-owned).
LIB_DIR = "/usr/local/lib/freetoken"

ENGINE_UNIT = "freetoken.service"
GUARD_SERVICE = "freetoken-guard.service"
GUARD_TIMER = "freetoken-guard.timer"
# The host agent (operations/owner.py): the gateway's agent-check, the yield to the owner.
AGENT_UNIT = "freetoken-agent.service"
# The agent-check port, bound by systemd (PID 1) from boot, before the engine can start: the agent
# takes the listening socket from it.
AGENT_SOCKET = "freetoken-agent.socket"
FETCH_UNIT = "freetoken-model-fetch.service"
CACHE_UNIT = "freetoken-model-cache.service"
# Debian's node_exporter (operations/node_exporter.py): our settings in a drop-in of its unit.
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"
NODE_EXPORTER_UNIT = "prometheus-node-exporter.service"
NODE_EXPORTER_BINARY = "/usr/bin/prometheus-node-exporter"
NODE_EXPORTER_DROPIN = f"{UNIT_DIR}/{NODE_EXPORTER_UNIT}.d/freetoken.conf"

GATE_SCRIPT = f"{LIB_DIR}/health_gate.py"
GATE_RECORD_MODULE = f"{LIB_DIR}/gate_record.py"  # the gate result's schema, imported by health_gate.py
GUARD_SCRIPT = f"{LIB_DIR}/guard.py"
FETCH_SCRIPT = f"{LIB_DIR}/fetch_model.py"
CACHE_SCRIPT = f"{LIB_DIR}/model_cache.py"
# The LAN model cache is Debian's nginx with our configuration (operations/model.py): root's,
# outside every tree a less-trusted user writes; what it generates at each start (the served
# files, the gated cache's key map) lies in the unit's own runtime folder, root's and 0700.
CACHE_NGINX_PACKAGE = "nginx"
CACHE_NGINX_CONF = f"{LIB_DIR}/model-cache-nginx.conf"
CACHE_RUN_DIR = "/run/freetoken-model-cache"
QUANT_MODULE = f"{LIB_DIR}/quant.py"  # fetch_model.py imports it from its own folder
MANIFEST_MODULE = f"{LIB_DIR}/manifest.py"  # so do fetch_model.py --check and model_cache.py
HOSTIO_MODULE = f"{LIB_DIR}/hostio.py"  # fetch_model.py and guard.py: atomic writes, byte counts
GPU_FREE_SCRIPT = f"{LIB_DIR}/gpu_free.py"  # the engine's ExecStartPre: is enough of the GPU free?
GPU_ROOM_MODULE = f"{LIB_DIR}/gpu_room.py"  # gpu_free.py imports it from its own folder
HOST_LOCK_SCRIPT = f"{LIB_DIR}/host_lock.py"
AGENT_SCRIPT = f"{LIB_DIR}/owner_agent.py"
OWNER_MODULE = f"{LIB_DIR}/owner.py"  # owner_agent.py imports it from its own folder
AGENT_METRICS_MODULE = f"{LIB_DIR}/agent_metrics.py"  # and this one (its samples for node_exporter)
# The owner's command on the host: freetoken-owner snooze 2h | resume | status.
OWNER_COMMAND = "/usr/local/bin/freetoken-owner"
OWN_DIR_SCRIPT = f"{LIB_DIR}/own_dir.py"  # root makes and re-owns folders without following links
# root writes the owner's .wslconfig and Desktop shortcuts (below the drive root) by rename,
# never through a link; hostio.py beside it
WINDOWS_FILE_SCRIPT = f"{LIB_DIR}/windows_file.py"

# Root's own state on the target: never inside the service user's state_dir and outside every
# unit's ReadWritePaths except the root guard's. Owned by root, mode DEPLOY_STATE_MODE (what is
# in it is no secret: the gate's last result, the guard's state and samples).
DEPLOY_STATE_DIR = "/var/lib/freetoken-deploy"
DEPLOY_STATE_MODE = "755"
# Root's runtime state (tmpfs: gone with a reboot, which ends every run that held anything).
DEPLOY_RUN_DIR = "/run/freetoken-deploy"
# The host agent's state (why the host yielded, since when), read by `freetoken-owner status`:
# in the agent unit's own runtime folder (root's; kept across the agent's restarts, gone with a
# reboot, after which the agent looks afresh). The owner's snooze outlives a reboot: root's
# state folder.
AGENT_RUN_DIR_NAME = "freetoken-agent"  # the unit's RuntimeDirectory=
AGENT_STATE_FILE = f"/run/{AGENT_RUN_DIR_NAME}/owner-state.json"
OWNER_OVERRIDE_FILE = f"{DEPLOY_STATE_DIR}/owner-override.json"
# One deploy run per host at a time (operations/host_lock.py): who holds the host, and the
# file its take-over decisions are serialised on. Volatile: the lock is taken before the
# preflight, so also on a host the preflight then refuses, which must be left as it was.
HOST_LOCK_FILE = f"{DEPLOY_RUN_DIR}/run.lock"
HOST_LOCK_MUTEX = f"{DEPLOY_RUN_DIR}/run.lock.mutex"
# The last run that changed nothing, or that the preflight refused until the next boot: the
# controller's fingerprint, the signature of every input of the facts it read and, for a refusal,
# its blockers (operations/host_lock.py, facts/inputs.py). Root's, 0600: while it stands, a re-run
# reads it instead of the facts (the fast check). Volatile: the boot is one of its inputs, so no
# record outlives one anyway, and a host the preflight refused keeps nothing of the run.
CONVERGE_RECORD_FILE = f"{DEPLOY_RUN_DIR}/record.json"
# The health gate's record: the last result, what it gated, and the last passed gate.
GATE_RECORD_FILE = f"{DEPLOY_STATE_DIR}/health-gate.json"
# Written into an engine venv as the last step of building it: a venv without it is unfinished.
ENGINE_COMPLETE_MARKER = ".freetoken-infra-complete"

KEY_VAR = "FREETOKEN_API_KEY"

# NVIDIA's CUDA apt repository on the target (operations/cuda.py): its keyring, our sources
# line for it, the pin that keeps apt from installing a Linux driver (WSL's comes from Windows),
# and the login profile that puts nvcc on PATH.
CUDA_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
CUDA_SOURCES_FILE = "/etc/apt/sources.list.d/freetoken-cuda.list"
CUDA_PIN_FILE = "/etc/apt/preferences.d/freetoken-no-nvidia-driver"
CUDA_PROFILE_FILE = "/etc/profile.d/freetoken-cuda.sh"

# The Windows side, seen from the distro. wsl.conf's `[automount] root` moves the drives
# (`root = /` puts C: at /c); the default is /mnt/ (WslDistributionConfig.cpp in microsoft/WSL).
WSL_CONF = "/etc/wsl.conf"
# WSL's interop handler in the kernel's binfmt_misc table, and the binfmt.d entry that puts it
# back whenever systemd-binfmt (or a package) empties the table: WSL's own registration line
# (microsoft/WSL src/linux/init/binfmt.h), under the name WSL uses (WSLInterop; releases that
# registered it late named it WSLInterop-late, which counts as well).
BINFMT_DIR = "/proc/sys/fs/binfmt_misc"
INTEROP_BINFMT_NAMES = ("WSLInterop", "WSLInterop-late")
INTEROP_BINFMT_CONF = "/etc/binfmt.d/WSLInterop.conf"
INTEROP_BINFMT_LINE = ":WSLInterop:M::MZ::/init:FP"
SYSTEMD_BINFMT = "/usr/lib/systemd/systemd-binfmt"
WSLCONFIG_NAME = ".wslconfig"  # in %UserProfile%
DEFAULT_DRIVE_ROOT = "/mnt/"


def drive_path(drive_root: str, letter: str = "c") -> str:
    """The WSL path of a Windows drive under the automount root: ``/mnt/c``, ``/c``."""
    root = drive_root if drive_root.endswith("/") else drive_root + "/"
    return f"{root}{letter.lower()}"


# What the deploy, the rules and the report say when a Windows-side change needs the WSL VM
# restarted (pitfall 4A: .wslconfig and wsl.conf are read only when the VM boots).
RESTART_MESSAGE = "restart required: run `wsl.exe --shutdown` from Windows"


@dataclass(frozen=True)
class HostLayout:
    """The paths of one host, derived from its settings."""

    engine_base_dir: str
    engine_venv: str
    engine_active_link: str
    state_dir: str
    config_dir: str
    cache_dir: str
    model_dir: str
    cuda_home: str

    @classmethod
    def of(cls, settings: Settings) -> HostLayout:
        return cls(
            engine_base_dir=settings.engine_base_dir,
            engine_venv=f"{settings.engine_base_dir}/{settings.engine_version}",
            engine_active_link=f"{settings.engine_base_dir}/active",
            state_dir=settings.state_dir,
            config_dir=settings.config_dir,
            cache_dir=settings.cache_dir,
            model_dir=settings.model_dir,
            cuda_home=settings.cuda_home,
        )

    def engine_venv_for(self, version: str) -> str:
        return f"{self.engine_base_dir}/{version}"

    # --- files root writes (config_dir and DEPLOY_STATE_DIR are root-owned) ---------------
    @property
    def unit_file(self) -> str:
        return f"{UNIT_DIR}/{ENGINE_UNIT}"

    @property
    def engine_env_file(self) -> str:
        return f"{self.config_dir}/engine.env"

    @property
    def api_key_file(self) -> str:
        return f"{self.config_dir}/api-key.env"

    @property
    def deploy_state_dir(self) -> str:
        return DEPLOY_STATE_DIR

    @property
    def last_gate_file(self) -> str:
        """The health gate's record (root's: the skip decision and the rollback target are read
        from it): last result, what it gated, the last passed gate."""
        return GATE_RECORD_FILE

    @property
    def host_lock_file(self) -> str:
        return HOST_LOCK_FILE

    def engine_complete_marker(self, version: str) -> str:
        return f"{self.engine_venv_for(version)}/{ENGINE_COMPLETE_MARKER}"

    @property
    def model_manifest_file(self) -> str:
        """The model download's manifest (``core.manifest``): its hash is part of what a gate gated."""
        return f"{self.model_dir}/{MANIFEST_NAME}"

    @property
    def guard_state_file(self) -> str:
        """Written by the guard (root) when it stops the engine; read by the ``GuardState`` fact."""
        return f"{DEPLOY_STATE_DIR}/guard-state.json"

    @property
    def guard_textfile(self) -> str:
        """Samples for node_exporter's textfile collector (``--collector.textfile.directory``),
        written by the guard (root)."""
        return f"{DEPLOY_STATE_DIR}/metrics/freetoken.prom"

    @property
    def guard_textfile_dir(self) -> str:
        """node_exporter's ``--collector.textfile.directory``: the folder of ``guard_textfile``."""
        return self.guard_textfile.rsplit("/", 1)[0]

    @property
    def agent_textfile(self) -> str:
        """The host agent's samples (``core.agent_metrics``) beside the guard's, written by the
        agent (root)."""
        return f"{self.guard_textfile_dir}/freetoken_agent.prom"

    # --- under state_dir, owned by the download's user: root touches these only as that user --

    @property
    def fetch_status_dir(self) -> str:
        """Owned by ``fetch_user``: the fetcher rewrites its status file there atomically."""
        return f"{self.state_dir}/model-fetch"

    @property
    def fetch_status_file(self) -> str:
        return f"{self.fetch_status_dir}/status.json"

    @property
    def reverify_request_file(self) -> str:
        """While this file exists the downloader re-hashes every file (``model_reverify``)."""
        return f"{self.fetch_status_dir}/reverify-requested"


# --- the fleet's gateway (deploys/gateway.py): HAProxy from the distribution ---------------
# Hosts of this inventory group run the gateway; every host with `runs_engine` is a backend.
GATEWAY_GROUP = "gateway"
GATEWAY_CONFIG = "/etc/haproxy/haproxy.cfg"
# 0600 root: HAProxy reads them while still root (at start and on every reload).
GATEWAY_KEYS_MAP = "/etc/haproxy/freetoken-gateway-keys.map"  # client key -> client label
GATEWAY_ENGINE_KEY_MAP = "/etc/haproxy/freetoken-engine-key.map"  # the fleet's engine key
# /metrics and /stats only (the scrape key): a client key opens neither, a metrics key no /v1.
GATEWAY_METRICS_KEYS_MAP = "/etc/haproxy/freetoken-metrics-keys.map"  # metrics key -> label
# The runtime API (drain / ready / status), root only.
GATEWAY_RUNTIME_SOCKET = "/run/haproxy/admin.sock"
# Drain, maintenance and health states survive a reload: dumped here before each one.
GATEWAY_SERVER_STATE = "/var/lib/haproxy/server-state"
# The fleet's Prometheus scrape config, generated on the gateway host.
GATEWAY_SCRAPE_CONFIG = "/etc/haproxy/freetoken-prometheus.yml"
# The fleet's alert rules (docs/alerts.md), generated beside the scrape config.
GATEWAY_ALERT_RULES = "/etc/haproxy/freetoken-alerts.yml"
# The gateway's one HAProxy backend: every serving host, with its engine's slots.
GATEWAY_BACKEND = "freetoken"

# --- Prometheus and Alertmanager on the gateway host (alerting_enabled; Debian's packages) -------
# Both run as the packages' user `prometheus`; their secrets are root's, group prometheus, 0640.
PROMETHEUS_USER = "prometheus"
PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
PROMETHEUS_DEFAULTS = "/etc/default/prometheus"  # its ARGS (listen address)
PROMETHEUS_UNIT = "prometheus"
# The first key of gateway_metrics_keys_source: Prometheus' bearer token for HAProxy's /metrics.
PROMETHEUS_SCRAPE_KEY = "/etc/prometheus/freetoken-gateway.key"
PROMETHEUS_LISTEN = "127.0.0.1:9090"
ALERTMANAGER_CONFIG = "/etc/prometheus/alertmanager.yml"
ALERTMANAGER_DEFAULTS = "/etc/default/prometheus-alertmanager"
ALERTMANAGER_UNIT = "prometheus-alertmanager"
ALERTMANAGER_SMTP_PASSWORD = "/etc/prometheus/freetoken-alertmanager-smtp-password"
ALERTMANAGER_LISTEN = "127.0.0.1:9093"
# Requests with the same value of this header go to the same healthy host (its KV cache).
SESSION_HEADER = "X-Session-Id"
# The gateway names the host that answered in this response header.
SERVED_BY_HEADER = "X-FreeToken-Host"

# The gateway's waker (operations/waker.py): its own user reads HAProxy's stats
# through this socket (level user: read-only, no key, no state change) and wakes sleeping hosts.
WAKER_UNIT = "freetoken-waker.service"
WAKER_USER = "freetoken-waker"
WAKER_SOCKET = "/run/haproxy/freetoken-waker.sock"
WAKER_SCRIPT = f"{LIB_DIR}/waker.py"
WOL_MODULE = f"{LIB_DIR}/wol.py"  # waker.py imports it from its own folder
WAKER_CONFIG = "/etc/freetoken/waker.json"  # root's 0644: hosts, MACs, timings (no secret)

# The gateway's TLS certificate and key (gateway_tls_cert_file, uploaded from the controller):
# 0600 root, read by HAProxy while still root, like the key maps.
GATEWAY_TLS_PEM = "/etc/haproxy/freetoken-gateway.pem"

# --- the workstation's firewall (operations/firewall.py): nftables from the distribution ------
# One table of ours, loaded by a unit of ours at boot before the network: the engine's ports and
# node_exporter's only from loopback, the gateway host(s) and the firewall_*_from settings.
FIREWALL_PACKAGE = "nftables"
FIREWALL_NFT = "/usr/sbin/nft"
FIREWALL_TABLE = "freetoken"  # `table inet freetoken`: the only table we load or delete
FIREWALL_RULES = "/etc/freetoken-firewall.nft"
FIREWALL_UNIT = "freetoken-firewall.service"
# The live table as nft listed it right after the unit loaded it (root's, in /run): a table that
# was flushed or changed since (`nft flush ruleset`, Debian's nftables.service) lists otherwise.
FIREWALL_LOADED = "/run/freetoken-firewall.loaded"
