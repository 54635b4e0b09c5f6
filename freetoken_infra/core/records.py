"""The run record: what a deploy run saw and did, per host, as JSON lines.

The deploy appends records to the file named by $FREETOKEN_RUN_RECORD (set by the rollout;
nothing is recorded without it): what the facts saw at preflight, the health gate's result, a
rollback, failed operations, and at disconnect whether pyinfra failed the host and how many
operations changed something. The operations write it, the report and the rollout read it:
one structured path, no console text scraped.
"""

from __future__ import annotations

import json
import os
from typing import Any

RECORD_ENV = "FREETOKEN_RUN_RECORD"


def record(host_name: str, **fields: Any) -> None:
    """Append one record for `host_name` to $FREETOKEN_RUN_RECORD (no-op when unset)."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({"host": host_name, **fields}, default=str)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def read_records(path: str) -> dict[str, list[dict[str, Any]]]:
    """The records of one deploy run, by host (a torn last line is ignored)."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return by_host
    for line in lines:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("host"), str):
            by_host.setdefault(doc["host"], []).append(doc)
    return by_host
