"""Preflight rules: the field report's knowledge as pure functions.

Settings + Observations -> Findings. Nothing here touches a host; every rule is a
plain function over plain values, so "why was ws3 refused" is answered by reading
this module (and tested in tests/unit/test_rules.py).

A finding's status:
- pass:  nothing to do;
- warn:  the deploy fixes it, or it does not stop serving (the remedy says which);
- block: the deploy must not change this host until a person acts on the remedy.
`deploy_fixes` marks blockers whose remedy is the deploy's own Windows-side step
(wsl.conf's systemd switch): the deploy applies it, says "restart required", and
stops there. `standing` marks blockers decided by answers that change only with a boot of
the WSL VM (facts/inputs.py, BOOT_ONLY: the kernel, WSL's version, the GPU's architecture):
while the boot, the settings and the code are the same, the host stays refused, so a re-run
may answer it from its record (docs/fast-check.md) instead of reading every
fact again. Memory, disk or a card held by an app are never standing: they change at any time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from facts.cuda import CudaToolchainInfo
from facts.engine import EngineHealthInfo, EngineInstallInfo
from facts.gpu import GpuInfo, GpuReport
from facts.gpu_memory import GpuMemoryProbeResult
from facts.init import InitInfo
from facts.model import ModelDirInfo
from facts.resources import ResourcesInfo
from facts.wake_on_lan import WakeOnLanInfo
from facts.windows import IniFileInfo, WindowsProfileInfo
from facts.wsl import InteropBinfmt, InteropProbe, WslKernelInfo, WslVersionInfo
from freetoken_infra.core import gpu_room, owner, wsl_ini
from freetoken_infra.core.gate_record import GateResult
from freetoken_infra.core.hardware import HARDWARE_PROFILES, nominal_vram_gb
from freetoken_infra.core.launch import (
    LaunchPlan,
    derive_plan,
    estimated_vram_gb,
    usable_vram_gb,
)
from freetoken_infra.core.layout import INTEROP_BINFMT_CONF, RESTART_MESSAGE, SYSTEMD_BINFMT
from freetoken_infra.core.quant import QuantSummary, unsupported_expert_schemes
from freetoken_infra.core.settings import Settings
from freetoken_infra.core.text import printable

Status = Literal["pass", "warn", "block"]

GiB = 1024**3
GB = 1000**3
MIN_COMPUTE = (8, 0)  # docs/engine.md: Ampere or newer
REQUIRED_NVCC_MAJOR = 13  # docs/engine.md: nvcc's major must equal torch's CUDA major
SYSTEMD_ON = {"systemd": "true"}  # /etc/wsl.conf [boot]: systemd as PID 1 (the engine is a unit)
RESTART_REMEDY = f"{RESTART_MESSAGE}, then re-run the deploy"


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    evidence: str
    remedy: str = ""
    deploy_fixes: bool = False
    standing: bool = False  # a blocker that stands until the WSL VM's next boot (above)


@dataclass(frozen=True)
class Observations:
    """Everything the facts saw on one host (plain values; facts never decide)."""

    kernel: WslKernelInfo
    wsl: WslVersionInfo
    init: InitInfo
    gpus: GpuReport
    cuda: CudaToolchainInfo
    resources: ResourcesInfo
    wslconf: IniFileInfo
    windows_profile: WindowsProfileInfo | None = None
    wslconfig: IniFileInfo | None = None
    gpu_memory: GpuMemoryProbeResult | None = None
    engine: EngineInstallInfo | None = None
    model: ModelDirInfo | None = None
    health: EngineHealthInfo | None = None
    guard_state: dict | None = None
    gate_record: GateResult | None = None  # the host's last health gate record (None: none or unreadable)
    restart_pending: list[str] | None = None  # Windows-side files changed since WSL started
    wake_on_lan: WakeOnLanInfo | None = None  # read only for a host with wake_on_lan_mac
    interop: InteropProbe | None = None  # a Windows program from a service (the doctor only)
    interop_binfmt: InteropBinfmt | None = None  # the binfmt table's interop entry (the doctor only)


def _v(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


# --- WSL ---------------------------------------------------------------------------


def check_wsl2(obs: Observations) -> Finding:
    k = obs.kernel
    if k.kind == "wsl2":
        return Finding("wsl2", "pass", f"kernel {k.release}")
    if k.kind == "wsl1":
        return Finding(
            "wsl2",
            "block",
            f"WSL1 kernel ({k.release}): no GPU access in WSL1",
            "convert the distro from Windows: `wsl.exe --set-version <distro> 2`",
            standing=True,  # the conversion stops the distro
        )
    return Finding(
        "wsl2",
        "block",
        f"not a WSL distro (kernel {k.release or 'unknown'})",
        "run this on a WSL2 distro of a Windows workstation (or point the inventory at one)",
        standing=True,
    )


def check_wsl_version(settings: Settings, obs: Observations) -> Finding:
    floor = settings.wsl_floor_tuple
    w = obs.wsl
    update = f"update WSL from Windows: `wsl.exe --update` (needs >= {settings.wsl_min_version}; pitfall 4)"
    if w.status == "ok" and w.version is not None:
        if w.version[: len(floor)] >= floor:
            return Finding("wsl_version", "pass", f"WSL {_v(w.version)} (from {w.source})")
        return Finding(
            "wsl_version",
            "block",
            f"WSL {_v(w.version)} < {settings.wsl_min_version}: older WSL reaps the engine and "
            "locks GPU memory (fake OOMs)",
            update,
            standing=True,  # an update of WSL restarts its VM: a new boot
        )
    if w.status == "no_version_flag":
        return Finding(
            "wsl_version",
            "block",
            f"`wsl.exe --version` is not supported: inbox WSL, older than {settings.wsl_min_version}",
            "install WSL from the Store or `wsl.exe --update` (needs >= " + settings.wsl_min_version + ")",
            standing=True,
        )
    if obs.kernel.kind == "none":
        return Finding("wsl_version", "block", "WSL not detected (no wslinfo, no wsl.exe)", update)
    return Finding(
        "wsl_version",
        "block",
        f"WSL version unknown: {w.detail or 'no wslinfo and no wsl.exe'}",
        "check Windows interop (wsl.exe reachable), then " + update,
    )


def _wslconf_systemd_plan(obs: Observations) -> wsl_ini.MergeResult | None:
    """What the deploy's merge of `[boot] systemd=true` into /etc/wsl.conf would do."""
    if not obs.wslconf.exists:
        return None
    ini = obs.wslconf.ini or wsl_ini.parse(b"", wsl_ini.WSLCONF)
    return wsl_ini.merge_parsed(ini, "boot", SYSTEMD_ON)


