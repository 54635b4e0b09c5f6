"""Hardware classes a host can declare (`hardware_profile` in group or host data).

A profile names a class of workstation and what we expect of it: the GPU's nominal
memory, and the decode speed below which the health gate and the verification
suite call the host degraded. The launch values themselves come from one rule in
`freetoken_infra.launch`, so a profile only carries what the rule cannot know.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    vram_gb: int  # nominal size, as sold (16311 MiB reads as 16 GB)
    decode_floor_tps: float


HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in (
        # The field report's machine: measured 22-24 tok/s steady decode.
        HardwareProfile("rtx5060ti_16gb", "GeForce RTX 5060 Ti 16 GB (Blackwell, 12.0)", 16, 18.0),
        HardwareProfile("rtx5070ti_16gb", "GeForce RTX 5070 Ti 16 GB (Blackwell, 12.0)", 16, 20.0),
        HardwareProfile("rtx4090_24gb", "GeForce RTX 4090 24 GB (Ada, 8.9)", 24, 25.0),
        HardwareProfile("rtx5090_32gb", "GeForce RTX 5090 32 GB (Blackwell, 12.0)", 32, 40.0),
    )
}


def nominal_vram_gb(total_mib: int) -> int:
    """What a card is sold as: nvidia-smi reports 16311 MiB for a 16 GB card."""
    return max(1, round(total_mib / 1024))
