"""Everything a host can set, as one validated pydantic model.

pyinfra hands each host a flat ``host.data`` (inventory data over group data over
``group_data/all.py``). ``settings_for(host)`` turns it into one frozen ``Settings``
object. Bad input never reaches a host: ``validate_inventory`` checks every host
first and raises ``SettingsError`` with one line per problem, naming the host, the
field, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
from ipaddress import IPv4Address
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyAddress,
    IPvAnyNetwork,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from freetoken_infra.core import owner, redact, wol
from freetoken_infra.core.hardware import HARDWARE_PROFILES

if TYPE_CHECKING:
    from pyinfra.api.host import Host
    from pyinfra.api.inventory import Inventory

# Pitfall 4 (A and B): below this WSL release, processes started from a wsl.exe
# session are reaped and WDDM locks usable GPU memory at 0 (fake OOMs). The field
# report's fix was WSL 2.7.13; CUDA graph capture on Blackwell also crashed before
# 2.7.0 (vllm#37242).
WSL_VERSION_FLOOR = "2.7.13"

# NVIDIA's CUDA repository for Ubuntu 24.04 (field report, pitfall 3). The keyring
# package 1.0-1 answers 404 there; 1.1-1 is the current one.
NVIDIA_CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/"
NVIDIA_CUDA_KEYRING = NVIDIA_CUDA_REPO + "cuda-keyring_1.1-1_all.deb"

# Every pattern below is used with fullmatch: `$` would also accept a trailing newline, which
# split an ExecStart= line and broke the .wslconfig merge.
_SIZE_RE = re.compile(r"[1-9][0-9]*(MB|GB|TB)")
_VERSION_RE = re.compile(r"[0-9]+(\.[0-9]+){1,3}")
_PEP440_RE = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")
_REPO_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_PACKAGE_RE = re.compile(r"[a-z0-9][a-z0-9+.-]+")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HOST_NAME_RE = re.compile(r"[A-Za-z0-9@][A-Za-z0-9._@:-]*")
_ENV_VAR_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Alert mail: what Alertmanager's config takes (addresses and the smarthost reach YAML only).
_EMAIL_RE = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,253}\.[A-Za-z]{2,63}")
_SMARTHOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?:([0-9]{1,5})")
# A branch, tag or commit: git ref characters a URL path and a shell word need no escaping for.
_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*")
# Paths reach shells (root's commands), systemd unit files (`%` specifiers, `$` and spaces
# split words), env files and the Windows side, so one conservative set: letters, digits and
# `._+-` per component. No `..` or `.` component; `//` and a trailing `/` are normalised away.
_PATH_COMPONENT_RE = re.compile(r"[A-Za-z0-9._+-]+")
# NVIDIA's CUDA on WSL guide: inside WSL the Windows driver is the driver; these packages would
# install a Linux one (`cuda` and `cuda-X-Y` depend on cuda-drivers). The same globs
# become the deploy's apt pin (priority -1) and the settings check below.
# Named one by one rather than `nvidia-*`, which would also block tools a WSL user may
# want (nvidia-container-toolkit); cuda-compat-* is the driver's user-mode part.
DRIVER_PACKAGE_GLOBS = (
    "cuda",
    "cuda-[0-9]*-[0-9]*",
    "cuda-drivers*",
    "cuda-compat*",
    "nvidia-driver*",
    "nvidia-open*",
    "nvidia-dkms-*",
    "nvidia-kernel-*",
    "nvidia-utils-*",
    "nvidia-compute-utils-*",
    "nvidia-headless-*",
    "nvidia-firmware-*",
    "nvidia-modprobe",
    "nvidia-persistenced",
    "nvidia-settings",
    "nvidia-fabricmanager*",
    "nvidia-imex*",
    "nvidia-fs*",
    "nvidia-gds*",
    "libnvidia-*",
    "xserver-xorg-video-nvidia-*",
    "linux-modules-nvidia-*",
    "linux-objects-nvidia-*",
    "linux-signatures-nvidia-*",
)
DRIVER_PACKAGE_RE = re.compile("|".join(fnmatch.translate(g) for g in DRIVER_PACKAGE_GLOBS))


def _abs_path(value: str, what: str = "an absolute path") -> str:
    """The normalised path, or ValueError: absolute, components of letters, digits and
    ``._+-`` only (no spaces, quotes, ``$``, ``;``, ``%``, newlines...), none ``.`` or ``..``."""
    parts = [p for p in value.split("/") if p] if isinstance(value, str) else None
    if (
        parts is None
        or not value.startswith("/")
        or any(p in (".", "..") or not _PATH_COMPONENT_RE.fullmatch(p) for p in parts)
    ):
        raise ValueError(
            f"must be {what} of letters, digits, '/' and '._+-' only (no spaces, quotes, "
            "'$;%`' or newlines), no '.' or '..' component"
        )
    return "/" + "/".join(parts)


class Settings(BaseModel):
    """One host's settings. Defaults are the field report's working values."""

    # allow_inf_nan=False: 1e309 reads as inf and nan compares false to every bound.
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True, validate_default=True
    )

    # Every setting's description is the docstring under it (pydantic's attribute docstrings):
    # one line each, shown by the README's settings table (`python -m freetoken_infra.core.settings`).

    # --- engine -------------------------------------------------------------
    engine_package: str = "freetoken"
    """Python package of the engine."""
    engine_version: str = "0.2.1"
    """Engine release installed into its own venv; changing it is a blue-green upgrade."""
    engine_extras: list[str] = Field(default_factory=lambda: ["accel"])
    """pip extras of the engine package (`accel`: the faster kernels)."""
    engine_base_dir: str = "/opt/freetoken"
    """One venv per engine version under this directory, `active` links the one in service."""
    pip_index_url: AnyHttpUrl | None = None
    """pip index (a mirror) for the engine's venv; pip's own index when unset."""
    pip_extra_index_urls: list[AnyHttpUrl] = Field(default_factory=list)
    """Further pip indexes for the engine's venv."""

    # --- model --------------------------------------------------------------
    model_repo: str = "nvidia/Qwen3.6-35B-A3B-NVFP4"
    """Hub repository of the model; NVIDIA's modelopt build (pitfall 2: not unsloth's)."""
    model_revision: str = "main"
    """Branch, tag or commit of the model repository."""
    model_dir: str = "/var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia"
    """Where the model is kept; its last component is the served model name (field report)."""
    model_size_gb: float = Field(22.0, gt=0)
    """Size of the model's files, for the disk check."""
    model_expert_ram_gb: float = Field(16.9, gt=0)
    """RAM the offloaded experts take, for the RAM check."""
    hub_endpoint: AnyHttpUrl = AnyHttpUrl("https://huggingface.co")
    """The model hub or a mirror of it."""
    hub_disable_xet: bool = True
    """Never use the Xet protocol (pitfall 2: it answered 401)."""
    hub_token_file: str | None = None
    """Root-only file on the target holding the hub token of a gated repository."""
    model_cache_host: str | None = None
    """Inventory name of the host that serves its verified model to the rest of the fleet."""
    model_cache_port: int = Field(8090, ge=1, le=65535)
    """Port of the LAN model cache on model_cache_host."""
    model_cache_bind: IPvAnyAddress | None = None
    """Address the LAN model cache listens on; unset: the address the fleet reaches its host by."""
    model_sources: list[AnyHttpUrl] = Field(default_factory=list)
    """Further model caches (e.g. one the controller runs), tried after model_cache_host."""
    model_reverify: bool = False
    """One-shot (`--data model_reverify=true`): re-hash every model file this run."""

    # --- launch plan (None = derived from the hardware profile) ---------------
    hardware_profile: str = "auto"
    """Hardware class of the host (`group_data/<class>.py`); `auto` reads it off the GPU."""
    launch_moe_strategy: Literal["auto", "fused", "offload", "cpu", "hybrid"] | None = None
    """Override of the derived `--moe-strategy`."""
    launch_moe_cache_size: Literal["auto"] | int | None = None
    """Override of the derived `--moe-cache-size` (experts kept on the GPU) or `auto`."""
    launch_num_tokens: int | None = Field(None, gt=0)
    """Override of the derived `--num-tokens` (KV capacity)."""
    launch_kv_reserve_tokens: int | None = Field(None, gt=0)
    """Override of the derived `--kv-reserve-tokens`."""
    launch_max_prefill_length: int | None = Field(None, gt=0)
    """Override of the derived `--max-prefill-length`."""
    launch_max_running_requests: int | None = Field(None, ge=1, le=64)
    """Override of the derived `--max-running-requests`."""
    launch_moe_cpu_layers: str | None = None
    """Override of `--moe-cpu-layers`: `auto`, a count, a fraction or layer ids."""
    launch_attention_backend: Literal["auto", "triton", "trtllm", "fi", "fa"] | None = None
    """Override of the derived `--attention-backend`."""
    launch_memory_ratio: float | None = Field(None, gt=0, le=1)
    """Override of the derived `--memory-ratio` (share of GPU memory the engine takes)."""
    listen_host: IPvAnyAddress = IPvAnyAddress("127.0.0.1")  # type: ignore[operator]
    """Address the API listens on (loopback unless the fleet must reach it)."""
    listen_port: int = Field(8000, ge=1, le=65534)
    """Port of the API; the engine also binds port+1 (gloo), hence the upper bound."""
    api_key_source: str = "generate"
    """API key: `generate` (made on the host), `none`, `file:/path` or `env:VAR` on the controller."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """The engine's log level."""

    # --- Windows side ---------------------------------------------------------
    wslconfig_memory: str = "24GB"
    """`.wslconfig` `[wsl2] memory`: RAM of the WSL VM."""
    wslconfig_processors: int = Field(8, ge=1, le=256)
    """`.wslconfig` `[wsl2] processors`."""
    wslconfig_swap: str = "4GB"
    """`.wslconfig` `[wsl2] swap`."""
    wslconfig_localhost_forwarding: bool = True
    """`.wslconfig` `[wsl2] localhostForwarding`."""
    wslconfig_vm_idle_timeout: int = Field(0, ge=-1)
    """`.wslconfig` `[wsl2] vmIdleTimeout` in ms; 0 keeps the VM up (pitfall 4A)."""
    wslconfig_networking_mode: Literal["nat", "mirrored"] | None = None
    """`.wslconfig` `[wsl2] networkingMode`; `mirrored` lets the LAN reach the distro."""
    wsl_min_version: str = WSL_VERSION_FLOOR
    """Lowest WSL release accepted (pitfall 4A/4B)."""
    windows_autostart: bool = False
    """A Windows logon task that starts the distro (and so the engine) at logon."""

    # --- CUDA toolchain ---------------------------------------------------------
    cuda_repo_url: AnyHttpUrl = AnyHttpUrl(NVIDIA_CUDA_REPO)
    """NVIDIA's CUDA apt repository (pitfall 3)."""
    cuda_keyring_url: AnyHttpUrl = AnyHttpUrl(NVIDIA_CUDA_KEYRING)
    """The repository's keyring package."""
    cuda_packages: list[str] = Field(
        default_factory=lambda: ["cuda-nvcc-13-0", "cuda-cudart-dev-13-0", "cuda-cccl-13-0"]
    )
    """The CUDA toolchain packages, never a driver (pitfall 3)."""
    cuda_home: str = "/usr/local/cuda-13.0"
    """CUDA_HOME of the engine."""

    # --- service, paths, guard, thresholds -------------------------------------
    service_user: str = "freetoken"
    """System user the engine runs as; it writes only `cache_dir` and reads the model."""
    fetch_user: str = "freetoken-fetch"
    """System user the model download runs as; it alone writes `model_dir` (the engine only reads it)."""
    cache_user: str = "freetoken-cache"
    """System user the LAN model cache's nginx workers run as (on the `model_cache_host`): neither the engine's nor the download's, so neither can signal or trace them."""
    state_dir: str = "/var/lib/freetoken"
    """Root-owned home of the model and the download status (`model-fetch/`, owned by fetch_user)."""
    config_dir: str = "/etc/freetoken"
    """Root-owned configuration: the key and environment files."""
    cache_dir: str = "/var/cache/freetoken"
    """The engine's only writable folder (owned by service_user): its kernel caches (a cold start of minutes becomes ~34 s) and working directory."""
    start_timeout_s: int = Field(300, ge=30, le=3600)
    """How long systemd waits for the engine to start."""
    health_timeout_s: int = Field(600, ge=10, le=7200)
    """How long the health gate waits for `/health` ok."""
    host_lock_timeout_s: int = Field(600, ge=0, le=86400)
    """How long a run waits for another run's lock on the host before it stops that host."""
    fast_check: bool = True
    """A re-run on a host where nothing the last converge read has changed (files, packages, units, boot, the engine's `/health`; same settings and code) reads one record instead of every fact; false: every run reads every fact."""
    decode_floor_tps: float | None = Field(None, gt=0)
    """Lowest decode tokens/s the gate accepts (set per hardware class)."""
    guard_enabled: bool = True
    """Run the guard timer (samples memory, stops the engine on swap growth or CUDA OOM)."""
    guard_interval_s: int = Field(30, ge=5, le=3600)
    """Seconds between guard samples."""
    guard_swap_limit_gb: float = Field(2.0, gt=0)
    """The guard stops the engine when swap use exceeds this (operations advice)."""
    agent_enabled: bool = True
    """Run the host agent: tells the gateway ready/drain (HAProxy's agent-check) and yields the GPU to its owner."""
    agent_port: int = Field(8010, ge=1, le=65535)
    """TCP port of the host agent's agent-check answers (admitted from the gateway host(s) only)."""
    owner_vram_threshold_gb: float = Field(4.0, ge=0)
    """Other processes' GPU memory (a game: the card's used memory less the engine's) above this makes the host yield; 0: never."""
    owner_quiet_s: int = Field(30, ge=0, le=86400)
    """Seconds the owner's claim must have been gone before the engine starts again."""
    owner_drain_timeout_s: float = Field(10.0, ge=0, le=10)
    """How long a yield lets running streams finish (FreeToken's prepare-stop; at most its own 10 s)."""
    owner_apps: list[str] = Field(default_factory=list, max_length=64)
    """Windows image names (e.g. `eldenring.exe`): while one runs on Windows (`tasklist.exe`, through interop) the host yields."""
    owner_fullscreen: bool = False
    """A full-screen app on Windows (shell32's notification state: busy, Direct3D full screen, presentation) makes the host yield."""
    owner_reboot_drain: bool = True
    """A pending Windows reboot (Windows Update's RebootRequired / RebootPending keys) drains the host: no new work."""
    owner_windows_interval_s: int = Field(5, ge=1, le=300)
    """Seconds between the agent's looks at Windows (apps, full screen); each interop start costs about half a second."""
    owner_shortcuts: bool = True
    """Put two shortcuts on the owner's Windows Desktop: `freetoken-owner snooze 2h` and `resume` through `wsl.exe -u root`."""
    serve_hours: str | None = None
    """When the host serves, local time: `Mon-Fri 18:00-08:00`, `22:00-07:00`, several joined by `;`; outside them it drains and stops the engine. Unset: always."""
    node_exporter_enabled: bool = True
    """Install Debian's prometheus-node-exporter, its textfile collector reading the guard's samples."""
    node_exporter_port: int = Field(9100, ge=1, le=65535)
    """Port of node_exporter's `/metrics` (the fleet's scrape config points at it)."""
    node_exporter_bind: IPvAnyAddress | None = None
    """Address node_exporter listens on; unset: listen_host, or if that is 0.0.0.0 the address the fleet reaches the host by."""
    firewall_enabled: bool = True
    """When the engine or node_exporter listens beyond loopback: nftables admits their ports only from loopback, the gateway host(s) and the two settings below."""
    firewall_engine_from: list[IPvAnyNetwork] = Field(default_factory=list)
    """Further addresses or networks admitted to the engine's port (clients that bypass the gateway)."""
    firewall_metrics_from: list[IPvAnyNetwork] = Field(default_factory=list)
    """Further addresses or networks admitted to node_exporter (your Prometheus host)."""
    ram_margin_gb: float = Field(3.0, ge=0)
    """RAM to keep free beside the experts."""
    disk_margin_gb: float = Field(5.0, ge=0)
    """Disk to keep free beside the model and the engine."""
    engine_env_size_gb: float = Field(12.0, ge=0)
    """Disk one engine venv takes."""

    # --- the fleet's gateway (deploys/gateway.py; docs/gateway.md) ---
    runs_engine: bool = True
    """False: a gateway-only machine (no engine; rollouts skip it, it is no backend)."""
    gateway_port: int = Field(8080, ge=1, le=65535)
    """Port of the fleet's one OpenAI base URL on the gateway host."""
    gateway_stats_port: int = Field(8404, ge=1, le=65535)
    """Port of the gateway's Prometheus `/metrics` and `/stats` (a metrics key required)."""
    gateway_keys_source: str | None = None
    """Clients' gateway keys on the controller: `file:/path` or `env:VAR` (one key per line, optionally a label)."""
    gateway_metrics_keys_source: str | None = None
    """Keys of the gateway's `/metrics` and `/stats` only (Prometheus' scrape key), like `gateway_keys_source`; none may be a client key, none opens `/v1`; unset: both answer 401 to every request."""
    gateway_tls_cert_file: str | None = None
    """PEM on the controller (certificate chain, then its unencrypted key): HTTPS on both gateway ports; unset: plain HTTP."""
    gateway_queue_timeout_s: int = Field(60, ge=1, le=3600)
    """How long a request waits at the gateway for a free engine slot before a 503 with Retry-After."""
    gateway_queue_max: int = Field(64, ge=1, le=100000)
    """Requests the gateway holds while every engine slot is busy; one more gets a 503 with Retry-After at once."""
    gateway_prefix_affinity_bytes: int = Field(0, ge=0, le=4096)
    """Requests without X-Session-Id keep a host by the first N bytes of their body (model, system prompt), like a session; 0: off."""

    # --- Wake-on-LAN (docs/waking.md) ---
    wake_on_lan_mac: str | None = None
    """The workstation's network card (`aa:bb:cc:dd:ee:ff`): the gateway's waker may wake it when the queue builds; unset: never woken."""
    wake_on_lan_broadcast: IPv4Address = IPv4Address("255.255.255.255")
    """(gateway) Where the waker sends magic packets (UDP port 9): the LAN's broadcast address."""
    wake_on_lan_queue_s: float = Field(3.0, ge=0.5, le=3600)
    """(gateway) Seconds requests must have been queued at the gateway before the waker wakes a sleeping host."""
    wake_on_lan_cooldown_s: int = Field(600, ge=10, le=86400)
    """(gateway) A host woken is not woken again for this long; one host boots at a time."""

    # --- alerts: Prometheus and Alertmanager on the gateway host (docs/alerts.md) ---
    alerting_enabled: bool = False
    """(gateway) Install Debian's Prometheus and Alertmanager on the gateway host with the fleet's scrape config and alert rules (needs gateway_metrics_keys_source); false: the rules are only written beside the scrape config."""
    alert_evaluation_interval_s: int = Field(15, ge=1, le=300)
    """(gateway) Seconds between Prometheus' scrapes and between its evaluations of the alert rules."""
    alert_host_down_for_s: int = Field(300, ge=0, le=86400)
    """(gateway) A host whose node_exporter stays unreachable this long, and that its owner had not yielded, raises FreetokenHostDown."""
    alert_out_of_service_for_s: int = Field(900, ge=0, le=86400)
    """(gateway) A powered host that HAProxy keeps DOWN this long while its owner has not claimed it raises FreetokenHostOutOfService."""
    alert_queue_for_s: int = Field(300, ge=0, le=86400)
    """(gateway) Requests queued at the gateway for this long without a break raise FreetokenQueueBuilding."""
    alert_agent_silent_s: int = Field(120, ge=10, le=86400)
    """(gateway) A host agent whose last decision loop is older than this (or that writes nothing while node_exporter answers) raises FreetokenAgentSilent."""
    alert_yield_memory_s: int = Field(259200, ge=60, le=2678400)
    """(gateway) How long a host's last mode is remembered: a host that went away yielded, snoozed or off schedule raises no alert for this long."""
    alert_webhook_url: AnyHttpUrl | None = None
    """(gateway) Alertmanager posts every alert (and its resolution) to this URL (Alertmanager's webhook JSON); masked in diffs."""
    alert_email_to: list[str] = Field(default_factory=list, max_length=32)
    """(gateway) Alertmanager mails every alert (and its resolution) to these addresses."""
    alert_email_from: str | None = None
    """(gateway) The From: of the alert mails (needed with alert_email_to)."""
    alert_email_smarthost: str | None = None
    """(gateway) The mail server Alertmanager sends through, `host:port` (STARTTLS required)."""
    alert_email_username: str | None = None
    """(gateway) The login at the smarthost; unset: alert_email_from."""
    alert_email_password_source: str | None = None
    """(gateway) The smarthost's password on the controller, `file:/path` or `env:VAR`; written root-only (group prometheus) on the gateway, never into the config."""

    # --- validators ---------------------------------------------------------------
    @field_validator("alert_email_to")
    @classmethod
    def _alert_email_to(cls, v: list[str]) -> list[str]:
        for address in v:
            if not isinstance(address, str) or not _EMAIL_RE.fullmatch(address):
                raise ValueError(f"{_short(address)} is not a mail address such as ops@example.org")
        return v

    @field_validator("alert_email_from")
    @classmethod
    def _alert_email_from(cls, v: str | None) -> str | None:
        if v is not None and not _EMAIL_RE.fullmatch(v):
            raise ValueError("must be a mail address such as alerts@example.org")
        return v

    @field_validator("alert_email_username")
    @classmethod
    def _alert_email_username(cls, v: str | None) -> str | None:
        if v is not None and not _EMAIL_RE.fullmatch(v) and not _NAME_RE.fullmatch(v):
            raise ValueError("must be a login: a mail address such as alerts@example.org, or a plain name")
        return v

    @field_validator("alert_email_smarthost")
    @classmethod
    def _alert_smarthost(cls, v: str | None) -> str | None:
        if v is not None:
            m = _SMARTHOST_RE.fullmatch(v)
            if m is None or not 1 <= int(m.group(1)) <= 65535:
                raise ValueError("must be the mail server as host:port, e.g. smtp.example.org:587")
        return v

    @field_validator("alert_email_password_source")
    @classmethod
    def _alert_password(cls, v: str | None) -> str | None:
        if v is None or re.fullmatch(r"file:/[^\0\n]*|env:[A-Za-z_][A-Za-z0-9_]*", v):
            return v
        raise ValueError("must be 'file:/path/on/controller' or 'env:VARIABLE' (the password, one line)")

    @model_validator(mode="after")
    def _alert_email_complete(self) -> Settings:
        # Mail needs its three parts; a password without a server to give it to is a mistake.
        email = (self.alert_email_from, self.alert_email_smarthost, self.alert_email_password_source)
        if not self.alert_email_to and all(v is None for v in email) and self.alert_email_username is None:
            return self
        needed = {
            "alert_email_to": "a mail address to send alerts to",
            "alert_email_from": "the From: address of the alert mails",
            "alert_email_smarthost": "the mail server, host:port",
        }
        for field, what in needed.items():
            if not getattr(self, field):
                raise ValidationError.from_exception_data(
                    type(self).__name__,
                    [
                        InitErrorDetails(
                            type=PydanticCustomError(
                                "value_error", f"unset while other alert_email_* settings are set: give {what}"
                            ),
                            loc=(field,),
                            input=getattr(self, field),
                        )
                    ],
                )
        return self

    @field_validator("wake_on_lan_mac")
    @classmethod
    def _wake_on_lan_mac(cls, v: str | None) -> str | None:
        return None if v is None else wol.parse_mac(v)

    @field_validator("owner_apps")
    @classmethod
    def _owner_apps(cls, v: list[str]) -> list[str]:
        for name in v:
            if not owner.app_name_ok(name):
                raise ValueError(
                    f"{name!r} is not a Windows image name: a file name ending in .exe (letters, digits, "
                    "space, . _ + ( ) & ' -; no path), e.g. eldenring.exe"
                )
        return v

    @field_validator("serve_hours")
    @classmethod
    def _serve_hours(cls, v: str | None) -> str | None:
        if v is not None:
            owner.parse_hours(v)  # its ValueError names the part and the syntax
        return v

    @field_validator("engine_version")
    @classmethod
    def _engine_version(cls, v: str) -> str:
        if not _PEP440_RE.fullmatch(v):
            raise ValueError("must be a release version such as '0.2.1'")
        return v

    @field_validator("engine_package")
    @classmethod
    def _engine_package(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError("must be a Python package name such as 'freetoken'")
        return v

    @field_validator("engine_extras")
    @classmethod
    def _extras(cls, v: list[str]) -> list[str]:
        for extra in v:
            if not isinstance(extra, str) or not _NAME_RE.fullmatch(extra):
                raise ValueError(f"extra {extra!r} is not a valid name (e.g. 'accel')")
        return v

    @field_validator("model_repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not _REPO_ID_RE.fullmatch(v):
            raise ValueError("must be a hub repository id 'owner/name'")
        return v

    @field_validator("model_revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not _REVISION_RE.fullmatch(v) or ".." in v:
            raise ValueError("must be a branch, tag or commit sha (letters, digits, '._-/')")
        return v

    @field_validator("engine_base_dir", "model_dir", "cuda_home", "state_dir", "config_dir", "cache_dir")
    @classmethod
    def _paths(cls, v: str) -> str:
        return _abs_path(v)

    @field_validator("hub_token_file")
    @classmethod
    def _token_file(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v, "an absolute path on the target")

    @field_validator("model_cache_host")
    @classmethod
    def _cache_host(cls, v: str | None) -> str | None:
        # An inventory name; it may become the host part of the cache's URL.
        if v is not None and not _HOST_NAME_RE.fullmatch(v):
            raise ValueError("must be the inventory name of a host (letters, digits, '._-@:')")
        return v

    @field_validator("hardware_profile")
    @classmethod
    def _profile(cls, v: str) -> str:
        if v != "auto" and v not in HARDWARE_PROFILES:
            allowed = ", ".join(["auto", *sorted(HARDWARE_PROFILES)])
            raise ValueError(f"unknown hardware profile; allowed: {allowed}")
        return v

    @field_validator("launch_moe_cache_size")
    @classmethod
    def _cache_size(cls, v: str | int | None) -> str | int | None:
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive number of experts or 'auto'")
        return v

    @field_validator("launch_moe_cpu_layers")
    @classmethod
    def _cpu_layers(cls, v: str | None) -> str | None:
        # FreeToken accepts layer ids, a count, a fraction or 'auto'.
        if v is not None and not re.fullmatch(r"auto|[0-9]+(\.[0-9]+)?|[0-9]+(,[0-9]+)+", v):
            raise ValueError("must be 'auto', a count, a fraction or comma-separated layer ids")
        return v

    @field_validator("api_key_source")
    @classmethod
    def _key_source(cls, v: str) -> str:
        if v in ("none", "generate"):
            return v
        kind, _, ref = v.partition(":")
        if kind == "file":
            try:
                return f"file:{_abs_path(ref)}"
            except ValueError:
                pass
        if kind == "env" and _ENV_VAR_RE.fullmatch(ref):
            return v
        raise ValueError(
            "must be 'generate' (a key made on the host), 'none', "
            "'file:/path/on/controller' or 'env:VARIABLE' (on the controller)"
        )

    @field_validator("gateway_keys_source", "gateway_metrics_keys_source")
    @classmethod
    def _gateway_keys(cls, v: str | None) -> str | None:
        # fullmatch: `$` also accepted a trailing newline.
        if v is None or re.fullmatch(r"file:/[^\0\n]*|env:[A-Za-z_][A-Za-z0-9_]*", v):
            return v
        raise ValueError("must be 'file:/path/on/controller' or 'env:VARIABLE' (one key per line)")

    @field_validator("firewall_engine_from", "firewall_metrics_from", mode="before")
    @classmethod
    def _address_list(cls, v: Any) -> Any:
        # `--data firewall_metrics_from=192.0.2.9,192.0.2.0/28` as well as a list.
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("gateway_tls_cert_file")
    @classmethod
    def _tls_cert_file(cls, v: str | None) -> str | None:
        return None if v is None else _abs_path(v)

    @field_validator("wslconfig_memory", "wslconfig_swap")
    @classmethod
    def _size(cls, v: str) -> str:
        if not _SIZE_RE.fullmatch(v):
            raise ValueError("must be a positive size such as '24GB' or '512MB'")
        return v

    @field_validator("wsl_min_version")
    @classmethod
    def _wsl_floor(cls, v: str) -> str:
        if not _VERSION_RE.fullmatch(v):
            raise ValueError("must be a dotted version such as '2.7.13'")
        return v

    @field_validator("cuda_packages")
    @classmethod
    def _cuda_packages(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one package")
        for name in v:
            if not _PACKAGE_RE.fullmatch(name):
                raise ValueError(f"{name!r} is not a Debian package name")
            if DRIVER_PACKAGE_RE.fullmatch(name):
                raise ValueError(f"{name!r} pulls in a Linux NVIDIA driver, which must never be installed inside WSL")
        return v

    @field_validator("service_user", "fetch_user", "cache_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER_RE.fullmatch(v) or v == "root":
            raise ValueError("must be a non-root system user name such as 'freetoken'")
        return v

    @model_validator(mode="after")
    def _trust_layout(self) -> Settings:
        # Checks across fields, each reported on the field to change (one line naming it).
        problem = layout_problem(self)
        if problem is not None:
            field, message = problem
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("value_error", message),
                        loc=(field,),
                        input=getattr(self, field),
                    )
                ],
            )
        return self

    @model_validator(mode="after")
    def _agent_port_free(self) -> Settings:
        taken = {self.listen_port: "listen_port", self.listen_port + 1: "the engine's port+1 (gloo)"}
        if self.node_exporter_enabled:
            taken[self.node_exporter_port] = "node_exporter_port"
        if self.agent_enabled and self.agent_port in taken:
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError(
                            "value_error", f"{self.agent_port} is taken by {taken[self.agent_port]}: pick another port"
                        ),
                        loc=("agent_port",),
                        input=self.agent_port,
                    )
                ],
            )
        return self

    @field_validator("model_expert_ram_gb")
    @classmethod
    def _experts_within_model(cls, v: float, info: ValidationInfo) -> float:
        # A check across two fields, made on the second so the error names a field and its value
        # (model_size_gb is declared first; absent here when it failed its own check).
        size = info.data.get("model_size_gb")
        if size is not None and v > size:
            raise ValueError(f"cannot exceed model_size_gb ({size:g}): the experts are part of the model")
        return v

    # --- derived values ---------------------------------------------------------
    @property
    def served_model_name(self) -> str:
        return self.model_dir.rstrip("/").rsplit("/", 1)[-1]

    @property
    def engine_requirement(self) -> str:
        extras = f"[{','.join(self.engine_extras)}]" if self.engine_extras else ""
        return f"{self.engine_package}{extras}=={self.engine_version}"

    @property
    def wsl_floor_tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.wsl_min_version.split("."))

    def wslconfig_values(self) -> dict[str, str]:
        """The `[wsl2]` keys we manage, in .wslconfig's spelling."""
        values = {
            "memory": self.wslconfig_memory,
            "processors": str(self.wslconfig_processors),
            "swap": self.wslconfig_swap,
            "localhostForwarding": "true" if self.wslconfig_localhost_forwarding else "false",
            "vmIdleTimeout": str(self.wslconfig_vm_idle_timeout),
        }
        if self.wslconfig_networking_mode:
            values["networkingMode"] = self.wslconfig_networking_mode
        return values