def check_systemd(obs: Observations) -> Finding:
    i = obs.init
    if i.systemd_up:
        return Finding("systemd", "pass", f"PID 1 is systemd, system {i.system_state}")
    if i.systemd_pid1:
        return Finding(
            "systemd",
            "block",
            f"systemd is PID 1 but the system is '{i.system_state}'",
            "see `systemctl --failed`; wait for boot to finish and re-run",
        )
    # WSL's reading of the file: first occurrence wins, keys before any header and everything
    # after a line that stops WSL's parser are ignored (freetoken_infra/core/wsl_ini.py).
    ini = obs.wslconf.ini
    enabled = ini is not None and wsl_ini.same_value(ini.value("boot", "systemd"), "true")
    if enabled:
        return Finding(
            "systemd",
            "block",
            f"PID 1 is {i.pid1 or 'unknown'}; /etc/wsl.conf already enables systemd",
            RESTART_REMEDY,
        )
    plan = _wslconf_systemd_plan(obs)
    if plan is not None and plan.problem is not None:
        return Finding(
            "systemd",
            "block",
            f"PID 1 is {i.pid1 or 'unknown'}; /etc/wsl.conf {plan.problem}",
            "fix that line of /etc/wsl.conf by hand (the deploy writes nothing to a file it cannot "
            "merge safely), then re-run",
        )
    return Finding(
        "systemd",
        "block",
        f"PID 1 is {i.pid1 or 'unknown'}, not systemd (the engine runs as a systemd unit)",
        "the deploy sets `[boot] systemd=true` in /etc/wsl.conf; then " + RESTART_REMEDY,
        deploy_fixes=obs.kernel.kind == "wsl2",
    )


