"""Host profiles of the simulated fleet, as data.

Each entry describes one simulated Windows+WSL2 workstation: the GPU the stand-ins report, the
WSL version the Windows stand-ins print, the Windows user and language, the RAM/swap the WSL VM
reports, and the decode pace the engine stand-in imitates. Adding a host = adding an entry.

A fleet of more hosts than there are entries (FREETOKEN_SIM_HOSTS=12) repeats the healthy
profiles in turn: ws4 is dressed like ws1, ws5 like ws2, ws6 like ws1, and so on (profile_for).
Each repeat keeps its own name, address and GPU UUID; ws3 (refused at preflight) is not repeated,
so a big fleet is ws3 plus serving hosts of both hardware classes.

The values are taken from the field report (README, The pitfalls it checks): ws1 is the
report's machine, ws3 is the report's "fake OOM" (pitfall 4B: old WSL, WDDM allocation lock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_total_mib: int
    compute_cap: str = "12.0"
    memory_used_mib: int = 0  # what nvidia-smi shows as used at idle
    driver_version: str = "581.80"  # Windows driver, as WSL's nvidia-smi prints it
    nvsmi_version: str = "580.102.01"
    cuda_version: str = "13.0"
    cuda_driver_api_version: int = 13000  # cuDriverGetVersion
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    pci_bus_id: str = "00000000:01:00.0"
    power_limit_w: int = 180
    # WDDM allocation lock (field report pitfall 4B): cuMemGetInfo reports `locked_free_mib`
    # free, yet every cuMemAlloc fails with CUDA_ERROR_OUT_OF_MEMORY.
    allocation_locked: bool = False
    locked_free_mib: int = 0


@dataclass(frozen=True)
class HostProfile:
    name: str
    hardware_class: str  # inventory group name
    gpu: GpuProfile
    wsl_version: str  # e.g. "2.7.13" (wslinfo); wsl.exe prints "2.7.13.0"
    windows_language: str  # "en" or "zh": wsl.exe's label language
    windows_user: str
    mem_total_bytes: int  # the WSL VM's RAM as /proc/meminfo reports it
    swap_total_bytes: int
    tokens_per_s: float  # decode pace of the engine stand-in
    load_seconds: float = 3.0
    kernel_version: str = "6.6.87.2-1"
    windows_version: str = "10.0.26100.7171"
    healthy: bool = True
    notes: str = ""

    @property
    def kernel_release(self) -> str:
        return self.kernel_version.rsplit("-", 1)[0] + "-microsoft-standard-WSL2"

    def to_dict(self) -> dict:
        return asdict(self)


# The WSL VM reports a little less than the configured memory limit (kernel reservations).
def _vm_ram(limit_gib: int) -> int:
    return limit_gib * GiB - 380 * MiB


PROFILES: dict[str, HostProfile] = {
    "ws1": HostProfile(
        name="ws1",
        hardware_class="rtx5060ti_16gb",
        gpu=GpuProfile(
            name="NVIDIA GeForce RTX 5060 Ti",
            memory_total_mib=16311,
            memory_used_mib=853,
            uuid="GPU-6a1d6f3e-8c52-4b7e-9f3a-0d5e2c7b1a01",
            pci_bus_id="00000000:01:00.0",
            power_limit_w=180,
        ),
        wsl_version="2.7.13",
        windows_language="en",
        windows_user="dev",
        mem_total_bytes=_vm_ram(24),
        swap_total_bytes=4 * GiB,
        tokens_per_s=23.5,
        notes="the field report's machine, healthy",
    ),
    "ws2": HostProfile(
        name="ws2",
        hardware_class="rtx5090_32gb",
        gpu=GpuProfile(
            name="NVIDIA GeForce RTX 5090",
            memory_total_mib=32607,
            memory_used_mib=1123,
            uuid="GPU-2b9c4e71-5d3a-4f08-a6c2-7e1f9d3b5c02",
            pci_bus_id="00000000:01:00.0",
            power_limit_w=575,
        ),
        wsl_version="2.7.13",
        windows_language="zh",
        windows_user="lei",
        mem_total_bytes=_vm_ram(48),
        swap_total_bytes=8 * GiB,
        tokens_per_s=60.0,
        notes="healthy, Chinese-localised Windows (wsl.exe labels in Chinese)",
    ),
    "ws3": HostProfile(
        name="ws3",
        hardware_class="rtx5060ti_16gb",
        gpu=GpuProfile(
            name="NVIDIA GeForce RTX 5060 Ti",
            memory_total_mib=16311,
            memory_used_mib=742,
            uuid="GPU-9e4a7c2d-1f6b-4d93-b8e5-3c0a6f2d4e03",
            pci_bus_id="00000000:01:00.0",
            power_limit_w=180,
            allocation_locked=True,
            locked_free_mib=11872,  # ~11.6 GiB "free", as reported
        ),
        wsl_version="2.6.1",
        windows_language="en",
        windows_user="dev",
        mem_total_bytes=_vm_ram(24),
        swap_total_bytes=4 * GiB,
        kernel_version="6.6.87.2-1",
        windows_version="10.0.26100.4652",
        tokens_per_s=23.5,
        healthy=False,
        notes="WSL 2.6.1 with the WDDM allocation lock (field report pitfall 4B); must be refused",
    ),
}

BRIDGE_NAME = "ftsim0"
BRIDGE_ADDRESS = "10.213.0.1"
BRIDGE_PREFIX = 24
HOST_ADDRESS_BASE = 10  # wsN -> 10.213.0.(10+N)
# Hosts get 10.213.0.11 up to .(10+MAX_HOSTS); the addresses above (.201-.254) are left for
# what tests put on the bridge besides the hosts (a host nobody answers for, extra services).
MAX_HOSTS = 190
# The profiles a fleet beyond the table repeats, in turn: the healthy ones (ws1, ws2).
REPEATED = tuple(name for name, profile in PROFILES.items() if profile.healthy)


# The fleet's gateway (deploys/gateway.py): a plain Debian host, no Windows or GPU stand-ins,
# started on demand (Fleet.start_gateway, `python -m tests.fleet up --gateway`). It is not a
# workstation: host_count() and host_names() never include it.
GATEWAY_NAME = "gw1"
GATEWAY_ADDRESS = "10.213.0.5"


def host_address(name: str) -> str:
    number = int(name.removeprefix("ws"))
    if not 1 <= number <= MAX_HOSTS:
        raise ValueError(f"{name}: the simulated fleet numbers its hosts ws1..ws{MAX_HOSTS}")
    return f"10.213.0.{HOST_ADDRESS_BASE + number}"


def profile_for(name: str) -> HostProfile:
    """Profile of host `name`: its entry in PROFILES, else the healthy profiles in turn (ws4 is
    dressed like ws1, ws5 like ws2, ws6 like ws1, ...) under its own name and GPU UUID."""
    if name in PROFILES:
        return PROFILES[name]
    number = int(name.removeprefix("ws"))
    base = PROFILES[REPEATED[(number - len(PROFILES) - 1) % len(REPEATED)]]
    uuid = base.gpu.uuid[:-4] + f"{number:04x}"  # the last UUID group ends in the host number
    return replace(
        base, name=name, gpu=replace(base.gpu, uuid=uuid), notes=f"{base.name}'s profile, repeated for a larger fleet"
    )
