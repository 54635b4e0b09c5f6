"""Who owns each folder on the way to a directory the deploy keeps (``operations/ownership.py``),
read without acting: ``stat`` of every component (the last one not followed when it is a link)
and whether anything below the leaf still belongs to a given user (``find -P``: no link
followed). Only the decision whether to run ``own_dir.py`` rests on it; that script acts
without following links, whatever this read saw."""

from __future__ import annotations

from typing import Any, TypedDict

from pyinfra.api import FactBase

from ._declare import NAME_OR_NONE, PATH, Inputs, path_arg
from ._output import quote


class Entry(TypedDict):
    user: str
    group: str
    mode: str
    kind: str


class DirTree(TypedDict):
    # path -> its stat; a component that does not exist is absent
    components: dict[str, Entry]
    # something below the leaf still belongs to ``adopt_from``
    adopt: bool


def components(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _inputs(kwargs: dict[str, Any]) -> Inputs | None:
    path = path_arg(kwargs, "path")
    if path is None:
        return None
    # Adopting asks whether anything below is still the old user's: every entry's owner.
    return Inputs(dirs=set(components(path)), trees={path} if kwargs.get("adopt_from") else set())


class DirOwnership(FactBase[DirTree]):
    """
    Returns ``{"components": {path: {"user", "group", "mode", "kind"}}, "adopt": bool}`` for
    ``path`` and each folder above it.
    """

    # adopt_from: an account's name
    argument_shapes = {"path": PATH, "adopt_from": NAME_OR_NONE}
    fast_check_inputs = _inputs

    def command(self, path: str, adopt_from: str | None = None) -> str:
        paths = " ".join(quote(p) for p in components(path))
        cmd = f"stat -c '@%U|%G|%a|%F|%n' -- {paths} 2>/dev/null; "
        if adopt_from:
            user = quote(adopt_from)
            cmd += (
                f"getent passwd {user} >/dev/null && test -d {quote(path)} && ! test -L {quote(path)} && "
                f"find -P {quote(path)} -mindepth 1 -user {user} -print -quit 2>/dev/null | "
                "grep -q . && echo @@adopt; "
            )
        return cmd + "true"

    def process(self, output: list[str]) -> DirTree:
        found: dict[str, Entry] = {}
        adopt = False
        for line in output:
            if line == "@@adopt":
                adopt = True
                continue
            fields = line[1:].split("|") if line.startswith("@") else []
            if len(fields) == 5:
                user, group, mode, kind, name = fields
                found[name] = Entry(user=user, group=group, mode=mode, kind=kind)
        return DirTree(components=found, adopt=adopt)

    @staticmethod
    def default() -> DirTree:
        return DirTree(components={}, adopt=False)