def check_wslconfig(settings: Settings, obs: Observations) -> Finding:
    if obs.kernel.kind != "wsl2":
        return Finding("wslconfig", "warn", "no Windows side (not WSL2)", "nothing to do here")
    if obs.windows_profile is None or obs.windows_profile.path is None:
        err = obs.windows_profile.error if obs.windows_profile else "not probed"
        return Finding(
            "wslconfig",
            "warn",
            f"Windows profile not found ({err})",
            "enable interop (`[interop] enabled=true`) or set %UserProfile%\\.wslconfig by hand",
        )
    if obs.wslconfig is not None and obs.wslconfig.refused is not None:
        # Below the drive root every Linux account can plant a link (to a root-only file), a
        # FIFO or a huge file: root neither reads nor writes it.
        return Finding(
            "wslconfig",
            "warn",
            f"{obs.wslconfig.refused}; root does not follow or replace it",
            "the deploy leaves .wslconfig unchanged: look at who put it there, make it a plain file "
            "(under 64 KiB) or remove it, then re-run",
        )
    want = settings.wslconfig_values()
    present = obs.wslconfig is not None and obs.wslconfig.exists and obs.wslconfig.ini is not None
    ini = obs.wslconfig.ini if present and obs.wslconfig is not None else None
    if ini is None:
        ini = wsl_ini.parse(b"", wsl_ini.WSLCONFIG)
    # As WSL reads the file: inline comments, quotes, escapes, the first of duplicate keys, and
    # keys WSL 2.0 read under [experimental] (networkingMode) all count.
    differ = [
        f"{key}={seen if seen is not None else '<unset>'} (want {want[key]})"
        for key, seen in wsl_ini.differences(ini, "wsl2", want).items()
    ]
    mode = ini.first("wsl2", "networkingMode")
    # The networking mode WSL runs with, and where it reads it (WSL 2.0 read [experimental]).
    seen_mode = f"; networkingMode={mode.value} ([{mode.section}] line {mode.line})" if mode else ""
    if not differ:
        return Finding("wslconfig", "pass", ".wslconfig [wsl2] matches the settings (as WSL reads it)" + seen_mode)
    plan = wsl_ini.merge_parsed(ini, "wsl2", want)
    if plan.problem is not None:
        return Finding(
            "wslconfig",
            "warn",
            f".wslconfig differs ({', '.join(differ)}) and {plan.problem}",
            "the deploy leaves this file unchanged: fix that line by hand (or set the keys yourself); "
            "then " + RESTART_REMEDY,
        )
    return Finding(
        "wslconfig",
        "warn",
        ".wslconfig differs: " + ", ".join(differ) + seen_mode,
        "the deploy merges these keys into .wslconfig (keeping yours); then " + RESTART_REMEDY,
        deploy_fixes=True,
    )


# --- GPU ---------------------------------------------------------------------------


def primary_gpu(obs: Observations) -> GpuInfo | None:
    return obs.gpus.gpus[0] if obs.gpus.gpus else None


def check_gpu(obs: Observations) -> Finding:
    gpu = primary_gpu(obs)
    if gpu is None:
        why = obs.gpus.error or "nvidia-smi lists no GPU"
        return Finding(
            "gpu",
            "block",
            f"no NVIDIA GPU: {why}",
            "install or update the NVIDIA driver on Windows (never a Linux driver inside WSL); "
            "check that /dev/dxg and /usr/lib/wsl/lib/nvidia-smi exist",
        )
    return Finding(
        "gpu",
        "pass",
        f"GPU {gpu.index}: {gpu.name}, {gpu.memory_total_mib} MiB, driver {gpu.driver_version}, "
        f"CUDA {obs.gpus.cuda_version or '?'}",
    )


def check_compute_capability(obs: Observations) -> Finding:
    gpu = primary_gpu(obs)
    if gpu is None:
        return Finding("compute_capability", "block", "no GPU", "see the gpu check")
    if gpu.compute_cap is None:
        return Finding(
            "compute_capability", "warn", "nvidia-smi did not report compute_cap", "update the Windows NVIDIA driver"
        )
    if gpu.compute_cap < MIN_COMPUTE:
        return Finding(
            "compute_capability",
            "block",
            f"compute {gpu.compute_cap[0]}.{gpu.compute_cap[1]} < 8.0: FreeToken needs Ampere or newer",
            "use an Ampere (RTX 30xx) or newer GPU",
            standing=True,  # another card means a Windows restart
        )
    return Finding("compute_capability", "pass", f"compute {gpu.compute_cap[0]}.{gpu.compute_cap[1]}")


