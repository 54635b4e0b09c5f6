"""The engine's last check before it starts (its unit's ``ExecStartPre``): is enough of the GPU
free for its launch plan, now? Run as the engine's user, with the host's own ``python3``.

The deploy's preflight already refuses to start an engine into memory it cannot have (the
``gpu_free`` rule); this covers the starts the deploy does not make: at boot, when Windows
starts WSL, and systemd's restart after a crash, while the owner plays a game that holds the
card. Then it exits 1 with one line saying what is held, and systemd tries the start again after
``RestartSec`` until the memory is let go (``Restart=on-failure``). The formula is
``gpu_room.room_gb``, uploaded beside this script, the same one the preflight uses.

When ``nvidia-smi`` cannot be run or read, it does not judge (exit 0): the engine's own start
then says what is wrong with the GPU, and the preflight's ``gpu`` check too.

    python3 gpu_free.py --need-gb 5.7 [--ratio 0.9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING

HERE = os.path.dirname(os.path.abspath(__file__))
# The core modules: uploaded beside this script on the target, else the package of its checkout.
sys.path.insert(0, HERE if os.path.isfile(f"{HERE}/gpu_room.py") else os.path.dirname(os.path.dirname(HERE)))
if TYPE_CHECKING or sys.path[0] != HERE:  # the type checker, or a checkout
    from freetoken_infra.core import gpu_room
else:
    import gpu_room

# Under WSL nvidia-smi comes from the Windows driver, often not on PATH (facts/gpu.py).
WSL_NVIDIA_SMI = "/usr/lib/wsl/lib/nvidia-smi"
PREFIX = "gpu_free:"


def nvidia_smi() -> str | None:
    found = shutil.which("nvidia-smi")
    if found:
        return found
    return WSL_NVIDIA_SMI if os.access(WSL_NVIDIA_SMI, os.X_OK) else None


def read_memory(smi: str) -> tuple[int, int] | str:
    """(total MiB, used MiB) of the first GPU (the one the engine uses), or why not."""
    try:
        run = subprocess.run(
            [smi, "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{smi} could not run: {exc}"
    first = (run.stdout.splitlines() or [""])[0]
    cells = [c.strip() for c in first.split(",")]
    if run.returncode != 0 or len(cells) != 2 or not all(c.isdigit() for c in cells):
        return f"{smi} exit {run.returncode}: {first[:200]!r}"
    return int(cells[0]), int(cells[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--need-gb", type=float, required=True, help="the launch plan's estimated peak")
    ap.add_argument("--ratio", type=float, default=None, help="the plan's --memory-ratio (default 0.9)")
    args = ap.parse_args(argv)
    smi = nvidia_smi()
    memory = read_memory(smi) if smi else "no nvidia-smi"
    if isinstance(memory, str):
        print(f"{PREFIX} not judged ({memory}): starting", file=sys.stderr)
        return 0
    total, used = memory
    room = gpu_room.room_gb(total, used, args.ratio)
    if args.need_gb > room:
        print(
            f"{PREFIX} {used / 1024:.1f} GiB of {total / 1024:.1f} GiB held by other processes (under WSL the "
            f"owner's Windows apps and games); the plan needs ~{args.need_gb:.1f} GB, {max(room, 0.0):.1f} left: "
            "not starting until they let go (systemd tries again after RestartSec)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
