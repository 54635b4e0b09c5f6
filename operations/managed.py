"""Managed files: one way for an operation to write the files it owns and act on their change.

An operation declares its files (``ManagedFile``: where, what, mode, whether it is a systemd
unit, written atomically, or holds secrets) and hands them to ``put``, inside its own generator:

.. code:: python

    changed = yield from managed.put(
        ManagedFile(RULES, text=ruleset(settings)),
        ManagedFile(UNIT_PATH, text=unit(), unit=True),
    )
    yield from managed.running(FIREWALL_UNIT, changed=bool(changed), reload=True)

``put`` yields the commands that make each file so (none when it already is: a no-op run yields
nothing and reads the same facts as pyinfra's ``files.put``), prints every file's diff before
its first command (pyinfra's change detection stops at the first), runs ``systemctl
daemon-reload`` once when a unit among them changed, and returns the paths it wrote, so that
the operation restarts or reloads what they configure (``running``) and nothing else.

Every file is root's (``root:root``). How a file is compared and written:

* by default pyinfra's ``files.put``: its size and SHA-1 (the ``File`` and ``Sha1File`` facts),
  owner and mode checked, pyinfra's own diff (secrets masked, ``operations/preview.py``);
* ``atomic``: compared by its text (``FileText``), uploaded beside it and renamed over it, so
  that a run cut mid-upload leaves the old file whole (the next run, seeing it differ, writes it
  again); the diff is ours, pyinfra's would name the temporary file;
* ``secret``: the diff is printed as an environment file's, secret values masked
  (``preview.log_env_diff``), pyinfra's held off.

An atomic file's owner and mode are checked even when its text is right: a loosened mode is a
leak (a secret) or a way into root (a unit file any user could edit; the drift tests,
tests/fleet/test_drift.py, make one world-writable).
"""

from __future__ import annotations

import io
import os
import shlex
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from pyinfra import host
from pyinfra.operations import files, systemd

from facts.files import FileText
from operations import preview

# This checkout's host scripts (operations/scripts/): what the operations upload.
SCRIPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def script_source(name: str) -> str:
    """The local copy of the host script ``name`` (``operations/scripts/NAME``), to upload."""
    return os.path.join(SCRIPTS_DIR, name)


@dataclass(frozen=True)
class ManagedFile:
    """A file the deploy owns: its ``text``, or a ``local`` file on the controller (a script)."""

    path: str
    text: str | None = None
    local: str | None = None
    mode: str = "644"
    unit: bool = False  # a systemd unit or drop-in: systemd reloads when it changes
    atomic: bool = False
    secret: bool = False

    def __post_init__(self) -> None:
        if (self.text is None) == (self.local is None):
            raise ValueError(f"{self.path}: a managed file has either text or a local file")
        if self.local is not None and (self.atomic or self.secret):
            raise ValueError(f"{self.path}: an atomic or secret managed file is given as text")


def put(*managed: ManagedFile) -> Generator[Any, None, frozenset[str]]:
    """The commands that make each file so, then ``systemctl daemon-reload`` when a unit changed;
    returns the paths written (owner or mode put right counts: what reads it may have failed)."""
    planned = [(file, list(_converge(file))) for file in managed]  # every diff before the first command
    for _, commands in planned:
        yield from commands
    changed = frozenset(file.path for file, commands in planned if commands)
    if any(file.unit and file.path in changed for file in managed):
        yield from systemd.daemon_reload._inner()
    return changed


def running(unit: str, changed: bool, reload: bool = False) -> Generator[Any, None, None]:
    """``unit`` enabled and running; restarted when its files ``changed`` (``reload``: reloaded,
    for a unit whose ``ExecReload=`` takes the new files in without a stop)."""
    yield from systemd.service._inner(
        service=unit,
        running=True,
        enabled=True,
        restarted=changed and not reload,
        reloaded=changed and reload,
    )


def _converge(file: ManagedFile) -> Generator[Any, None, None]:
    if file.atomic:
        yield from _put_atomically(file)
        return
    src: Any = file.local if file.text is None else io.StringIO(file.text)
    args = dict(src=src, dest=file.path, user="root", group="root", mode=file.mode, add_deploy_dir=False)
    if not file.secret:
        yield from files.put._inner(**args)
        return
    if preview.diff_wanted():  # --diff: whether a secret changes, never its value
        preview.log_env_diff(file.path, host.get_fact(FileText, path=file.path), file.text or "")
    yield from preview.put_without_pyinfra_diff(**args)


def _put_atomically(file: ManagedFile) -> Generator[Any, None, None]:
    text = file.text or ""
    current = host.get_fact(FileText, path=file.path)
    if file.secret:
        preview.log_env_diff(file.path, current, text)
    else:
        before = None if current is None else preview.text_lines(current)
        preview.log_diff(file.path, before, preview.text_lines(text))
    if current != text:
        tmp = f"{file.path}.new"
        yield from preview.put_without_pyinfra_diff(
            src=io.StringIO(text), dest=tmp, user="root", group="root", mode=file.mode
        )
        yield f"mv -f {shlex.quote(tmp)} {shlex.quote(file.path)}"
    else:  # a loosened mode is a leak (secret) or a way into root (a unit any user could edit)
        yield from files.file._inner(path=file.path, user="root", group="root", mode=file.mode)