def _inside(path: str, tree: str) -> bool:
    """``path`` is ``tree`` or below it (both normalised by ``_abs_path``)."""
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def layout_problem(s: Settings) -> tuple[str, str] | None:
    """The first (field, message) that breaks the trust layout (docs/security.md), or
    None. Root creates and re-owns the folders the settings name; it must never do so inside a
    tree a less-trusted user writes (the engine's ``cache_dir``, the download's ``model_dir``),
    where that user could swap a folder for a link between root's look and root's act."""
    if s.fetch_user == s.service_user:
        return "fetch_user", "must differ from service_user: the engine must not be able to write the model it serves"
    if s.cache_user in (s.service_user, s.fetch_user):
        return "cache_user", "must differ from service_user and fetch_user: neither may signal the LAN cache's workers"
    user_trees = {
        "cache_dir": (s.cache_dir, "the engine's user"),
        "model_dir": (s.model_dir, "the download's user"),
    }
    roots = {
        "model_dir": s.model_dir,
        "cache_dir": s.cache_dir,
        "state_dir": s.state_dir,
        "config_dir": s.config_dir,
        "engine_base_dir": s.engine_base_dir,
        "cuda_home": s.cuda_home,
        **({"hub_token_file": s.hub_token_file} if s.hub_token_file else {}),
    }
    for field, path in roots.items():
        for tree_field, (tree, who) in user_trees.items():
            if tree_field != field and _inside(path, tree):
                return field, (
                    f"is inside {tree_field} ({tree}), which {who} writes: root would create and own "
                    f"folders where that user can swap them for links; choose a path outside it"
                )
    status_dir = f"{s.state_dir}/model-fetch"
    for field in ("model_dir", "cache_dir"):
        path = roots[field]
        if _inside(path, status_dir) or _inside(s.state_dir, path):
            return field, (
                f"overlaps state_dir ({s.state_dir}): it must be outside state_dir/model-fetch and "
                "must not contain state_dir"
            )
    return None


