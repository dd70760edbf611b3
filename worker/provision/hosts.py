"""Where a download may connect: https to a public host name, checked at every hop and connection.

A model, an engine release or an update comes from a URL someone else chose, and every redirect
is a URL the server chose. None of them may reach this machine or its local network: a download
that could be sent to `http://192.168.1.1/` or `https://localhost:8080/` would make the node a
port scanner (and, through its refusal's words, a file reader) for whoever sent the URL. So:

- every URL, the first and each redirect's, is `https://` with a host *name* of two or more labels
  ending in a letter: no IP literal in any spelling (`127.1`, `0x7f.1`, `[::1]`, `2130706433`),
  no single-label LAN name (`localhost`, `nas`) — `url_refusal`, before anything is looked up;
- the name is looked up once, every address it has must be public (`is_global`, no multicast, no
  local IPv4 inside an IPv6 form), and the connection goes to those checked addresses (the next
  when one cannot be reached), with TLS still verifying the name: a name that resolves to a local
  address, or answers differently between a check and a connect, cannot get through;
- no proxy from the environment (a proxy would connect for us, past the check).

The host policy is an argument that denies by default (`PUBLIC_HOSTS`); nothing in the app — no
setting, no environment variable — chooses another. Tests that serve files on 127.0.0.1 bring their
own. huggingface_hub's client gets the same guard (`worker.provision.hf`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Protocol

import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

NOT_HTTPS = "it would leave https"
NOT_A_NAME = "it names an IP address or a host without a domain, not a public host name"
LOCAL_HOST = "its host is on this machine or a local network"
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST_NAME = re.compile(rf"(?:{_LABEL}\.)+[a-z](?:[a-z0-9-]{{0,61}}[a-z0-9])?")
_MAX_HOST_CHARS = 253
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
MAX_ADDRESSES = 4  # tried in turn when one cannot be reached (an IPv6 route that is not there)


@dataclass(eq=False)
class HostRefused(Exception):
    """A download would have gone where downloads may not go; nothing was sent there.

    `reason` is one of this module's fixed phrases: it never carries anything a server sent.
    """

    reason: str

    def __str__(self) -> str:
        return self.reason


class HostPolicy(Protocol):
    """Which addresses a download may connect to, for a host name that passed `url_refusal`."""

    def addresses_for(self, host: str, port: int) -> list[IPAddress]:
        """The addresses to connect to, in turn; `HostRefused` if `host` may not be reached,
        `OSError` if it cannot be looked up. Blocks (a name lookup): call it from a thread."""
        ...


@dataclass(frozen=True)
class PublicHosts:
    """The app's policy: every address the name has must be a public one."""

    def addresses_for(self, host: str, port: int) -> list[IPAddress]:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return only_public([ipaddress.ip_address(info[4][0]) for info in found])


PUBLIC_HOSTS = PublicHosts()


def only_public(addresses: list[IPAddress]) -> list[IPAddress]:
    """The first few of `addresses`, once each, when all are public; a name with one local address
    is refused whole."""
    if not addresses or not all(_public(address) for address in addresses):
        raise HostRefused(LOCAL_HOST)
    return list(dict.fromkeys(addresses))[:MAX_ADDRESSES]


def _public(address: IPAddress) -> bool:
    if not address.is_global or address.is_multicast:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        inside = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
        if address in _NAT64:
            inside.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        return all(v4 is None or _public(v4) for v4 in inside)
    return True


def url_refusal(scheme: str, raw_host: bytes) -> str | None:
    """Why a URL with this scheme and host (as sent: IDNA-encoded) may not be fetched, or None."""
    if scheme != "https":
        return NOT_HTTPS
    host = raw_host.decode("ascii", "replace").lower()
    if len(host) > _MAX_HOST_CHARS or not _HOST_NAME.fullmatch(host):
        return NOT_A_NAME
    return None


def checked_addresses(hosts: HostPolicy, scheme: str, raw_host: bytes, port: int | None) -> list[IPAddress]:
    """The addresses a request may connect to, by the URL's form and then by `hosts`; blocks."""
    refusal = url_refusal(scheme, raw_host)
    if refusal is not None:
        raise HostRefused(refusal)
    return hosts.addresses_for(raw_host.decode("ascii"), port or 443)


class _GuardedTransport(httpx.AsyncBaseTransport):
    """Every request (each redirect hop is one) checked, then sent to an address that was checked."""

    def __init__(self, hosts: HostPolicy, inner: httpx.AsyncBaseTransport) -> None:
        self._hosts = hosts
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        try:
            addresses = await asyncio.to_thread(checked_addresses, self._hosts, url.scheme, url.raw_host, url.port)
        except OSError as exc:
            raise httpx.ConnectError(f"cannot look up {url.host} ({exc})", request=request) from exc
        for address in addresses[:-1]:
            try:
                return await self._inner.handle_async_request(_pinned(request, address))
            except httpx.ConnectError:
                continue
        return await self._inner.handle_async_request(_pinned(request, addresses[-1]))

    async def aclose(self) -> None:
        await self._inner.aclose()


def _pinned(request: httpx.Request, address: IPAddress) -> httpx.Request:
    """`request` sent to `address`, still asking for (Host) and verifying (SNI) the name."""
    return httpx.Request(
        request.method,
        request.url.copy_with(host=str(address)),
        headers=request.headers,
        stream=request.stream,
        extensions={**request.extensions, "sni_hostname": request.url.raw_host.decode("ascii")},
    )


def download_client(
    hosts: HostPolicy = PUBLIC_HOSTS, *, verify: ssl.SSLContext | bool = True, timeout_s: float = 30.0
) -> httpx.AsyncClient:
    """An httpx client for downloads whose every request goes only where `hosts` allows.

    It follows no redirect unless a request asks (the downloader follows them itself); with an
    explicit transport httpx takes no proxy from the environment, and `trust_env=False` no netrc.
    The system's certificate settings (`SSL_CERT_FILE`) still apply.
    """
    inner = httpx.AsyncHTTPTransport(verify=verify)
    return httpx.AsyncClient(
        transport=_GuardedTransport(hosts, inner), timeout=httpx.Timeout(timeout_s), trust_env=False
    )
