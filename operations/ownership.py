"""Folders the deploy keeps, made and re-owned by root without following a link
(``scripts/own_dir.py``).

Every folder root creates or re-owns goes through ``owned_dir``: the script walks the path from
``/`` with ``O_NOFOLLOW`` descriptors and changes only what it holds open, so a less-trusted user
who can rename entries on the way cannot turn root's ``chown``/``chmod`` onto a link's target;
folders above the leaf that the deploy did not create keep their owner and mode.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from pyinfra import host
from pyinfra.operations import files, server

from facts.account import Account
from facts.ownership import DirOwnership, DirTree, components
from freetoken_infra.core.layout import OWN_DIR_SCRIPT
from operations.managed import script_source

SYSTEM_SHELL = "/usr/sbin/nologin"


def upload_script():
    """``own_dir.py`` under ``/usr/local/lib/freetoken`` (root's, 0644); nothing when in place."""
    yield from files.put._inner(
        src=script_source("own_dir.py"),
        dest=OWN_DIR_SCRIPT,
        user="root",
        group="root",
        mode="644",
        add_deploy_dir=False,
    )


def needs_change(
    tree: DirTree,
    path: str,
    owner: str,
    group: str,
    mode: str,
    reclaim: Iterable[str] = (),
) -> bool:
    """Whether ``own_dir.py`` has anything to do for ``path`` (from the ``DirOwnership`` fact):
    a component missing or not a plain folder (the script then refuses it, naming it), a folder
    above the leaf still owned by a ``reclaim`` user, the leaf's owner, group or mode, or
    something below the leaf still owned by the user to adopt from."""
    reclaim = set(reclaim)
    found = tree["components"]
    paths = components(path)
    for p in paths:
        entry = found.get(p)
        if entry is None or entry["kind"] != "directory":
            return True
        if p != paths[-1] and (entry["user"] in reclaim or entry["group"] in reclaim):
            return True
    leaf = found[paths[-1]]
    return (leaf["user"], leaf["group"], leaf["mode"]) != (owner, group, mode) or tree["adopt"]


def own_dir_argv(
    path: str, owner: str, group: str, mode: str, reclaim: Iterable[str] = (), adopt_from: str | None = None
) -> list[str]:
    argv = ["/usr/bin/python3", OWN_DIR_SCRIPT, "--path", path, "--owner", owner, "--group", group, "--mode", mode]
    for user in reclaim:
        argv += ["--reclaim", user]
    if adopt_from:
        argv += ["--adopt-from", adopt_from]
    return argv


def owned_dir(
    path: str,
    owner: str,
    group: str,
    mode: str = "755",
    reclaim: Iterable[str] = (),
    adopt_from: str | None = None,
):
    """Yield the command that makes ``path`` a folder ``owner:group mode``, or nothing when it
    already is (upload the script first: ``upload_script``).

    + reclaim: users whose folders above ``path`` go back to root:root 0755 (an earlier layout
      handed them the model's parent)
    + adopt_from: re-own to ``owner`` what this user still owns below ``path`` (migration)
    """
    reclaim = list(reclaim)
    tree = host.get_fact(DirOwnership, path=path, adopt_from=adopt_from)
    if needs_change(tree, path, owner, group, mode, reclaim):
        yield " ".join(shlex.quote(a) for a in own_dir_argv(path, owner, group, mode, reclaim, adopt_from))


def system_account(name: str, home: str):
    """A system account with no login shell; ``server.user`` (whose ``Users`` fact runs
    ``lastlog`` for every account) is asked only when it is missing or differs."""
    account = host.get_fact(Account, account=name)
    if account is None or (account["home"], account["shell"]) != (home, SYSTEM_SHELL):
        yield from server.user._inner(user=name, system=True, home=home, shell=SYSTEM_SHELL, ensure_home=False)
