"""systemd unit files and drop-ins as data, written by one function.

Every unit the deploy writes (the engine, the guard's service and timer, the model's fetch and
cache services, the firewall, node_exporter's drop-in) is a ``UnitFile``: the comment on top,
then its sections in order, each an ordered list of ``(key, value)`` settings and comments. A
key may repeat (two ``ExecStartPre=``, or ``ExecStart=`` with an empty value to reset the
package's own in a drop-in). ``render`` turns one into the text uploaded: one way, so that every
unit has the same layout and a change to it is a change to data.

Values are written as given: a value built from settings goes through ``unit_word`` or
``unit_command`` (systemd's own quoting and specifier escapes) where it is declared, since
what a word needs depends on the setting it is in. ``render`` refuses a line break anywhere (a
value with one would add a setting of its choosing) and a key that is not a plain name.

Standard library only, no pyinfra: tested in ``tests/unit/test_units.py`` against the text of
every unit as it was pinned before this module existed.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass

_KEY = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_SECTION = re.compile(r"[A-Za-z][A-Za-z0-9-]*")


@dataclass(frozen=True)
class Comment:
    """A comment among the settings: each line of ``text`` written as ``# line``."""

    text: str


Entry = tuple[str, str] | Comment


@dataclass(frozen=True)
class Section:
    """``[name]`` and its settings, in order: ``(key, value)`` pairs (a key may repeat) and
    comments."""

    name: str
    entries: tuple[Entry, ...]


@dataclass(frozen=True)
class UnitFile:
    """A unit file or drop-in: the comment on top (who writes it), then its sections."""

    header: str
    sections: tuple[Section, ...]


def managed_by(module: str) -> str:
    """The comment on top of a unit written by ``module`` (``operations/guard.py``)."""
    return f"Managed by freetoken-infra ({module}); changes here are overwritten."


def _comment(text: str) -> list[str]:
    return [f"# {line}" for line in text.split("\n")]


def render(unit: UnitFile) -> str:
    """The text of ``unit``: the header comment, each section's ``[name]`` and its lines, a blank
    line between sections, a line break at the end."""
    lines = _comment(unit.header)
    for i, section in enumerate(unit.sections):
        if not _SECTION.fullmatch(section.name):
            raise ValueError(f"not a unit section name: {section.name!r}")
        if i:
            lines.append("")
        lines.append(f"[{section.name}]")
        for entry in section.entries:
            if isinstance(entry, Comment):
                lines += _comment(entry.text)
                continue
            key, value = entry
            if not _KEY.fullmatch(key):
                raise ValueError(f"[{section.name}]: not a unit setting name: {key!r}")
            lines.append(f"{key}={value}")
    for line in lines:
        if "\n" in line or "\r" in line:
            raise ValueError(f"a line break inside a unit line: {line!r}")
    return "\n".join(lines) + "\n"


def unit_word(value: str, variables: bool = True) -> str:
    """One word of a unit file line, as systemd reads it back.

    systemd expands ``%`` specifiers in every setting, splits list and command lines on
    whitespace (quotes and backslashes are its escapes) and expands ``$VAR`` in the arguments of
    ``Exec*=`` lines only: ``variables=False`` for an executable path or a path list
    (``ReadWritePaths=``), where a doubled ``$$`` would stay doubled. A lone ``;`` would end the
    command.
    """
    value = value.replace("%", "%%")
    if variables:
        value = value.replace("$", "$$")
    if value == ";":
        return "\\;"
    if any(c in value for c in " \t\"'\\"):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def unit_command(argv: Sequence[str]) -> str:
    """An ``Exec*=`` line's value: the executable path (no ``$`` expansion there), then its
    arguments, each escaped for systemd."""
    return " ".join([unit_word(argv[0], variables=False), *(unit_word(a) for a in argv[1:])])


_PLAIN_ROOT = re.compile(r"/[A-Za-z0-9._/-]*")


def no_windows(drive_root: str) -> tuple[Entry, ...]:
    """The settings that close a unit off from Windows (docs/security.md, "What WSL shares with
    every Linux user"), for every unit that has no business there: the engine, the download, the
    LAN cache, the guard.

    On WSL every Linux account can start Windows programs as the PC's owner, and ``wsl.exe -u
    root`` as root in the distro: WSL's interop socket (``/run/WSL/1_interop``, mode 0777) and
    the binfmt handler (``/init``) are every process's. The interop client opens an ``AF_VSOCK``
    socket for the program's input and output, so a unit allowed only the families below cannot
    run one; the socket's folder and ``/init`` are hidden as well. The Windows drives (DrvFs:
    every file mode 0777, every access made as the owner) are an empty read-only folder:
    ``/mnt`` (WSL's shared ``/mnt/wsl`` too), and the automount root ``drive_root`` when wsl.conf
    moved the drives elsewhere (at ``/`` each drive letter's folder is made inaccessible)."""
    root = "/" + drive_root.strip("/")
    if not _PLAIN_ROOT.fullmatch(root):
        raise ValueError(f"not a plain automount root: {drive_root!r}")
    hidden = ["/mnt"]
    inaccessible = ["-/run/WSL", "-/init"]
    if root == "/":
        inaccessible += [f"-/{letter}" for letter in string.ascii_lowercase]
    elif root != "/mnt" and not root.startswith("/mnt/"):
        hidden.append(root)
    return (
        Comment(
            "No way to Windows: WSL's interop socket (0777, every account's) and /init hidden, AF_VSOCK (the\n"
            "interop client's channel) refused, the Windows drives (DrvFs: 0777, the owner's) an empty folder."
        ),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6 AF_NETLINK"),
        ("InaccessiblePaths", " ".join(inaccessible)),
        ("TemporaryFileSystem", " ".join(f"{path}:ro" for path in hidden)),
    )
