"""The live nftables table of the deploy's firewall (operations/firewall.py), as the kernel has it
now, beside the listing its unit recorded right after loading it."""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra.api import FactBase

from freetoken_infra.core.layout import FIREWALL_LOADED, FIREWALL_NFT, FIREWALL_TABLE

from ._declare import Inputs
from ._output import b64decode_lines, section_map


@dataclass(frozen=True)
class FirewallTableInfo:
    live: str | None  # `nft list table inet freetoken` now (None: no such table, or no nft)
    loaded: str | None  # what it listed right after the unit loaded it (None: never loaded this boot)

    @property
    def intact(self) -> bool:
        """The table is there and lists as it did when the unit loaded it."""
        return self.live is not None and self.live == self.loaded


def _text(secs: dict, name: str) -> str | None:
    if name not in secs:
        return None
    data = b64decode_lines(secs[name][1])
    return None if data is None or not data.strip() else data.decode("utf-8", "replace")


class FirewallTable(FactBase[FirewallTableInfo]):
    """
    Returns ``FirewallTableInfo``: the deploy's nftables table as the kernel lists it now and as
    its unit listed it right after loading it. A ``oneshot`` unit stays ``active`` after
    ``nft flush ruleset``; this is what notices.
    """

    # The live table (a flush leaves its oneshot unit `active`) and its loaded listing.
    fast_check_inputs = Inputs(paths={FIREWALL_LOADED}, nft={f"inet {FIREWALL_TABLE}"})

    def command(self) -> str:
        return (
            f"if [ -x {FIREWALL_NFT} ]; then echo '@@ft:live'; "
            f"{FIREWALL_NFT} list table inet {FIREWALL_TABLE} 2>/dev/null | base64; fi; "
            f"if [ -f {FIREWALL_LOADED} ] && [ ! -L {FIREWALL_LOADED} ]; then echo '@@ft:loaded'; "
            f"head -c 262144 {FIREWALL_LOADED} | base64; fi; true"
        )

    @staticmethod
    def default() -> FirewallTableInfo:
        return FirewallTableInfo(None, None)

    def process(self, output: list[str]) -> FirewallTableInfo:
        secs = section_map(output)
        return FirewallTableInfo(_text(secs, "live"), _text(secs, "loaded"))