# Keys pyinfra itself reads from host data: connector settings and global
# operation arguments. They are not ours to validate.
def _pyinfra_keys() -> frozenset[str]:
    from freetoken_infra.core.pyinfra_internals import connector_data_keys

    return connector_data_keys()


class SettingsError(Exception):
    """Raised with every problem of every host, before anything is changed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} invalid setting(s); nothing was changed:\n  " + "\n  ".join(problems))


def _short(value: Any, key: str = "") -> str:
    """A value as an error line shows it: never a secret (a password in a URL, a Bearer token, or
    anything under an unknown secret-like ``key`` such as a mistyped ``hub_token``; our own
    settings hold no secret themselves, only where one is)."""
    if key and redact.SECRET_NAME.search(key):
        return redact.MASK
    text = redact.mask_text(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


def build_settings(host_name: str, data: dict[str, Any]) -> Settings:
    """Validate one host's data; raise SettingsError naming host and field."""
    known = set(Settings.model_fields)
    pyinfra_keys = _pyinfra_keys()
    ours: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        if key.startswith("_") or key in pyinfra_keys:
            continue
        if key not in known:
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else "; see group_data/all.py for the settings"
            problems.append(f"host {host_name}: unknown setting '{key}' = {_short(value, key)}{hint}")
            continue
        ours[key] = value
    try:
        settings = Settings(**ours)
    except ValidationError as exc:
        # One line per field; a union (e.g. 'auto' or a number) reports each
        # alternative separately, so their messages are joined.
        by_field: dict[str, tuple[Any, list[str]]] = {}
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if not err["loc"]:
                # Every check is made on a field (so its error names it); this only guards a
                # future whole-model check from printing every setting as its "value".
                problems.append(f"host {host_name}: settings are invalid: {msg}")
                continue
            field = str(err["loc"][0])
            bad, msgs = by_field.setdefault(field, (err.get("input"), []))
            if msg not in msgs:
                msgs.append(msg)
        for field, (bad, msgs) in by_field.items():
            problems.append(f"host {host_name}: setting '{field}' = {_short(bad)} is invalid: {' / '.join(msgs)}")
        raise SettingsError(problems) from None
    if problems:
        raise SettingsError(problems)
    return settings


