"""APT source files, so the deploy can tell its own CUDA repository entry from the
one the cuda-keyring package ships."""

from __future__ import annotations

from pyinfra.api import FactBase

from ._declare import Inputs
from ._output import MARKER

APT_SOURCES_DIR = "/etc/apt/sources.list.d"


class AptSourceFiles(FactBase[dict]):
    """
    Returns ``{path: content}`` for every file in ``/etc/apt/sources.list.d``.
    """

    fast_check_inputs = Inputs(paths={APT_SOURCES_DIR}, trees={APT_SOURCES_DIR})

    def command(self) -> str:
        return (
            'for f in /etc/apt/sources.list.d/*; do [ -f "$f" ] || continue; '
            f'echo "{MARKER}file $f"; cat "$f"; echo; done; true'
        )

    def process(self, output: list[str]) -> dict:
        files: dict[str, list[str]] = {}
        current = None
        for line in output:
            if line.startswith(f"{MARKER}file "):
                current = line[len(MARKER) + 5 :].strip()
                files[current] = []
            elif current is not None:
                files[current].append(line)
        return {path: "\n".join(lines).strip() + "\n" for path, lines in files.items()}
