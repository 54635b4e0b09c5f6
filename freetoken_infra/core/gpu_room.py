"""How much of the GPU the engine may have: one formula for the preflight (``rules``), the launch
plan (``launch.usable_vram_gb``) and the engine's own start (``operations/scripts/gpu_free.py``,
its ``ExecStartPre``).

The engine may use ``ratio`` of the card (FreeToken's ``--memory-ratio``, 0.9 unless the plan
says otherwise); what other processes hold comes off that, and never less than the Windows
desktop's share, which WDDM keeps (~1 GB idle in the field report). Under WSL, ``nvidia-smi``
counts the owner's Windows apps and games in the card's used memory without listing them
(microsoft/WSL#7162), so the used figure is what others hold whenever no engine of ours runs.

Standard library only: uploaded beside ``gpu_free.py`` (``layout.GPU_ROOM_MODULE``).
"""

from __future__ import annotations

VRAM_DESKTOP_RESERVE_GB = 1.0
DEFAULT_MEMORY_RATIO = 0.9


def room_gb(total_mib: int, held_mib: int = 0, ratio: float | None = None) -> float:
    """GPU memory (GiB) left to the engine on a card of ``total_mib`` while others hold ``held_mib``."""
    return total_mib / 1024 * (ratio or DEFAULT_MEMORY_RATIO) - max(held_mib / 1024, VRAM_DESKTOP_RESERVE_GB)
