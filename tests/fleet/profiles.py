"""Host profiles of the simulated fleet, as data.

Each entry describes one simulated Windows+WSL2 workstation: the GPU the stand-ins report, the
WSL version the Windows stand-ins print, the Windows user and language, the RAM/swap the WSL VM
reports, and the decode pace the engine stand-in imitates. Adding a host = adding an entry.

The values are taken from the field report (docs: /work/shared brief field-report.md): ws1 is the
report's machine, ws3 is the report's "fake OOM" (pitfall 4B: old WSL, WDDM allocation lock).
"""
from __future__ import annotations

from dataclasses import dataclass, asdict

GiB = 1024 ** 3
MiB = 1024 ** 2


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_total_mib: int
    compute_cap: str = "12.0"
    memory_used_mib: int = 0              # what nvidia-smi shows as used at idle
    driver_version: str = "581.80"        # Windows driver, as WSL's nvidia-smi prints it
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
    hardware_class: str            # inventory group name
    gpu: GpuProfile
    wsl_version: str               # e.g. "2.7.13" (wslinfo); wsl.exe prints "2.7.13.0"
    windows_language: str          # "en" or "zh": wsl.exe's label language
    windows_user: str
    mem_total_bytes: int           # the WSL VM's RAM as /proc/meminfo reports it
    swap_total_bytes: int
    tokens_per_s: float            # decode pace of the engine stand-in
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
            name="NVIDIA GeForce RTX 5060 Ti", memory_total_mib=16311, memory_used_mib=853,
            uuid="GPU-6a1d6f3e-8c52-4b7e-9f3a-0d5e2c7b1a01", pci_bus_id="00000000:01:00.0",
            power_limit_w=180,
        ),
        wsl_version="2.7.13", windows_language="en", windows_user="dev",
        mem_total_bytes=_vm_ram(24), swap_total_bytes=4 * GiB,
        tokens_per_s=23.5,
        notes="the field report's machine, healthy",
    ),
    "ws2": HostProfile(
        name="ws2",
        hardware_class="rtx5090_32gb",
        gpu=GpuProfile(
            name="NVIDIA GeForce RTX 5090", memory_total_mib=32607, memory_used_mib=1123,
            uuid="GPU-2b9c4e71-5d3a-4f08-a6c2-7e1f9d3b5c02", pci_bus_id="00000000:01:00.0",
            power_limit_w=575,
        ),
        wsl_version="2.7.13", windows_language="zh", windows_user="lei",
        mem_total_bytes=_vm_ram(48), swap_total_bytes=8 * GiB,
        tokens_per_s=60.0,
        notes="healthy, Chinese-localised Windows (wsl.exe labels in Chinese)",
    ),
    "ws3": HostProfile(
        name="ws3",
        hardware_class="rtx5060ti_16gb",
        gpu=GpuProfile(
            name="NVIDIA GeForce RTX 5060 Ti", memory_total_mib=16311, memory_used_mib=742,
            uuid="GPU-9e4a7c2d-1f6b-4d93-b8e5-3c0a6f2d4e03", pci_bus_id="00000000:01:00.0",
            power_limit_w=180,
            allocation_locked=True, locked_free_mib=11872,   # ~11.6 GiB "free", as reported
        ),
        wsl_version="2.6.1", windows_language="en", windows_user="dev",
        mem_total_bytes=_vm_ram(24), swap_total_bytes=4 * GiB,
        kernel_version="6.6.87.2-1", windows_version="10.0.26100.4652",
        tokens_per_s=23.5, healthy=False,
        notes="WSL 2.6.1 with the WDDM allocation lock (field report pitfall 4B); must be refused",
    ),
}

BRIDGE_NAME = "ftsim0"
BRIDGE_ADDRESS = "10.213.0.1"
BRIDGE_PREFIX = 24
HOST_ADDRESS_BASE = 10   # wsN -> 10.213.0.(10+N)


# The fleet's gateway (deploys/gateway.py): a plain Debian host, no Windows or GPU stand-ins,
# started on demand (Fleet.start_gateway, `python -m tests.fleet up --gateway`). It is not a
# workstation: host_count() and host_names() never include it.
GATEWAY_NAME = "gw1"
GATEWAY_ADDRESS = "10.213.0.5"


def host_address(name: str) -> str:
    number = int(name.removeprefix("ws"))
    return f"10.213.0.{HOST_ADDRESS_BASE + number}"


def profile_for(name: str) -> HostProfile:
    """Profile of host `name`; hosts beyond the table repeat ws1's healthy profile."""
    if name in PROFILES:
        return PROFILES[name]
    base = PROFILES["ws1"]
    return HostProfile(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "name": name})
