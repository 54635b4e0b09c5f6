"""Fact: the deploy's host lock (``layout.HOST_LOCK_FILE``): who holds the host, and whether that
holder is still there (operations/host_lock.py takes and releases it). Reads only: a missing
lock file or folder is reported as free, nothing is created."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from pyinfra.api import FactBase

from freetoken_infra.core.layout import HOST_LOCK_FILE

from ._declare import PATH, Unknown
from ._output import MARKER, quote

# The holder's session is the process recorded when the lock was taken (pid and start time, so
# a reused pid is not taken for it); the whole answer travels base64-encoded (the command line
# in it is text we do not control).
LOCK_SCRIPT = r"""
import base64, json, sys, time
path = sys.argv[1]
try:
    with open(path) as f:
        doc = json.load(f)
except FileNotFoundError:
    doc = None
except (OSError, ValueError) as e:
    doc = {"unreadable": str(e)}
alive = None
session = doc.get("session") if isinstance(doc, dict) else None
if isinstance(session, dict) and isinstance(session.get("pid"), int):
    try:
        text = open("/proc/%d/stat" % session["pid"]).read()
        alive = int(text[text.rindex(")") + 2:].split()[19]) == session.get("start")
    except (OSError, ValueError, IndexError):
        alive = False
out = {"holder": doc, "alive": alive, "now": time.time()}
print("@@ft:lock " + base64.b64encode(json.dumps(out).encode()).decode())
"""


@dataclass(frozen=True)
class HostLockInfo:
    """``holder``: the lock file's JSON (None: free); ``holder_alive``: its session process
    lives (None: unknown); ``lease_left_s``: seconds until its lease ends (negative: ended)."""

    holder: dict[str, Any] | None
    holder_alive: bool | None
    lease_left_s: float | None
    error: str | None = None

    @property
    def held(self) -> bool:
        """Held by a run that may still be working (not gone, lease not over)."""
        return (
            self.holder is not None
            and self.holder_alive is not False
            and self.lease_left_s is not None
            and self.lease_left_s > 0
        )


def parse_host_lock_output(lines: list[str]) -> HostLockInfo:
    for line in lines:
        if line.startswith(MARKER + "lock "):
            try:
                doc = json.loads(base64.b64decode(line[len(MARKER + "lock ") :].strip(), validate=True))
            except (ValueError, binascii.Error):
                return HostLockInfo(None, None, None, "unreadable fact output")
            holder = doc.get("holder") if isinstance(doc, dict) else None
            if not isinstance(holder, dict):
                return HostLockInfo(None, None, None)
            if "unreadable" in holder:
                return HostLockInfo(None, None, None, f"lock file unreadable: {holder['unreadable']}")
            expires, now = holder.get("expires"), doc.get("now")
            left = (
                float(expires) - float(now)
                if isinstance(expires, (int, float)) and isinstance(now, (int, float))
                else None
            )
            alive = doc.get("alive")
            return HostLockInfo(holder, alive if isinstance(alive, bool) else None, left)
    if any(line.startswith(MARKER + "no-python") for line in lines):
        return HostLockInfo(None, None, None, "python3 not found")
    return HostLockInfo(None, None, None, "no output")


class HostLock(FactBase[HostLockInfo]):
    """
    Returns ``HostLockInfo``: the deploy run holding this host, if any.

    + path: the lock file (default ``layout.HOST_LOCK_FILE``)
    """

    argument_shapes = {"path": PATH}
    fast_check_inputs = Unknown("the doctor's: never read by a converge")

    def command(self, path: str = HOST_LOCK_FILE) -> str:
        return (
            "if command -v python3 >/dev/null 2>&1; then "
            f"python3 -c {quote(LOCK_SCRIPT)} {quote(path)} 2>&1 </dev/null; "
            f"else echo '{MARKER}no-python'; fi; true"
        )

    @staticmethod
    def default() -> HostLockInfo:
        return HostLockInfo(None, None, None, "no output")

    def process(self, output: list[str]) -> HostLockInfo:
        return parse_host_lock_output(output)
