"""Hardware classes a host can declare (`hardware_profile`, set by the class's
`group_data/<class>.py`).

A class names a kind of workstation by its GPU's nominal memory; the preflight
refuses a host whose GPU does not match its declared class. The launch values come
from one rule in `freetoken_infra.core.launch`; what else a class sets (its decode floor)
lives in its group_data file with the other settings.
"""

from __future__ import annotations

# class name -> the GPU's nominal memory in GB, as sold.
HARDWARE_PROFILES: dict[str, int] = {
    "rtx5060ti_16gb": 16,  # GeForce RTX 5060 Ti 16 GB (Blackwell, 12.0): the field report's card
    "rtx5090_32gb": 32,  # GeForce RTX 5090 32 GB (Blackwell, 12.0)
}


def nominal_vram_gb(total_mib: int) -> int:
    """What a card is sold as: nvidia-smi reports 16311 MiB for a 16 GB card."""
    return max(1, round(total_mib / 1024))
