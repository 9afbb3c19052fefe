"""Which image URLs may reach the engine. TensorRT-LLM workers fetch http(s) image URLs themselves, from
inside the cluster: a URL naming a loopback, link-local (cloud metadata), private or otherwise internal
address would let any client make the workers fetch from places only the cluster can reach (SSRF).

Default: a URL must not carry credentials, its host must resolve, and every address it resolves to must be
a public one. `limits.image_url_allowlist` lets an operator allow hosts (exact names) or networks (CIDR).
The check resolves the host once; the engine resolves it again when it fetches, so a name whose answers
change between the two (DNS rebinding) is not stopped here: deny such egress at the network too.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import attrs
import trio

from orchestrator.errors import InvalidRequest

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@attrs.frozen
class UrlPolicy:
    allowed_hosts: frozenset[str] = frozenset()
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    resolve_timeout_s: float = 2.0

    @classmethod
    def from_allowlist(cls, entries) -> UrlPolicy:
        hosts, networks = set(), []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower())
        return cls(frozenset(hosts), tuple(networks))

    def allows_address(self, address: Address) -> bool:
        return any(address in network for network in self.allowed_networks)


# NAT64's well-known prefix (RFC 6052): a translator on the path turns 64:ff9b::a.b.c.d into a.b.c.d.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address reaches through a transition mechanism: 6to4 (2002::/16), Teredo
    (2001::/32: its server and its client) and NAT64's well-known prefix. A packet to 2002:7f00:1:: goes to
    127.0.0.1 through a 6to4 relay, and the address itself looks global."""
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    if address in _NAT64:
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    return []


def internal_kind(address: Address) -> str | None:
    """Why an address is not a public one (None: it is). An IPv6 address that embeds IPv4 addresses must be
    public itself and embed only public ones."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
        else:
            for inner in embedded_ipv4(address):
                kind = internal_kind(inner)
                if kind is not None:
                    return kind
    for kind, test in (("loopback", address.is_loopback), ("unspecified", address.is_unspecified),
                       ("link-local", address.is_link_local), ("multicast", address.is_multicast),
                       ("private", address.is_private), ("reserved", address.is_reserved)):
        if test:
            return kind
    return None if address.is_global else "non-public"


async def check_image_urls(urls: list[tuple[str, str]], policy: UrlPolicy) -> None:
    """`urls`: (where, url) of every http(s) image. Raises InvalidRequest naming the part; the message never
    repeats credentials and never says more about the network than the kind of address refused."""
    for where, url in urls:
        param = f"{where}.image_url.url"
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            raise InvalidRequest(f"{param}: image URLs must not carry credentials (user:password@)", param=param,
                                 code="image_url_not_allowed")
        host = (parts.hostname or "").lower()
        if host in policy.allowed_hosts:
            continue
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise InvalidRequest(f"{param}: the URL's port is not a number", param=param) from None
        with trio.move_on_after(policy.resolve_timeout_s):
            try:
                answers = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
            except OSError:
                answers = []
            for *_, sockaddr in answers:
                address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
                kind = internal_kind(address)
                if kind is not None and not policy.allows_address(address):
                    raise InvalidRequest(f"{param}: the image host is not allowed: it resolves to a {kind} address "
                                         "(operators may allow it with limits.image_url_allowlist)", param=param,
                                         code="image_url_not_allowed")
            if answers:
                continue
        raise InvalidRequest(f"{param}: the image host {host!r} does not resolve", param=param,
                             code="image_url_not_allowed")
