"""Where the fleet reaches a host, and what a name resolves to on the controller.

One home for the address a host's ``ssh_hostname`` (else its inventory name) gives the rest of
the fleet: the gateway's backends and scrape config (operations/gateway.py), the firewall's
gateway addresses and the bind addresses of node_exporter and the LAN model cache
(freetoken_infra/plan.py).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# A name and a port (or None) -> the addresses it resolves to, in the resolver's order; OSError
# when it resolves to none. The plan takes one, so that its tests need no DNS.
Lookup = Callable[[str, int | None], list[str]]

# A DNS name (labels of letters, digits and inner '-', dot-separated, an optional final dot),
# matched over the whole string: what reaches haproxy.cfg, the scrape YAML or an nft rule is a
# host name or an IP literal, never a newline or a second directive.
_DNS_NAME_RE = re.compile(
    r"(?=.{1,253}\.?\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


class AddressError(Exception):
    """An address the fleet's files cannot hold, or one that does not resolve; the message
    names host and field."""


def lookup(name: str, port: int | None = None) -> list[str]:
    """The addresses `name` resolves to on the controller (``getaddrinfo``, TCP)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)]


def fleet_address(host_name: str, ssh_hostname: str | None) -> str:
    """Where the fleet reaches `host_name`: its ``ssh_hostname``, else its inventory name, as a
    host name or an IP literal (IPv6 without brackets); anything else is refused in one line."""
    field, value = ("ssh_hostname", ssh_hostname) if ssh_hostname is not None else ("name", host_name)
    if isinstance(value, str):
        text = value[1:-1] if value.startswith("[") and value.endswith("]") else value
        try:
            return str(ipaddress.ip_address(text))
        except ValueError:
            if _DNS_NAME_RE.fullmatch(value):
                return value
    raise AddressError(
        f"host {host_name}: {field} {value!r} is not a host name or an IP address "
        "(letters, digits, '-' and '.' only, or an IPv4/IPv6 literal)"
    )


def resolve(host_name: str, address: str, find: Lookup = lookup) -> list[Address]:
    """The IP addresses of `address` (an IP literal, or a name resolved on the controller)."""
    try:
        return [ipaddress.ip_address(address)]
    except ValueError:
        pass
    try:
        found = find(address, None)
    except OSError as exc:
        raise AddressError(
            f"host {host_name}: cannot resolve {address} on the controller ({exc}); "
            "give it an IP address as ssh_hostname, or list the address in firewall_engine_from"
        ) from None
    return sorted({ipaddress.ip_address(a.split("%")[0]) for a in found}, key=str)
