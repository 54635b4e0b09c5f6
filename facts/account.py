"""One account's passwd entry: what the engine's service user operation checks before it hands
the account to pyinfra's ``server.user`` (whose ``Users`` fact runs ``lastlog`` for every
account on the host: the costliest command of a no-op run's fact batch)."""

from __future__ import annotations

from typing import TypedDict

from pyinfra.api import FactBase

from ._declare import ACCOUNT_FILES, NAME, Inputs
from ._output import quote


class PasswdEntry(TypedDict):
    name: str
    uid: int
    gid: int
    home: str
    shell: str


class Account(FactBase[PasswdEntry | None]):
    """
    Returns the account's passwd entry (``getent passwd NAME``: local files or NSS), or None
    when there is no such account.
    """

    argument_shapes = {"account": NAME}
    fast_check_inputs = Inputs(paths=set(ACCOUNT_FILES))

    def command(self, account: str) -> str:
        return f"getent passwd {quote(account)} || true"

    def process(self, output: list[str]) -> PasswdEntry | None:
        fields = output[0].split(":") if len(output) == 1 else []
        if len(fields) != 7 or not fields[2].isdigit() or not fields[3].isdigit():
            return None
        return PasswdEntry(name=fields[0], uid=int(fields[2]), gid=int(fields[3]), home=fields[5], shell=fields[6])

    @staticmethod
    def default() -> PasswdEntry | None:
        return None