def settings_for(host: Host) -> Settings:
    """Settings of a pyinfra host."""
    return build_settings(host.name, host.data.dict())  # type: ignore[no-untyped-call]


def natural_key(name: str) -> list[int | str]:
    """Sort key of host names in the order a person reads them: ws2 before ws10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class ControllerSourceError(Exception):
    """A ``file:`` / ``env:`` source that gives nothing on the controller; the message says why
    (never the value)."""


def read_controller_source(source: str) -> str:
    """The text a ``file:/path`` or ``env:VARIABLE`` setting names on the controller (an API key,
    the gateway's client keys): the one reader of such settings."""
    kind, _, ref = source.partition(":")
    if kind == "file":
        try:
            with open(ref, encoding="utf-8") as handle:
                return handle.read()
        except FileNotFoundError:
            raise ControllerSourceError("the file does not exist on the controller") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise ControllerSourceError(f"the file cannot be read on the controller ({reason})") from None
    if kind == "env":
        if ref not in os.environ:
            raise ControllerSourceError(f"the variable {ref} is not set on the controller")
        return os.environ[ref]
    raise ControllerSourceError("expected file:/path or env:VARIABLE")


def controller_key(source: str) -> str:
    """The one-line key ``source`` (``file:`` / ``env:``) gives on the controller."""
    key = read_controller_source(source).strip()
    if not key or "\n" in key:
        raise ControllerSourceError("it gives an empty or multi-line key")
    return key


def controller_key_problem(source: str) -> str | None:
    """What is wrong with the API key ``api_key_source`` names on the controller, or None when
    it gives a usable key (``generate`` and ``none`` need nothing here). The key itself is never
    part of the answer."""
    if source.partition(":")[0] not in ("file", "env"):
        return None
    try:
        controller_key(source)
    except ControllerSourceError as exc:
        return str(exc)
    return None


def validate_inventory(inventory: Inventory) -> dict[str, Settings]:
    """Validate every host of an inventory; raise one SettingsError listing all problems.
    Also checks what the settings name on the controller (the API key's file or variable)."""
    result: dict[str, Settings] = {}
    problems: list[str] = []
    names = {host.name for host in inventory}
    for host in inventory:
        try:
            result[host.name] = settings_for(host)
        except SettingsError as exc:
            problems.extend(exc.problems)
            continue
        source = result[host.name].api_key_source
        key_problem = controller_key_problem(source)
        if key_problem:
            problems.append(f"host {host.name}: setting 'api_key_source' = {_short(source)} is invalid: {key_problem}")
        cache = result[host.name].model_cache_host
        if cache is not None and cache not in names:
            problems.append(
                f"host {host.name}: setting 'model_cache_host' = {_short(cache)} is invalid: "
                f"not a host of this inventory (hosts: {', '.join(sorted(names))})"
            )
    if problems:
        raise SettingsError(problems)
    return result


class InventoryError(Exception):
    """An inventory file that did not load, or whose settings are invalid; the message says why."""


def load_inventory_settings(path: str, data: dict[str, Any] | None = None) -> tuple[Inventory, dict[str, Settings]]:
    """The inventory file ``path`` as the pyinfra CLI loads it (``data`` as its ``--data``) and
    every host's settings (``validate_inventory``), for the CLIs that read an inventory without
    running a deploy (the rollout, the fleet); InventoryError naming the file, or the host and
    field, otherwise."""
    from freetoken_infra.core.pyinfra_internals import InventoryLoadError, load_inventory

    try:
        inventory = load_inventory(path, data)
    except InventoryLoadError as exc:
        raise InventoryError(f"{path}: {exc}") from None
    try:
        return inventory, validate_inventory(inventory)
    except SettingsError as exc:
        raise InventoryError(str(exc)) from None


# --------------------------------------------------------------------------- the settings table
# The README's settings table is made from the defaults and descriptions above; a unit test
# checks that it is current. `python -m freetoken_infra.core.settings` rewrites it.
README_TABLE_START = "<!-- settings table: made by `python -m freetoken_infra.core.settings`; do not edit -->"
README_TABLE_END = "<!-- end of settings table -->"


def _cell(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return ", ".join(f"`{v}`" for v in value) if value else "none"
    return f"`{value}`"


def settings_table() -> str:
    """Markdown: one row per setting with its default and its description."""
    rows = ["| setting | default | what it is |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        description = (field.description or "").replace("|", "\\|")
        cell = _cell(default).replace("|", "\\|")
        rows.append(f"| `{name}` | {cell} | {description} |")
    return "\n".join(rows)


def readme_with_table(readme: str) -> str:
    """`readme` with the text between the table markers replaced by the current table."""
    head, start, rest = readme.partition(README_TABLE_START)
    _, end, tail = rest.partition(README_TABLE_END)
    if not start or not end:
        raise ValueError("README.md lacks the settings table markers")
    return f"{head}{start}\n{settings_table()}\n{end}{tail}"


if __name__ == "__main__":
    from pathlib import Path

    readme_path = Path(__file__).resolve().parents[2] / "README.md"
    readme_path.write_text(readme_with_table(readme_path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"rewrote the settings table in {readme_path}")
