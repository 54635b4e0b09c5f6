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
import re
from typing import Any, Literal, Optional, Union

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyAddress,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from freetoken_infra.hardware import HARDWARE_PROFILES

# Pitfall 4 (A and B): below this WSL release, processes started from a wsl.exe
# session are reaped and WDDM locks usable GPU memory at 0 (fake OOMs). The field
# report's fix was WSL 2.7.13; CUDA graph capture on Blackwell also crashed before
# 2.7.0 (vllm#37242).
WSL_VERSION_FLOOR = "2.7.13"

# NVIDIA's CUDA repository for Ubuntu 24.04 (field report, pitfall 3). The keyring
# package 1.0-1 answers 404 there; 1.1-1 is the current one.
NVIDIA_CUDA_REPO = "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2404/x86_64/"
NVIDIA_CUDA_KEYRING = NVIDIA_CUDA_REPO + "cuda-keyring_1.1-1_all.deb"

_SIZE_RE = re.compile(r"^[1-9][0-9]*(MB|GB|TB)$")
_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+){1,3}$")
_PEP440_RE = re.compile(r"^[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?$")
_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_ABS_PATH_RE = re.compile(r"^/[^\0\n]*$")
# wsl2-gpu.md: inside WSL the Windows driver is the driver; these packages would
# install a Linux one (`cuda` and `cuda-X-Y` depend on cuda-drivers). The same globs
# become the deploy's apt pin (priority -1) and the settings check below.
# Named one by one rather than `nvidia-*`, which would also block tools a WSL user may
# want (nvidia-container-toolkit); cuda-compat-* is the driver's user-mode part.
DRIVER_PACKAGE_GLOBS = (
    "cuda", "cuda-[0-9]*-[0-9]*", "cuda-drivers*", "cuda-compat*", "nvidia-driver*",
    "nvidia-open*", "nvidia-dkms-*", "nvidia-kernel-*", "nvidia-utils-*",
    "nvidia-compute-utils-*", "nvidia-headless-*", "nvidia-firmware-*", "nvidia-modprobe",
    "nvidia-persistenced", "nvidia-settings", "nvidia-fabricmanager*", "nvidia-imex*",
    "nvidia-fs*", "nvidia-gds*", "libnvidia-*", "xserver-xorg-video-nvidia-*",
    "linux-modules-nvidia-*", "linux-objects-nvidia-*", "linux-signatures-nvidia-*",
)
DRIVER_PACKAGE_RE = re.compile("|".join(fnmatch.translate(g) for g in DRIVER_PACKAGE_GLOBS))


def _abs_path(value: str, what: str = "an absolute path") -> str:
    if not _ABS_PATH_RE.match(value) or "/../" in value + "/":
        raise ValueError(f"must be {what} (starting with '/', no '..')")
    return value.rstrip("/") or "/"