def check_gpu_memory(obs: Observations) -> Finding:
    p = obs.gpu_memory
    if p is None and obs.health is not None and obs.health.status == "ok":
        return Finding(
            "gpu_memory",
            "pass",
            "not probed: the engine serves on this GPU (/health ok), "
            "so allocations work; a probe beside it would measure only the engine's use",
        )
    if p is None:
        return Finding("gpu_memory", "pass", "not probed (nothing it guards is about to change)")
    free = (
        f"{p.free_bytes / GiB:.1f} GiB free of {p.total_bytes / GiB:.1f} GiB"
        if p.free_bytes is not None and p.total_bytes
        else "memory unknown"
    )
    if p.status == "healthy":
        return Finding("gpu_memory", "pass", f"{free}{_others_note(obs)}; 32 MiB and large allocations succeed")
    if p.status == "allocation_locked" and not p.free_bytes:
        return Finding(
            "gpu_memory",
            "block",
            f"{free}{_others_note(obs)}: the card is full, allocations fail",
            "stop what holds GPU memory (see nvidia-smi on Windows), then re-run",
        )
    if p.status == "allocation_locked":
        return Finding(
            "gpu_memory",
            "block",
            f"{free} but allocations fail ({p.error or 'CUDA_ERROR_OUT_OF_MEMORY'}): WDDM has locked "
            "this process's GPU memory (pitfall 4B, the fake OOM)",
            "update WSL: `wsl.exe --update` then `wsl.exe --shutdown` (fixed in WSL >= 2.7.13)",
        )
    return Finding(
        "gpu_memory",
        "block",
        f"CUDA unusable: {p.error or 'libcuda.so.1 missing'}",
        "check the Windows NVIDIA driver and /usr/lib/wsl/lib/libcuda.so.1",
    )


def _others_note(obs: Observations) -> str:
    gpu = primary_gpu(obs)
    who = holders_of(obs, gpu) if gpu is not None else None
    return f"; {gpu.memory_used_mib / 1024:.1f} GiB {who}" if gpu is not None and who else ""


def check_nvcc(obs: Observations) -> Finding:
    gpu = primary_gpu(obs)
    arch = f"compute_{gpu.compute_cap[0]}{gpu.compute_cap[1]}" if gpu and gpu.compute_cap else None
    found = [(c, c.version) for c in obs.cuda.nvcc if c.version is not None]
    installs = "the deploy installs cuda-nvcc-13-0 from NVIDIA's apt repository (pitfall 3)"
    if not found:
        return Finding("nvcc", "warn", "no nvcc found (FreeToken JIT-compiles kernels with nvcc)", installs)
    right = [(c, version) for c, version in found if version[0] == REQUIRED_NVCC_MAJOR]
    if not right:
        seen = ", ".join(f"{c.path} {version[0]}.{version[1]}" for c, version in found)
        return Finding("nvcc", "warn", f"nvcc of the wrong major: {seen} (need {REQUIRED_NVCC_MAJOR})", installs)
    best, best_version = right[0]
    if arch and arch not in best.archs:
        return Finding(
            "nvcc",
            "warn",
            f"{best.path} {_v(best_version)} does not list {arch}",
            installs + " (`nvcc fatal: Unsupported gpu architecture` otherwise)",
        )
    return Finding("nvcc", "pass", f"{best.path} {_v(best_version)}" + (f" lists {arch}" if arch else ""))


# --- resources ---------------------------------------------------------------------


def check_ram(settings: Settings, obs: Observations) -> Finding:
    need = (settings.model_expert_ram_gb + settings.ram_margin_gb) * GB
    have = obs.resources.mem_total_bytes
    evidence = (
        f"{have / GiB:.1f} GiB RAM; experts {settings.model_expert_ram_gb} GB + margin {settings.ram_margin_gb} GB"
    )
    if have >= need:
        return Finding("ram", "pass", evidence)
    return Finding(
        "ram",
        "block",
        evidence + f" = {need / GiB:.1f} GiB needed",
        f"raise `memory=` in .wslconfig (setting wslconfig_memory, now {settings.wslconfig_memory}) "
        "and restart WSL, or add RAM",
    )


def model_bytes_present(obs: Observations) -> int:
    if obs.model is None or not obs.model.exists:
        return 0
    return sum(obs.model.files.values())


def check_disk(settings: Settings, obs: Observations) -> Finding:
    missing = max(0.0, settings.model_size_gb * GB - model_bytes_present(obs))
    env_missing = 0.0
    if obs.engine is None or settings.engine_version not in obs.engine.versions:
        env_missing = settings.engine_env_size_gb * GB
    need = missing + env_missing + settings.disk_margin_gb * GB
    free = obs.resources.disk_free_bytes
    if free is None:
        return Finding("disk", "warn", f"free space on {obs.resources.disk_path} unknown", "check `df -h`")
    evidence = (
        f"{free / GB:.1f} GB free on {obs.resources.disk_path}; need {need / GB:.1f} GB "
        f"(model still missing {missing / GB:.1f} GB, engine env {env_missing / GB:.1f} GB, margin {settings.disk_margin_gb} GB)"
    )
    if free >= need:
        return Finding("disk", "pass", evidence)
    return Finding("disk", "block", evidence, f"free {((need - free) / GB):.1f} GB or move model_dir to a larger disk")


