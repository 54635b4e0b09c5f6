"""What each fact declares beside itself, for the two fact registries.

A fact class (``facts/*.py``) carries two class attributes:

- ``argument_shapes``: each argument of its ``command()`` by name, with the shape a learned
  request's value must have to be replayed (``facts/batch.py``, ``allowed``): one of the shapes
  below (``PATH``, ``NAME``, ...). A name means one shape in every fact that uses it: the batch
  checks an argument by its name (``registry.argument_shapes`` refuses two shapes for one name).
  A fact without arguments declares nothing.
- ``fast_check_inputs``: what on the host its answer depends on (``facts/inputs.py``): an
  ``Inputs`` when its arguments do not matter (``BOOT_ONLY`` for an answer that changes only with
  a boot of the WSL VM), a function of its keyword arguments (``Inputs`` or None: not known for
  those), or ``Unknown(why)`` for a fact whose inputs cannot be known (a run that reads it
  records no signature).

``facts/registry.py`` collects them from the facts package (and ``facts/pyinfra_reads.py`` for
the few pyinfra facts the deploy reads); this module imports no fact, so every fact may import it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Shape = Callable[[Any], bool]

# --------------------------------------------------------------------------- argument shapes
_PATH_RE = re.compile(r"/[A-Za-z0-9 ._+@:,=~/-]{0,4095}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")


def PATH(v: Any) -> bool:
    """An absolute path of plain characters."""
    return isinstance(v, str) and bool(_PATH_RE.fullmatch(v))


def NAME(v: Any) -> bool:
    """A name (an account's, a unit's, a task's, a program's): nothing to run."""
    return isinstance(v, str) and bool(_NAME_RE.fullmatch(v))


def ADDRESS(v: Any) -> bool:
    """An IP address, as text."""
    try:
        ipaddress.ip_address(v)
    except ValueError:
        return False
    return isinstance(v, str)


def PORT(v: Any) -> bool:
    """A TCP port (an int, not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536


def PATH_OR_NONE(v: Any) -> bool:
    return v is None or PATH(v)


def NAME_OR_NONE(v: Any) -> bool:
    return v is None or NAME(v)


def PATHS(v: Any) -> bool:
    """A list of absolute paths."""
    return isinstance(v, list) and all(PATH(p) for p in v)


def NAMES(v: Any) -> bool:
    """A list of names."""
    return isinstance(v, list) and all(NAME(u) for u in v)


def FALSE(v: Any) -> bool:
    """Only False (an option the deploy never turns on)."""
    return v is False


def NONE(v: Any) -> bool:
    """Only None (an option the deploy never sets)."""
    return v is None


# --------------------------------------------------------------------------- fast-check inputs
DPKG_STATUS = "/var/lib/dpkg/status"
ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow")

_KINDS = ("paths", "dirs", "globs", "trees", "units", "health", "nft")


@dataclass
class Inputs:
    """What one or more facts depend on (merged with ``add``); ``to_json`` is what the host's
    script is given."""

    paths: set[str] = field(default_factory=set)
    dirs: set[str] = field(default_factory=set)
    globs: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    units: set[str] = field(default_factory=set)
    health: set[str] = field(default_factory=set)
    nft: set[str] = field(default_factory=set)  # nftables tables (`inet freetoken`): their live listing

    def add(self, other: Inputs) -> None:
        self.paths |= other.paths
        self.dirs |= other.dirs
        self.globs |= other.globs
        self.trees |= other.trees
        self.units |= other.units
        self.health |= other.health
        self.nft |= other.nft

    def copy(self) -> Inputs:
        return Inputs(*(set(getattr(self, k)) for k in _KINDS))

    def to_json(self) -> dict[str, list[str]]:
        return {k: sorted(getattr(self, k)) for k in _KINDS}

    def __len__(self) -> int:
        return sum(len(v) for v in self.to_json().values())


BOOT_ONLY = Inputs()  # answers that change only with a boot (always part of the signature)


@dataclass(frozen=True)
class Unknown:
    """A fact whose inputs cannot be known, and why: a run that reads it records no signature,
    so every run after it reads every fact."""

    why: str


InputsOf = Callable[[dict[str, Any]], Inputs | None]
Declared = Inputs | InputsOf | Unknown


def path_arg(kwargs: dict[str, Any], name: str) -> str | None:
    """The argument ``name`` when it is an absolute path (else None)."""
    value = kwargs.get(name)
    return value if isinstance(value, str) and value.startswith("/") else None


def fixed_paths(*paths: str | None) -> Inputs:
    return Inputs(paths={p for p in paths if p})


def one_path(name: str) -> InputsOf:
    """The ``lstat`` of the path the argument ``name`` names."""

    def inputs(kwargs: dict[str, Any]) -> Inputs | None:
        path = path_arg(kwargs, name)
        return None if path is None else fixed_paths(path)

    return inputs


def one_dir(name: str) -> InputsOf:
    """A folder's own metadata (type, mode, owner, inode), not its times."""

    def inputs(kwargs: dict[str, Any]) -> Inputs | None:
        path = path_arg(kwargs, name)
        return None if path is None else Inputs(dirs={path})

    return inputs


def tree(name: str) -> InputsOf:
    """The folder the argument ``name`` names and every entry below it."""

    def inputs(kwargs: dict[str, Any]) -> Inputs | None:
        path = path_arg(kwargs, name)
        return None if path is None else Inputs(paths={path}, trees={path})

    return inputs


def units(kwargs: dict[str, Any]) -> Inputs | None:
    """systemd's state of the ``services`` (system units only)."""
    services = kwargs.get("services")
    if kwargs.get("user_mode") or kwargs.get("machine") or not isinstance(services, list):
        return None
    return Inputs(units={s for s in services if isinstance(s, str)})


def inputs_of_declared(declared: Declared, kwargs: dict[str, Any]) -> Inputs | None:
    """What one declaration says for one request's arguments (a fresh copy; None: not known)."""
    if isinstance(declared, Unknown):
        return None
    if isinstance(declared, Inputs):
        return declared.copy()
    return declared(kwargs)
