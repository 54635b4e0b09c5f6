"""What on the host each fact's answer depends on: the inputs of the no-op fast check.

A converge reads some 90 facts per host; on a host nothing touched since its last converge they
answer what they answered then. The host lock's script (``operations/scripts/host_lock.py``,
``digest``) records, at the end of a converge that changed nothing (or of a run the preflight
refused by a blocker that stands until the next boot), a cheap signature of every input of
every fact that run read, and the next run compares it in the same round trip as the lock,
before any fact is read. Only while every input is unchanged (and the controller's
settings and code are the same: ``preflight.fingerprint``) does the run skip the facts.

The inputs, as ``host_lock.py`` reads them (none of them run anything the host's users wrote):

- ``paths``: ``lstat`` of each (type, mode, owner, size, inode, mtime and ctime in ns). A non-root
  user cannot set a file's ctime: any change of content, mode or owner shows, also one undone.
- ``dirs``: type, mode, owner and inode only, for the facts that read a folder's own metadata
  (a folder's times change with every file made in it: the guard writes its samples every 30 s).
- ``globs``: each pattern's matches (sorted), each ``lstat``-ed.
- ``trees``: every entry below a folder (``lstat``, links not followed), up to a cap.
- ``units``: systemd's ActiveState, UnitFileState and LoadState of each (one ``systemctl show``).
- ``health``: the engine's ``/health`` answer (HTTP status and its status, version and model).
- ``nft``: nftables tables (``inet freetoken``): what ``nft list table`` prints for each now.
- always: the boot (``boot_id`` and PID 1's start): a WSL or Windows restart, a new GPU, driver
  or WSL version (each needs a restart of the WSL VM) is a new boot, so the facts that ask
  Windows, the GPU or the kernel (whose answers change only with a boot) need nothing else.

Each fact declares its inputs beside itself (``fast_check_inputs``, ``facts/_declare.py``; the
pyinfra facts the deploy reads in ``facts/pyinfra_reads.py``); ``facts/registry.py`` collects
them. ``inputs_of`` maps one fact request (the learned-request form of ``facts/batch.py``:
"module:Class" and its keyword arguments) to its inputs, and answers None for a fact whose
inputs are not known (none declared, or ``Unknown``): a converge that read such a fact records
no signature, so every run after it reads every fact.
"""

from __future__ import annotations

from typing import Any

from facts import registry
from facts._declare import BOOT_ONLY, Inputs, inputs_of_declared

__all__ = ["BOOT_ONLY", "Inputs", "inputs_of", "inputs_of_run"]


def inputs_of(fact: str, kwargs: dict[str, Any]) -> Inputs | None:
    """The inputs of one fact request (None: not known, so no signature can stand for it)."""
    declared = registry.fast_check_inputs().get(fact)
    return inputs_of_declared(declared, kwargs) if declared is not None else None


def inputs_of_run(requests: list[dict[str, Any]]) -> Inputs | str:
    """Every input of a run's fact requests (``facts.batch.asked``), or why there is none."""
    merged = Inputs()
    for request in requests:
        fact, kwargs = request.get("fact"), request.get("kwargs")
        found = inputs_of(fact, kwargs) if isinstance(fact, str) and isinstance(kwargs, dict) else None
        if found is None:
            return f"the run read {fact!r}, whose inputs are not known"
        merged.add(found)
    return merged