# --- model and launch plan ---------------------------------------------------------


def check_model_quantisation(quant: QuantSummary | None, where: str) -> Finding:
    """Decided from config.json / hf_quant_config.json alone, before any weights."""
    if quant is None:
        return Finding("model_quant", "pass", f"{where}: no config yet (checked again before download)")
    bad = unsupported_expert_schemes(quant)
    desc = f"{quant.method or 'unquantized'} {quant.algo or ''}".strip()
    if bad:
        return Finding(
            "model_quant",
            "block",
            f"{where}: {desc} with {', '.join(sorted(bad))} experts; FreeToken has no MoE method for it "
            "(`NotImplementedError: no quant method for moe.fp8_tensor`, pitfall 2)",
            "use NVIDIA's modelopt build: model_repo = 'nvidia/Qwen3.6-35B-A3B-NVFP4'",
        )
    experts = ", ".join(sorted(quant.expert_schemes)) or "none listed"
    return Finding("model_quant", "pass", f"{where}: {desc}, experts {experts}")


def check_model(settings: Settings, obs: Observations) -> Finding:
    m = obs.model
    if m is None or not m.exists:
        return check_model_quantisation(None, settings.model_dir)
    if m.error:
        # Not a blocker: every file in model_dir is the downloader's, checked against the hub's
        # hash, so a broken config.json is replaced (and the quantisation checked) by the deploy.
        return Finding(
            "model_quant",
            "warn",
            f"{settings.model_dir}: {m.error}",
            "nothing to do: the deploy fetches it again, verified, before any weight",
        )
    return check_model_quantisation(m.quant, settings.model_dir)


def plan_for(settings: Settings, obs: Observations) -> LaunchPlan | None:
    gpu = primary_gpu(obs)
    if gpu is None or gpu.compute_cap is None:
        return None
    return derive_plan(settings, gpu.memory_total_mib, gpu.compute_cap)


def check_hardware_profile(settings: Settings, obs: Observations) -> Finding:
    gpu = primary_gpu(obs)
    if settings.hardware_profile == "auto":
        return Finding("hardware_profile", "pass", "auto (launch plan from the GPU's memory)")
    declared = settings.hardware_profile
    want = HARDWARE_PROFILES[declared]
    if gpu is None:
        return Finding("hardware_profile", "block", f"{declared} declared, no GPU seen", "see the gpu check")
    seen = nominal_vram_gb(gpu.memory_total_mib)
    if seen != want:
        return Finding(
            "hardware_profile",
            "block",
            f"declared {declared} ({want} GB) but the GPU has {seen} GB ({gpu.name})",
            "fix the host's group in the inventory or its hardware_profile",
        )
    return Finding("hardware_profile", "pass", f"{declared}: {gpu.name}")


def check_launch_plan(settings: Settings, obs: Observations) -> Finding:
    gpu = primary_gpu(obs)
    plan = plan_for(settings, obs)
    if gpu is None or plan is None:
        return Finding("launch_plan", "block", "no GPU to plan for", "see the gpu check")
    vram_gb = nominal_vram_gb(gpu.memory_total_mib)
    usable = usable_vram_gb(plan, gpu.memory_total_mib)
    if plan.moe_cache_size == "auto":
        if vram_gb <= 16:
            return Finding(
                "launch_plan",
                "block",
                f"moe cache 'auto' on a {vram_gb} GB card ran out of GPU memory (pitfall 1)",
                "remove launch_moe_cache_size (the plan uses 256 on 16 GB) or set a number",
            )
        return Finding(
            "launch_plan",
            "warn",
            f"moe cache 'auto' on {vram_gb} GB: the engine sizes it",
            'prefer a number; see docs/deploy.md, "Launch plan"',
        )
    need = estimated_vram_gb(plan)
    assert need is not None  # an integer cache size (only 'auto' has no estimate, handled above)
    summary = f"cache {plan.moe_cache_size}, {plan.num_tokens} tokens: ~{need:.1f} GB of {usable:.1f} GB usable"
    who = holders_of(obs, gpu)
    if who:  # the plan stays sized to the card (re-runs give the same plan); gpu_free weighs the rest
        summary += f" on the card; {gpu.memory_used_mib / 1024:.1f} GiB of it {who} now (see gpu_free)"
    if need > usable:
        return Finding(
            "launch_plan",
            "block",
            summary + " - does not fit",
            "lower launch_moe_cache_size / launch_num_tokens (or drop the overrides to use the derived plan)",
        )
    if plan.num_tokens > plan.kv_reserve_tokens:
        return Finding(
            "launch_plan",
            "block",
            f"num_tokens {plan.num_tokens} > kv_reserve_tokens {plan.kv_reserve_tokens}",
            "keep launch_num_tokens <= launch_kv_reserve_tokens",
        )
    return Finding("launch_plan", "pass", summary)