class Settings(BaseModel):
    """One host's settings. Defaults are the field report's working values."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- engine -------------------------------------------------------------
    engine_package: str = "freetoken"
    engine_version: str = "0.2.1"
    engine_extras: list[str] = Field(default_factory=lambda: ["accel"])
    engine_base_dir: str = "/opt/freetoken"
    pip_index_url: Optional[AnyHttpUrl] = None
    pip_extra_index_urls: list[AnyHttpUrl] = Field(default_factory=list)

    # --- model --------------------------------------------------------------
    model_repo: str = "nvidia/Qwen3.6-35B-A3B-NVFP4"
    model_revision: str = "main"
    # The served model name is this directory's last component (field report).
    model_dir: str = "/var/lib/freetoken/models/Qwen3.6-35B-A3B-NVFP4-nvidia"
    model_size_gb: float = Field(22.0, gt=0)
    model_expert_ram_gb: float = Field(16.9, gt=0)
    hub_endpoint: AnyHttpUrl = AnyHttpUrl("https://huggingface.co")
    hub_disable_xet: bool = True  # pitfall 2: the Xet protocol answered 401
    hub_token_file: Optional[str] = None
    # The LAN model cache (upstream read once per fleet): the inventory name of the host that
    # serves its verified model to the others on model_cache_port; every other host fetches
    # from it first. model_sources: further caches (e.g. one the controller runs), tried next.
    model_cache_host: Optional[str] = None
    model_cache_port: int = Field(8090, ge=1, le=65535)
    model_sources: list[AnyHttpUrl] = Field(default_factory=list)
    # One-shot: re-hash every model file this run, trusting no manifest entry
    # (`pyinfra ... --data model_reverify=true`). Normally size and mtime suffice.
    model_reverify: bool = False

    # --- launch plan (None = derived from the hardware profile) ---------------
    hardware_profile: str = "auto"
    launch_moe_strategy: Optional[Literal["auto", "fused", "offload", "cpu", "hybrid"]] = None
    launch_moe_cache_size: Optional[Union[Literal["auto"], int]] = None
    launch_num_tokens: Optional[int] = Field(None, gt=0)
    launch_kv_reserve_tokens: Optional[int] = Field(None, gt=0)
    launch_max_prefill_length: Optional[int] = Field(None, gt=0)
    launch_max_running_requests: Optional[int] = Field(None, ge=1, le=64)
    launch_moe_cpu_layers: Optional[str] = None
    launch_attention_backend: Optional[
        Literal["auto", "triton", "trtllm", "fi", "fa"]
    ] = None
    launch_memory_ratio: Optional[float] = Field(None, gt=0, le=1)
    listen_host: IPvAnyAddress = IPvAnyAddress("127.0.0.1")  # type: ignore[operator]
    # The engine also binds port+1 (gloo), hence the upper bound.
    listen_port: int = Field(8000, ge=1, le=65534)
    api_key_source: str = "generate"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # --- Windows side ---------------------------------------------------------
    wslconfig_memory: str = "24GB"
    wslconfig_processors: int = Field(8, ge=1, le=256)
    wslconfig_swap: str = "4GB"
    wslconfig_localhost_forwarding: bool = True
    # Milliseconds; 0 keeps the VM up (pitfall 4A: the 60 s default reaps the engine).
    wslconfig_vm_idle_timeout: int = Field(0, ge=-1)
    wslconfig_networking_mode: Optional[Literal["nat", "mirrored"]] = None
    wsl_min_version: str = WSL_VERSION_FLOOR
    windows_autostart: bool = False

    # --- CUDA toolchain ---------------------------------------------------------
    cuda_repo_url: AnyHttpUrl = AnyHttpUrl(NVIDIA_CUDA_REPO)
    cuda_keyring_url: AnyHttpUrl = AnyHttpUrl(NVIDIA_CUDA_KEYRING)
    cuda_packages: list[str] = Field(
        default_factory=lambda: ["cuda-nvcc-13-0", "cuda-cudart-dev-13-0", "cuda-cccl-13-0"]
    )
    cuda_home: str = "/usr/local/cuda-13.0"

    # --- service, paths, guard, thresholds -------------------------------------
    service_user: str = "freetoken"
    state_dir: str = "/var/lib/freetoken"
    config_dir: str = "/etc/freetoken"
    cache_dir: str = "/var/cache/freetoken"
    start_timeout_s: int = Field(300, ge=30, le=3600)
    health_timeout_s: int = Field(600, ge=10, le=7200)
    host_lock_timeout_s: int = Field(600, ge=0, le=86400)  # how long a run waits for another run's host lock
    decode_floor_tps: Optional[float] = Field(None, gt=0)
    guard_enabled: bool = True
    guard_interval_s: int = Field(30, ge=5, le=3600)
    guard_swap_limit_gb: float = Field(2.0, gt=0)
    ram_margin_gb: float = Field(3.0, ge=0)
    disk_margin_gb: float = Field(5.0, ge=0)
    engine_env_size_gb: float = Field(12.0, ge=0)

    # --- validators ---------------------------------------------------------------
    @field_validator("engine_version")
    @classmethod
    def _engine_version(cls, v: str) -> str:
        if not _PEP440_RE.match(v):
            raise ValueError("must be a release version such as '0.2.1'")
        return v

    @field_validator("engine_package")
    @classmethod
    def _engine_package(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", v):
            raise ValueError("must be a Python package name such as 'freetoken'")
        return v

    @field_validator("engine_extras")
    @classmethod
    def _extras(cls, v: list[str]) -> list[str]:
        for extra in v:
            if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", extra):
                raise ValueError(f"extra {extra!r} is not a valid name (e.g. 'accel')")
        return v

    @field_validator("model_repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        if not _REPO_ID_RE.match(v):
            raise ValueError("must be a hub repository id 'owner/name'")
        return v

    @field_validator("model_revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not v or any(c in v for c in " \n\t?#") or ".." in v:
            raise ValueError("must be a branch, tag or commit sha")
        return v

    @field_validator(
        "engine_base_dir", "model_dir", "cuda_home", "state_dir", "config_dir", "cache_dir"
    )
    @classmethod
    def _paths(cls, v: str) -> str:
        return _abs_path(v)

    @field_validator("hub_token_file")
    @classmethod
    def _token_file(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else _abs_path(v, "an absolute path on the target")

    @field_validator("hardware_profile")
    @classmethod
    def _profile(cls, v: str) -> str:
        if v != "auto" and v not in HARDWARE_PROFILES:
            allowed = ", ".join(["auto", *sorted(HARDWARE_PROFILES)])
            raise ValueError(f"unknown hardware profile; allowed: {allowed}")
        return v

    @field_validator("launch_moe_cache_size")
    @classmethod
    def _cache_size(cls, v):
        if isinstance(v, int) and v <= 0:
            raise ValueError("must be a positive number of experts or 'auto'")
        return v

    @field_validator("launch_moe_cpu_layers")
    @classmethod
    def _cpu_layers(cls, v: Optional[str]) -> Optional[str]:
        # FreeToken accepts layer ids, a count, a fraction or 'auto'.
        if v is not None and not re.match(r"^(auto|[0-9]+(\.[0-9]+)?|[0-9]+(,[0-9]+)+)$", v):
            raise ValueError("must be 'auto', a count, a fraction or comma-separated layer ids")
        return v

    @field_validator("api_key_source")
    @classmethod
    def _key_source(cls, v: str) -> str:
        if v in ("none", "generate"):
            return v
        kind, _, ref = v.partition(":")
        if kind == "file" and ref.startswith("/"):
            return v
        if kind == "env" and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", ref):
            return v
        raise ValueError(
            "must be 'generate' (a key made on the host), 'none', "
            "'file:/path/on/controller' or 'env:VARIABLE' (on the controller)"
        )

    @field_validator("wslconfig_memory", "wslconfig_swap")
    @classmethod
    def _size(cls, v: str) -> str:
        if not _SIZE_RE.match(v):
            raise ValueError("must be a positive size such as '24GB' or '512MB'")
        return v

    @field_validator("wsl_min_version")
    @classmethod
    def _wsl_floor(cls, v: str) -> str:
        if not _VERSION_RE.match(v):
            raise ValueError("must be a dotted version such as '2.7.13'")
        return v

    @field_validator("cuda_packages")
    @classmethod
    def _cuda_packages(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("must name at least one package")
        for name in v:
            if not _PACKAGE_RE.match(name):
                raise ValueError(f"{name!r} is not a Debian package name")
            if DRIVER_PACKAGE_RE.match(name):
                raise ValueError(
                    f"{name!r} pulls in a Linux NVIDIA driver, which must never be installed inside WSL"
                )
        return v

    @field_validator("service_user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER_RE.match(v) or v == "root":
            raise ValueError("must be a non-root system user name such as 'freetoken'")
        return v

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
    def engine_venv(self) -> str:
        return f"{self.engine_base_dir}/{self.engine_version}"

    @property
    def engine_active_link(self) -> str:
        return f"{self.engine_base_dir}/active"

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


# Keys pyinfra itself reads from host data: connector settings and global
# operation arguments. They are not ours to validate.
def _pyinfra_keys() -> set[str]:
    from pyinfra.api.connectors import get_all_connectors

    keys: set[str] = set()
    for connector in get_all_connectors().values():
        keys.update(getattr(connector, "data_meta", {}) or {})
    return keys


class SettingsError(Exception):
    """Raised with every problem of every host, before anything is changed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"{len(problems)} invalid setting(s); nothing was changed:\n  "
            + "\n  ".join(problems)
        )


def _short(value: Any) -> str:
    text = repr(value)
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
            problems.append(f"host {host_name}: unknown setting '{key}' = {_short(value)}{hint}")
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
            problems.append(
                f"host {host_name}: setting '{field}' = {_short(bad)} is invalid: {' / '.join(msgs)}"
            )
        raise SettingsError(problems) from None
    if problems:
        raise SettingsError(problems)
    return settings


def settings_for(host) -> Settings:
    """Settings of a pyinfra host."""
    return build_settings(host.name, host.data.dict())


def validate_inventory(inventory) -> dict[str, Settings]:
    """Validate every host of an inventory; raise one SettingsError listing all problems."""
    result: dict[str, Settings] = {}
    problems: list[str] = []
    names = {host.name for host in inventory}
    for host in inventory:
        try:
            result[host.name] = settings_for(host)
        except SettingsError as exc:
            problems.extend(exc.problems)
            continue
        cache = result[host.name].model_cache_host
        if cache is not None and cache not in names:
            problems.append(f"host {host.name}: setting 'model_cache_host' = {_short(cache)} is invalid: "
                            f"not a host of this inventory (hosts: {', '.join(sorted(names))})")
    if problems:
        raise SettingsError(problems)
    return result
