"""One fake host for every operation's unit tests: pyinfra facts answered from tables, and the
commands an operation's generator yields against them.

An operation is tested as pyinfra's own operation tests do it (facts in, commands out): what it
yields on a bare host, nothing on a converged one, the right commands for each drift. The host is
a real pyinfra ``Host`` in a real ``State`` (so ``host.noop``, ``host.data`` and ``--diff`` work
as in a run) whose ``get_fact`` answers from these tables; a fact the tables cannot answer fails
the test (an operation that asks for something new must say what it expects).

Tables:
- ``files``: path -> text, bytes or (text, mode) (mode as pyinfra's ``File`` fact gives it, 644);
  answers ``File``, ``FileText``, ``FileBytes``, ``FileContents``, ``Sha1File``, ``Sha256File``,
  ``WindowsFile``.
  A file's folders exist.
- ``dirs``: folders (root:root 755), or path -> (user, group, mode); answers ``Directory`` and
  ``DirOwnership``. The folders above a file or folder of the tables exist (root:root 755), and
  so do the system folders every Debian host has (``SYSTEM_DIRS``).
- ``links``: path -> target (``Link``); ``WindowsFile`` (which follows no link) refuses a path
  that is one or has one on the way.
- ``packages``: Debian packages installed (``DebPackages``).
- ``running``, ``enabled``: systemd units (``SystemdStatus``, ``SystemdEnabled``).
- ``accounts``: name -> home, with the system shell (``Account``).
- ``facts``: any other fact by class name: a value, or a callable given the fact's arguments.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State
from pyinfra.context import ctx_host, ctx_state

FileValue = str | bytes | tuple[str | bytes, int]

# Folders every Debian host has (root:root 0755).
SYSTEM_DIRS = frozenset(
    {
        "/",
        "/etc",
        "/etc/apt",
        "/etc/apt/sources.list.d",
        "/etc/apt/preferences.d",
        "/etc/profile.d",
        "/etc/systemd",
        "/etc/systemd/system",
        "/opt",
        "/usr",
        "/usr/local",
        "/usr/local/lib",
        "/var",
        "/var/lib",
        "/var/cache",
        "/tmp",
    }
)


class FakeHost:
    def __init__(
        self,
        files: Mapping[str, FileValue] | None = None,
        dirs: Iterable[str] | Mapping[str, tuple[str, str, str]] = (),
        links: Mapping[str, str] | None = None,
        packages: Iterable[str] = (),
        running: Iterable[str] = (),
        enabled: Iterable[str] = (),
        accounts: Mapping[str, str] | None = None,
        facts: Mapping[str, Any] | None = None,
        name: str = "@local",
        data: Mapping[str, Any] | None = None,
        diff: bool = False,
    ) -> None:
        self.files = {path: _file(value) for path, value in (files or {}).items()}
        given = dirs if isinstance(dirs, Mapping) else dict.fromkeys(dirs, ("root", "root", "755"))
        self.dirs: dict[str, tuple[str, str, str]] = {d: ("root", "root", "755") for d in SYSTEM_DIRS}
        for path in [*self.files, *given]:  # a file's or a folder's folders exist
            for parent in _parents(path):
                self.dirs.setdefault(parent, ("root", "root", "755"))
        self.dirs.update(given)
        self.links = dict(links or {})
        self.packages = set(packages)
        self.running, self.enabled = set(running), set(enabled)
        self.accounts = dict(accounts or {})
        self.facts = dict(facts or {})
        self.name, self.data, self.diff = name, dict(data or {}), diff
        self.noops: list[str] = []
        self.state: State | None = None  # the last run's, for a test that looks at it
        self.asked: list[tuple[str, dict[str, Any]]] = []

    # ----------------------------------------------------------------------- running an operation

    def commands(self, op: Any, *args: Any, **kwargs: Any) -> list[str]:
        """What ``op`` yields on this host, one string each: a shell command as it would run,
        ``upload DEST`` for an upload, ``call NAME`` for an execution-time callback."""
        return [_render(c) for c in self.yielded(op, *args, **kwargs)]

    def yielded(self, op: Any, *args: Any, **kwargs: Any) -> list[Any]:
        """The command objects ``op`` yields on this host (for a test that looks inside one)."""
        inventory = Inventory(([(self.name, self.data)], {}))
        state = self.state = State(inventory, Config(DIFF=self.diff))
        host = inventory.get_host(self.name)
        host.get_fact = self.get_fact  # type: ignore[method-assign]
        host.noop = self.noops.append  # type: ignore[method-assign]
        with ctx_state.use(state), ctx_host.use(host):
            return list(op._inner(*args, **kwargs))

    # ----------------------------------------------------------------------- facts

    def get_fact(self, cls: type, *args: Any, **kwargs: Any) -> Any:
        name = cls.__name__
        self.asked.append((name, kwargs))
        if name in self.facts:
            value = self.facts[name]
            return value(**kwargs) if callable(value) and not isinstance(value, type) else value
        answer: Callable[..., Any] | None = getattr(self, f"_fact_{name}", None)
        if answer is None:
            raise AssertionError(f"unexpected fact {name}({kwargs})")
        return answer(**kwargs)

    def _fact_File(self, path: str) -> dict[str, Any] | None:
        if path not in self.files:
            return None
        data, mode = self.files[path]
        return {"user": "root", "group": "root", "mode": mode, "size": len(data)}

    def _fact_Directory(self, path: str) -> dict[str, Any] | None:
        if path.rstrip("/") not in self.dirs and path not in self.dirs:
            return None
        user, group, mode = self.dirs.get(path.rstrip("/")) or self.dirs[path]
        return {"user": user, "group": group, "mode": int(mode)}

    def _fact_Link(self, path: str) -> dict[str, Any] | None:
        if path not in self.links:
            return None
        return {"link_target": self.links[path], "user": "root", "group": "root", "mode": 777}

    def _fact_FileBytes(self, path: str) -> bytes | None:
        return self.files[path][0] if path in self.files else None

    def _fact_WindowsFile(self, path: str) -> Any:
        from facts.windows import WindowsFileBytes

        for p in [*reversed(_parents(path)), path]:
            if p in self.links:
                return WindowsFileBytes(None, f"{p} is a symbolic link", "link")
        return WindowsFileBytes(self._fact_FileBytes(path))

    def _fact_FileText(self, path: str) -> str | None:
        data = self._fact_FileBytes(path)
        return None if data is None else data.decode("utf-8", "replace")

    def _fact_FileContents(self, path: str) -> list[str] | None:
        text = self._fact_FileText(path)
        return None if text is None else text.splitlines()

    def _fact_Sha1File(self, path: str) -> str | None:
        return hashlib.sha1(self.files[path][0]).hexdigest() if path in self.files else None

    def _fact_Sha256File(self, path: str) -> str | None:
        return hashlib.sha256(self.files[path][0]).hexdigest() if path in self.files else None

    def _fact_DebPackages(self) -> dict[str, list[str]]:
        return {p: ["1"] for p in self.packages}

    def _fact_SystemdStatus(self, services: Iterable[str], **_: Any) -> dict[str, bool]:
        return {s: s in self.running for s in services}

    def _fact_SystemdEnabled(self, services: Iterable[str], **_: Any) -> dict[str, bool]:
        return {s: s in self.enabled for s in services}

    def _fact_TmpDir(self) -> str:
        return "/tmp"

    def _fact_Account(self, account: str) -> dict[str, Any] | None:
        from operations.ownership import SYSTEM_SHELL

        if account not in self.accounts:
            return None
        return {"name": account, "uid": 999, "gid": 999, "home": self.accounts[account], "shell": SYSTEM_SHELL}

    def _fact_Users(self) -> dict[str, dict[str, Any]]:  # pyinfra's, asked by server.user
        from operations.ownership import SYSTEM_SHELL

        return {
            name: {"home": home, "shell": SYSTEM_SHELL, "group": name, "groups": [], "uid": 999, "gid": 999}
            for name, home in self.accounts.items()
        }

    def _fact_Which(self, command: str) -> str:
        return f"/usr/sbin/{command}"

    def _fact_Os(self) -> str:
        return "Linux"

    def _fact_Groups(self) -> list[str]:  # pyinfra's, asked by server.user
        return list(self.accounts)

    def _fact_DirOwnership(self, path: str, adopt_from: str | None = None) -> Any:
        from facts.ownership import DirTree, Entry, components

        found = {}
        for p in components(path):
            if p in self.dirs:
                user, group, mode = self.dirs[p]
                found[p] = Entry(user=user, group=group, mode=mode, kind="directory")
        return DirTree(components=found, adopt=False)


def _file(value: FileValue) -> tuple[bytes, int]:
    data, mode = value if isinstance(value, tuple) else (value, 644)
    return (data.encode() if isinstance(data, str) else data), mode


def _parents(path: str) -> list[str]:
    out = []
    while (path := os.path.dirname(path)) not in ("/", ""):
        out.append(path)
    return out


def _render(command: Any) -> str:
    if isinstance(command, str):
        return command
    if isinstance(command, FileUploadCommand):
        return f"upload {command.dest}"
    if isinstance(command, FunctionCommand):
        return f"call {command.function.__name__}"
    return str(command.get_raw_value())