# --- what other processes hold of the card, and who ------------------

# Under WSL nvidia-smi counts the owner's Windows apps and games as used but lists none of them
# (microsoft/WSL#7162); on Linux it lists compute processes, yet not always all (another
# container's, graphics-only ones).
UNLISTED_WSL = "Windows-side processes (not listed under WSL)"
UNLISTED = "processes nvidia-smi does not list"
# Less than this held, with nobody listed: the desktop's own share (WDDM keeps ~1 GB idle; the
# field report's idle cards read 1.0 and 1.5 GiB used), not worth a word.
NOTABLE_HELD_MIB = 2048


def engine_holds_gpu(obs: Observations) -> bool:
    """An engine of ours answers: its own memory is in the card's used figure."""
    return obs.health is not None and obs.health.status in ("ok", "loading")


def holders_of(obs: Observations, gpu: GpuInfo) -> str | None:
    """``held by ...``: who holds the card's used memory while no engine of ours does (None: not
    known, an engine of ours holds some, or too little is held to mention). The names are the
    processes' own text, made printable by the fact; listed by ``--query-compute-apps`` (whole
    names) on a one-GPU host, else by the table's rows for this GPU."""
    if engine_holds_gpu(obs) or "memory.used" in gpu.unavailable_fields:
        return None
    apps = obs.gpus.compute_apps
    if apps is not None and len(obs.gpus.gpus) == 1:
        listed = list(apps)
    else:
        listed = [p for p in obs.gpus.processes if p.gpu == gpu.index]
    if not listed and gpu.memory_used_mib < NOTABLE_HELD_MIB:
        return None
    named = ", ".join(f"{p.name} (pid {p.pid}, {_mib_text(p.used_mib)})" for p in listed)
    unlisted = UNLISTED_WSL if obs.kernel.kind == "wsl2" else UNLISTED
    rest_mib = gpu.memory_used_mib - sum(p.used_mib or 0 for p in listed)
    if not listed:
        return f"held by {unlisted}"
    if rest_mib >= NOTABLE_HELD_MIB:
        return f"held by {named} and {unlisted} ({rest_mib / 1024:.1f} GiB)"
    return f"held by {named}"


def check_gpu_free(settings: Settings, obs: Observations) -> Finding | None:
    """The plan against what the card has free now, not its size: memory held by
    other processes (under WSL the owner's Windows apps and games, which nvidia-smi counts as
    used but does not list, microsoft/WSL#7162) is not the engine's to take. Judged only while
    no engine of ours holds memory (not answering ``/health`` ok or loading): a serving engine's
    own share is in the card's used memory too. What is left is ``core.gpu_room``'s, the same
    formula the engine's own start checks (``operations/scripts/gpu_free.py``).

    A blocker, not a wait: the deploy stops for this host before it changes anything (nothing
    it would install is wrong, but its last step starts or restarts the engine), the rest of the
    fleet goes on, and the finding says to re-run once the owner lets go. Waiting inside the
    deploy would hold the run (and the fleet's lock) for as long as a game lasts. The waits are
    the engine unit's own (``ExecStartPre`` refuses, systemd tries again) and the host agent's
    (it rejoins once the owner's claim is gone)."""
    gpu = primary_gpu(obs)
    plan = plan_for(settings, obs)
    need = estimated_vram_gb(plan) if plan is not None else None
    if gpu is None or plan is None or need is None or not gpu.memory_total_mib:
        return None
    if "memory.used" in gpu.unavailable_fields or engine_holds_gpu(obs):
        return None
    total = gpu.memory_total_mib / 1024
    held = gpu.memory_used_mib / 1024
    room = gpu_room.room_gb(gpu.memory_total_mib, gpu.memory_used_mib, plan.memory_ratio)
    who = holders_of(obs, gpu) or "none of it by a listed process"
    evidence = f"{held:.1f} GiB of {total:.1f} GiB in use, {who}; the plan needs ~{need:.1f} GB"
    if need > room:
        return Finding(
            "gpu_free",
            "block",
            f"{evidence}, {max(room, 0.0):.1f} left to it",
            "wait until the owner's apps or games let go of the GPU (Task Manager's GPU memory column, or "
            "nvidia-smi on Windows, names them), then re-run; the engine is not started into memory it cannot have",
        )
    return Finding("gpu_free", "pass", f"{evidence} of {room:.1f} left to it")


