"""Raw file contents, for operations that edit a file in place (round-trip INI merges)."""

from __future__ import annotations

import base64

from pyinfra.api import FactBase

from ._declare import PATH, one_path
from ._output import MARKER, quote


class FileBytes(FactBase[bytes | None]):
    """
    Returns the file's exact bytes (any encoding, CRLF kept), or None when it does not exist.
    """

    argument_shapes = {"path": PATH}
    fast_check_inputs = one_path("path")

    def command(self, path: str) -> str:
        p = quote(path)
        return f"if [ -f {p} ]; then echo '{MARKER}file'; base64 < {p}; else echo '{MARKER}missing'; fi"

    def process(self, output: list[str]) -> bytes | None:
        if not output or output[0].strip() != f"{MARKER}file":
            return None
        return base64.b64decode("".join(line.strip() for line in output[1:]))


class FileText(FactBase[str | None]):
    """
    Returns a small text file's UTF-8 contents, or None when it does not exist.
    """

    argument_shapes = {"path": PATH}
    fast_check_inputs = one_path("path")

    def command(self, path: str) -> str:
        return FileBytes().command(path)

    def process(self, output: list[str]) -> str | None:
        data = FileBytes().process(output)
        return None if data is None else data.decode("utf-8", "replace")
