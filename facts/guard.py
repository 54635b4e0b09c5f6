"""The memory guard's state file, as ``operations/scripts/guard.py`` writes it when it stops the
engine (field report, operations advice: swap above 2 GB or a CUDA OOM -> stop the service)."""

from __future__ import annotations

import json

from pyinfra.api import FactBase

from ._declare import PATH, one_path
from ._output import MARKER, b64decode_lines, quote, section_map


def parse_guard_state_output(lines: list[str]) -> dict | None:
    """None when there is no state file; the parsed dict when there is one; a dict with
    ``tripped: False`` and an ``error`` when it cannot be read or is not a JSON object."""
    found = section_map(lines)
    if "missing" in found:
        return None
    if "unreadable" in found:
        path = found["unreadable"][0]
        return {"tripped": False, "error": f"guard state file {path} is not readable (run the doctor with sudo)"}
    if "state" not in found:
        return {"tripped": False, "error": "no output from the state probe"}
    raw = b64decode_lines(found["state"][1])
    if raw is None:
        return {"tripped": False, "error": "guard state file could not be transferred (bad base64)"}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return {"tripped": False, "error": f"guard state file is not valid JSON: {exc}"}
    if not isinstance(data, dict):
        return {"tripped": False, "error": f"guard state file holds a {type(data).__name__}, not an object"}
    # Only a literal true counts: the doctor warns on it.
    data["tripped"] = data.get("tripped") is True
    return data


class GuardState(FactBase[dict | None]):
    """
    Returns the guard's state file as a dict (``{"tripped": True, "reason": ..., "time": ...,
    "samples": {...}}``), None when the guard has not stopped the engine since the last deploy
    (no file), or ``{"tripped": False, "error": ...}`` when the file is unreadable or broken.

    + state_file: e.g. ``/var/lib/freetoken-deploy/guard-state.json``
    """

    argument_shapes = {"state_file": PATH}
    fast_check_inputs = one_path("state_file")

    def command(self, state_file: str) -> str:
        # The contents travel base64-encoded: a broken file may hold any bytes.
        return (
            f"F={quote(state_file)}; "
            f"if [ ! -e \"$F\" ]; then echo '{MARKER}missing'; "
            f'elif [ ! -r "$F" ]; then echo "{MARKER}unreadable $F"; '
            f"else echo '{MARKER}state'; base64 < \"$F\"; fi; true"
        )

    @staticmethod
    def default() -> dict | None:
        return None

    def process(self, output: list[str]) -> dict | None:
        return parse_guard_state_output(output)