def _mib_text(mib: int | None) -> str:
    return "memory not reported" if mib is None else f"{mib / 1024:.1f} GiB"


# What WSL cannot see of Wake-on-LAN: said in every wake_on_lan finding.
WOL_UNSEEN = "the PC's firmware (BIOS/UEFI: Wake-on-LAN, power on by PCI-E) and Windows' Fast Startup (off) cannot be seen from WSL"


def check_wake_on_lan(settings: Settings, obs: Observations) -> Finding | None:
    """Wake-on-LAN readiness as far as WSL sees it, for a host with
    ``wake_on_lan_mac``: Windows has an adapter with that MAC, it wakes on a magic packet, and it
    is armed to wake the PC. A warning, never a blocker: a host that cannot be woken still serves."""
    mac = settings.wake_on_lan_mac
    if mac is None:
        return None
    info = obs.wake_on_lan
    if obs.kernel.kind != "wsl2" or info is None or info.adapters is None:
        why = (info.error if info is not None else None) or "PowerShell's Get-NetAdapter could not be read"
        return Finding(
            "wake_on_lan",
            "warn",
            f"wake_on_lan_mac {mac}: Windows' network adapters not seen ({why})",
            f"on Windows, check the adapter with MAC {mac}: Device Manager, its Power Management: allow it to wake "
            f"the computer, only with a magic packet; {WOL_UNSEEN}",
        )
    adapter = next((a for a in info.adapters if a.mac == mac), None)
    if adapter is None:
        seen = ", ".join(f"{a.name} ({a.mac or '?'})" for a in info.adapters) or "none"
        return Finding(
            "wake_on_lan",
            "warn",
            f"no network adapter on Windows has wake_on_lan_mac {mac} (physical adapters: {seen})",
            "set wake_on_lan_mac to the MAC of the wired adapter the PC sleeps on (`Get-NetAdapter` on Windows)",
        )
    problems = []
    if adapter.wake_on_magic_packet.lower() != "enabled":
        problems.append(f"its WakeOnMagicPacket is {adapter.wake_on_magic_packet or 'not reported'}")
    armed = info.wake_armed
    if armed is not None and adapter.description not in armed:
        problems.append("powercfg /devicequery wake_armed does not list it")
    where = f"{adapter.name} ({adapter.description}, {mac})"
    if problems:
        return Finding(
            "wake_on_lan",
            "warn",
            f"{where}: {'; '.join(problems)}",
            f"on Windows, Device Manager, {adapter.description}: Advanced, Wake on Magic Packet enabled; Power "
            "Management, allow this device to wake the computer and only a magic packet (or as administrator: "
            f'powercfg /deviceenablewake "{adapter.description}"); also {WOL_UNSEEN}',
        )
    checked = "wakes on a magic packet" + (" and is armed to wake the PC" if armed is not None else "")
    return Finding("wake_on_lan", "pass", f"{where} {checked}; {WOL_UNSEEN}")


def check_guard(obs: Observations) -> Finding | None:
    state = obs.guard_state
    if not state or not state.get("tripped"):
        return None
    return Finding(
        "guard",
        "warn",
        f"guard stopped the engine at {state.get('time', '?')}: {state.get('reason', '?')}",
        "free memory (close apps, lower launch_num_tokens), then `systemctl start freetoken`",
    )


# What to do about interop failing as a service sees it, by the classifier's reason.
_INTEROP_FIXES = {
    owner.EXEC_FORMAT: (
        "WSL's interop entry is gone from /proc/sys/fs/binfmt_misc (systemd-binfmt emptied it): the deploy "
        f"keeps it ({INTEROP_BINFMT_CONF}); now: `sudo {SYSTEMD_BINFMT} {INTEROP_BINFMT_CONF}`, or run the deploy"
    ),
    owner.RUN_DETECTORS: (
        "another package's handler took Windows programs (`ls /proc/sys/fs/binfmt_misc`: mono's `cli`, wine): "
        "`sudo update-binfmts --disable NAME` (or remove the package), then "
        f"`sudo {SYSTEMD_BINFMT} {INTEROP_BINFMT_CONF}`"
    ),
    owner.VSOCK_REFUSED: "a sandbox refuses AF_VSOCK to the caller: run the doctor as root over SSH, not from a confined unit",
    owner.NO_CONNECT_BACK: "Windows did not answer: is the owner logged on and Windows unlocked? then `wsl.exe --shutdown`",
    owner.NO_ANSWER: "no interop socket reached: is interop off (`[interop] enabled=false` in /etc/wsl.conf)?",
    owner.PROGRAM_MISSING: "no cmd.exe in System32 under the automount root: are the drives mounted?",
}


def check_interop(settings: Settings, obs: Observations) -> Finding | None:
    """Windows programs as a service starts them (the host agent is one): a warning, never a
    blocker (the engine serves without interop), naming the owner signals that are off and the fix."""
    if obs.interop is None or obs.kernel.kind != "wsl2":
        return None
    others = obs.interop_binfmt.others if obs.interop_binfmt is not None else ()
    also = f"; other handlers of Windows programs: {', '.join(others)}" if others else ""
    reason = obs.interop.reason
    if reason == owner.INTEROP_OK:
        return Finding("interop", "pass", f"a Windows program starts from a systemd service{also}")
    configured = tuple(
        name
        for name, on in zip(
            owner.WINDOWS_SIGNALS,
            (bool(settings.owner_apps), settings.owner_fullscreen, settings.owner_reboot_drain),
            strict=True,
        )
        if on and settings.agent_enabled
    )
    signals = owner.signals_line(configured, dict.fromkeys(configured, reason)) if configured else "VRAM only"
    if reason.startswith("interop socket: connect failed"):
        fix = "WSL's interop server is gone: from Windows `wsl.exe --shutdown`, then open the distro again"
    elif reason.startswith("timed out after"):
        fix = _INTEROP_FIXES[owner.NO_CONNECT_BACK]
    else:
        fix = _INTEROP_FIXES.get(reason, 'see docs/security.md, "What WSL shares with every Linux user"')
    return Finding(
        "interop",
        "warn",
        f"as a service: {reason} ({printable(obs.interop.detail)}){also}; owner signals: {signals}",
        fix,
    )


def evaluate(settings: Settings, obs: Observations) -> list[Finding]:
    """All findings for one host, in the order a person would fix them."""
    findings = [
        check_wsl2(obs),
        check_wsl_version(settings, obs),
        check_systemd(obs),
        check_wslconfig(settings, obs),
        check_gpu(obs),
        check_compute_capability(obs),
        check_gpu_memory(obs),
        check_nvcc(obs),
        check_ram(settings, obs),
        check_disk(settings, obs),
        check_model(settings, obs),
        check_hardware_profile(settings, obs),
        check_launch_plan(settings, obs),
    ]
    for extra in (
        check_gpu_free(settings, obs),
        check_wake_on_lan(settings, obs),
        check_guard(obs),
        check_interop(settings, obs),
    ):
        if extra:
            findings.append(extra)
    return findings


def blockers(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "block"]


def only_deploy_fixable(findings: list[Finding]) -> bool:
    """True when every blocker is one the deploy's Windows-side step resolves."""
    b = blockers(findings)
    return bool(b) and all(f.deploy_fixes for f in b)


@dataclass(frozen=True)
class HostPreflight:
    """The preflight's record of one host, made once per run (preflight.run_preflight): what
    the deploy, the doctor's output and a rollout's fleet report read."""

    settings: Settings
    observations: Observations
    findings: list[Finding]

    @property
    def blocked(self) -> list[Finding]:
        return blockers(self.findings)

    @property
    def standing(self) -> list[Finding]:
        """The blockers that stand until the WSL VM's next boot (``Finding.standing``)."""
        return [f for f in self.blocked if f.standing]

    @property
    def stop_reason(self) -> str:
        """Why a blocked host stops (the line the deploy and the doctor print)."""
        return "preflight blockers: " + ", ".join(f.check for f in self.blocked)

    @property
    def restart_only(self) -> bool:
        """Every blocker is the deploy's own Windows-side step to fix."""
        return only_deploy_fixable(self.findings)
