"""Hostile download sources and redirects, and hostile local paths: nothing reaches past the node.

A coordinator chooses model URLs and update offers, and the servers behind them choose redirects.
A node that followed them anywhere would be a port scanner and a small-file reader for the
provider's home network, with the refusal it sends back as the read-out. Here the attacker's server
is the test HTTPS server under a public-looking name; the home network is a second server on
127.0.0.1 that counts every connection it accepts, and must accept none. A hostile DNS is a fake
`socket.getaddrinfo`. The app's own host policy is used wherever the tests' (which lets the two
public-looking names live on 127.0.0.1) is not needed.

A local `source` must not tell the coordinator what exists on this machine: every local path the
node cannot use gets the same words, with no file names and no counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.support.https_server import HOST, MIRROR, SERVED_HERE, HttpsServer
from tests.worker.provision.hf_endpoint import serve_repo
from worker.contract import protocol
from worker.system.config import Paths, Settings
from worker.provision.fetch import TOO_MANY_REDIRECTS, HostRefused
from worker.provision.hosts import LOCAL_HOST, NOT_A_NAME, NOT_HTTPS, PUBLIC_HOSTS, only_public, url_refusal
from worker.contract.events import DownloadProgress
from worker.provision.errors import ProvisionError
from worker.provision.models import UNUSABLE_PATH, ModelOptions, ensure_model
from worker.update.download import DownloadPolicy, download_verified
from worker.update.updater import NodeHooks, Updater, UpdaterOptions
from worker.update.verify import UpdateRefused

SECRET = b"router admin password: hunter2\n"  # what the home network's server would give away
SECRET_SHA = hashlib.sha256(SECRET).hexdigest()
GGUF = b"GGUF" + os.urandom(50_000)
GGUF_SHA = hashlib.sha256(GGUF).hexdigest()
COMMIT = "d" * 40
REBIND = "home.example.net"  # a public-looking name whose (hostile) DNS answers 127.0.0.1

HOME_REDIRECTS = [  # where a hostile redirect would send a download: the `home` server, at {port}
    pytest.param("http://127.0.0.1:{port}/secret", NOT_HTTPS, id="http-ip"),
    pytest.param("http://" + HOST + ":{port}/secret", NOT_HTTPS, id="http-public-name"),
    pytest.param("https://127.0.0.1:{port}/secret", NOT_A_NAME, id="ip-literal"),
    pytest.param("https://[::ffff:127.0.0.1]:{port}/secret", NOT_A_NAME, id="ipv6-mapped"),
    pytest.param("https://2130706433:{port}/secret", NOT_A_NAME, id="one-number"),
    pytest.param("https://127.1:{port}/secret", NOT_A_NAME, id="short-ip"),
    pytest.param("https://0x7f.1:{port}/secret", NOT_A_NAME, id="hex-ip"),
    pytest.param("https://localhost:{port}/secret", NOT_A_NAME, id="localhost"),
    pytest.param("https://" + REBIND + ":{port}/secret", LOCAL_HOST, id="name-resolving-home"),
    pytest.param("//" + REBIND + ":{port}/secret", LOCAL_HOST, id="scheme-relative"),
]
SOME_REDIRECTS = [HOME_REDIRECTS[i] for i in (0, 2, 7, 8)]  # one of each reason, and a name that resolves home


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def server(ca: trustme.CA) -> Iterator[HttpsServer]:
    """The attacker's (or a good) public server: `https://files.example.net:PORT/`."""
    with HttpsServer(ca=ca) as running:
        yield running


@pytest.fixture
def home(ca: trustme.CA, monkeypatch: pytest.MonkeyPatch) -> Iterator[HttpsServer]:
    """A server of the provider's home network, on 127.0.0.1, holding a secret; `REBIND` resolves to it."""
    fake_dns(monkeypatch, {REBIND: ["127.0.0.1"]})
    with HttpsServer(ca=ca) as running:
        running.add("secret", SECRET)
        yield running


def fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> list[str]:
    """`socket.getaddrinfo` answering `answers` for those names, the real one for the rest; returns
    the names it was asked for, in order."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def lookup(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host  # asyncio and anyio ask in bytes
        if name not in answers:
            return real(host, port, *args, **kwargs)
        asked.append(name)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port)))
                for a in answers[name]]

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    return asked


def options(server: HttpsServer, **changes: Any) -> ModelOptions:
    """Provisioning as the app does it (its own client), with the tests' hosts and certificate authority."""
    base = ModelOptions(hosts=SERVED_HERE, verify=server.client_context(), free_bytes=lambda _: 10**12,
                        sleep=_no_sleep, margin_bytes=0)
    return dataclasses.replace(base, **changes)


async def _no_sleep(_: float) -> None:
    """Retries take no time here."""


def redirect(server: HttpsServer, path: str, location: str) -> None:
    server.add(path, b"see elsewhere", status=302, headers={"Location": location})


def assert_tells_nothing_fetched(text: str, home: HttpsServer) -> None:
    """A refusal carries no body, no hash of one, no status and nothing of the address inside."""
    for leak in ("hunter2", SECRET_SHA, "302", "200", "HTTP", str(home.port), "127.0.0.1", "see elsewhere"):
        assert leak not in text, leak


async def fetch_model(server: HttpsServer, tmp_path: Path, url: str, **option_changes: Any) -> Path:
    model = protocol.EngineModel(source=url, sha256=GGUF_SHA, weights_mib=1)
    return await ensure_model(model, "llamacpp", Paths.under(tmp_path / "app"), Settings(), lambda _: None,
                              options=options(server, **option_changes))


async def refused_model(server: HttpsServer, tmp_path: Path, url: str, **option_changes: Any) -> ProvisionError:
    with pytest.raises(ProvisionError) as failure:
        await asyncio.wait_for(fetch_model(server, tmp_path, url, **option_changes), timeout=30)
    return failure.value


# --- models: redirects into the home network ------------------------------------------------------


@pytest.mark.parametrize(("where", "reason"), HOME_REDIRECTS)
async def test_a_model_redirected_into_the_home_network_is_refused_before_it_connects(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, where: str, reason: str
) -> None:
    redirect(server, "m.gguf", where.format(port=home.port))

    failure = await refused_model(server, tmp_path, server.url("m.gguf"))

    assert home.connections == 0  # never touched: no port scan, no file read
    assert failure.problem.title == "Download address not allowed" and reason in failure.problem.message
    assert_tells_nothing_fetched(failure.problem.message, home)
    assert not list((tmp_path / "app").rglob("*.gguf*"))


async def test_every_hop_of_a_redirect_chain_is_checked_and_the_chain_is_bounded(
    server: HttpsServer, home: HttpsServer, tmp_path: Path
) -> None:
    redirect(server, "a.gguf", server.url("b.gguf", host=MIRROR))  # a fine first hop …
    redirect(server, "b.gguf", f"https://{REBIND}:{home.port}/secret")  # … then home
    redirect(server, "loop.gguf", "/loop.gguf")

    chained = await refused_model(server, tmp_path, server.url("a.gguf"))
    looped = await refused_model(server, tmp_path, server.url("loop.gguf"))

    assert LOCAL_HOST in chained.problem.message and home.connections == 0
    assert len(server.requests_for("b.gguf")) == 1
    assert TOO_MANY_REDIRECTS in looped.problem.message
    assert len(server.requests_for("loop.gguf")) == 6  # the first ask and 5 redirects, then no more


async def test_a_good_redirect_to_another_public_host_still_downloads(server: HttpsServer, tmp_path: Path) -> None:
    server.add("real/m.gguf", GGUF)
    redirect(server, "m.gguf", server.url("real/m.gguf", host=MIRROR))

    path = await fetch_model(server, tmp_path, server.url("m.gguf"))

    assert path.read_bytes() == GGUF
    assert [r.headers["host"].split(":")[0] for r in server.requests] == [HOST, MIRROR]


# --- models: first URLs, names that resolve home, the app's own policy ------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://127.0.0.1:{port}/m.gguf", NOT_A_NAME),
        ("https://localhost:{port}/m.gguf", NOT_A_NAME),
        ("https://" + REBIND + ":{port}/m.gguf", LOCAL_HOST),
    ],
)
async def test_a_first_url_on_this_machine_is_refused_before_it_connects(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, url: str, reason: str
) -> None:
    failure = await refused_model(server, tmp_path, url.format(port=home.port))

    assert reason in failure.problem.message and home.connections == 0


@pytest.mark.parametrize(
    "answers",
    [["192.168.1.20"], ["10.0.0.7"], ["169.254.169.254"], ["fe80::1"], ["fd00::5"], ["100.64.0.9"],
     ["93.184.215.14", "192.168.1.20"]],  # one public address does not excuse a private one
    ids=["lan", "private-10", "cloud-metadata", "ipv6-link-local", "ipv6-ula", "cgnat", "mixed"],
)
async def test_a_name_that_resolves_into_a_private_network_is_refused(
    server: HttpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answers: list[str]
) -> None:
    lookups = fake_dns(monkeypatch, {"nas.example.net": answers})
    redirect(server, "m.gguf", "https://nas.example.net/m.gguf")

    failure = await refused_model(server, tmp_path, server.url("m.gguf"))

    assert LOCAL_HOST in failure.problem.message and lookups == ["nas.example.net"]
    for address in answers:
        assert address not in failure.problem.message


async def test_the_apps_own_policy_refuses_the_test_server_itself(
    server: HttpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PUBLIC_HOSTS`, the default, with the public-looking name answered by DNS as 127.0.0.1."""
    fake_dns(monkeypatch, {HOST: ["127.0.0.1"]})
    server.add("m.gguf", GGUF)

    failure = await refused_model(server, tmp_path, server.url("m.gguf"), hosts=PUBLIC_HOSTS)

    assert LOCAL_HOST in failure.problem.message and server.connections == 0
    assert ModelOptions().hosts is PUBLIC_HOSTS


async def test_no_proxy_from_the_environment_carries_a_download(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{home.port}")
    server.add("m.gguf", GGUF)

    path = await fetch_model(server, tmp_path, server.url("m.gguf"))

    assert path.read_bytes() == GGUF and home.connections == 0


def test_host_names_are_a_closed_form() -> None:
    allowed = [b"huggingface.co", b"cdn-lfs.hf.co", b"xn--bcher-kva.example", b"a-b.example.net"]
    refused = [b"127.0.0.1", b"::1", b"2130706433", b"127.1", b"0x7f.1", b"localhost", b"nas", b"a..b",
               b"example.com.", b"a_b.example", b"example.123", b"x" * 250 + b".com", b""]
    assert [url_refusal("https", h) for h in allowed] == [None] * len(allowed)
    assert [url_refusal("https", h) for h in refused] == [NOT_A_NAME] * len(refused)
    assert url_refusal("http", b"huggingface.co") == NOT_HTTPS


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.0.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
     "224.0.0.1", "239.255.255.250", "::1", "fe80::1", "fd12::1", "::ffff:192.168.0.1", "64:ff9b::c0a8:1",
     "64:ff9b::7f00:1", "2002:c0a8:1::1", "ff02::1"],
)
def test_local_addresses_in_every_form_are_refused(address: str) -> None:
    with pytest.raises(HostRefused):
        only_public([ipaddress.ip_address(address)])


def test_public_addresses_pass() -> None:
    public = [ipaddress.ip_address(a) for a in ("93.184.215.14", "2606:4700::1111", "64:ff9b::5db8:d70e")]
    assert only_public(public) == public
    assert only_public(public * 3) == public  # once each


# --- updates -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "reason"), SOME_REDIRECTS)
async def test_an_update_redirected_into_the_home_network_is_refused_before_it_connects(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, where: str, reason: str
) -> None:
    redirect(server, "u.tar.gz", where.format(port=home.port))
    events: list[DownloadProgress] = []

    async with server.client() as client:
        with pytest.raises(UpdateRefused) as refused:
            await download_verified(client, server.url("u.tar.gz"), tmp_path / "u.archive", sha256=SECRET_SHA,
                                    what="update 9.9.9", on_progress=events.append,
                                    policy=DownloadPolicy(attempts=1, margin_bytes=0))

    assert home.connections == 0 and reason in str(refused.value)
    assert_tells_nothing_fetched(str(refused.value), home)
    assert events[-1].error == str(refused.value)


def feed_updater(tmp_path: Path, feed_url: str, **options: Any) -> Updater:
    async def nothing() -> None:
        return None

    return Updater(
        Paths.under(tmp_path / "app"),
        Settings(update_feed_url=feed_url),
        NodeHooks(in_flight=lambda: 0, stop_serving=nothing, resume_serving=nothing, exit_app=lambda: None),
        options=UpdaterOptions(public_key=Ed25519PrivateKey.generate().public_key(), **options),
    )


@pytest.mark.parametrize(("where", "reason"), SOME_REDIRECTS)
async def test_an_update_feed_follows_redirects_to_public_hosts_only(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, where: str, reason: str
) -> None:
    redirect(server, "feed.json", server.url("moved/feed.json", host=MIRROR))  # followed …
    redirect(server, "moved/feed.json", where.format(port=home.port))  # … but not into the home network

    assert await feed_updater(tmp_path, server.url("feed.json"), client_factory=server.client).check_feed() is False
    assert [r.headers["host"].split(":")[0] for r in server.requests] == [HOST, MIRROR]
    assert home.connections == 0


async def test_the_updaters_own_client_refuses_a_feed_on_this_machine(
    server: HttpsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default client, with the public-looking name answered by DNS as 127.0.0.1."""
    fake_dns(monkeypatch, {HOST: ["127.0.0.1"]})

    assert await feed_updater(tmp_path, server.url("feed.json")).check_feed() is False
    assert server.connections == 0


# --- Hugging Face --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("where", "reason"), SOME_REDIRECTS)
async def test_a_hugging_face_file_redirected_home_is_refused_before_it_connects(
    server: HttpsServer, home: HttpsServer, tmp_path: Path, where: str, reason: str
) -> None:
    serve_repo(server, "org/evil", {"m.gguf": GGUF}, commit=COMMIT)
    for revision in (COMMIT, "main"):
        server.add(f"org/evil/resolve/{revision}/m.gguf", b"", status=302, headers={
            "Location": where.format(port=home.port), "X-Repo-Commit": COMMIT,
            "ETag": f'"{GGUF_SHA}"', "X-Linked-Size": str(len(GGUF))})
    model = protocol.EngineModel(source="org/evil", weights_mib=1)

    with pytest.raises(ProvisionError) as failure:
        await ensure_model(model, "llamacpp", Paths.under(tmp_path / "app"), Settings(), lambda _: None,
                           hf_endpoint=server.base_url, options=options(server))

    assert home.connections == 0
    assert failure.value.problem.title == "Download address not allowed" and reason in failure.value.problem.message
    assert_tells_nothing_fetched(failure.value.problem.message, home)


# --- local paths ---------------------------------------------------------------------------------------


async def test_every_unusable_local_path_gets_the_same_words_and_no_names(tmp_path: Path) -> None:
    (tmp_path / "notes-private.gguf").write_bytes(b"diary: nothing to see")
    two = tmp_path / "two"
    two.mkdir()
    (two / "alpha-secret.gguf").write_bytes(GGUF)
    (two / "beta-secret.gguf").write_bytes(GGUF)
    none = tmp_path / "none"
    none.mkdir()
    (none / "readme-secret.txt").write_text("hello")
    (tmp_path / "real.gguf").write_bytes(GGUF)
    os.mkfifo(tmp_path / "pipe-secret.gguf")
    (tmp_path / "link-secret.gguf").symlink_to("/dev/zero")
    cases = {
        "missing": (tmp_path / "missing-secret.gguf", None),
        "not a model": (tmp_path / "notes-private.gguf", None),
        "two GGUF files in a folder": (two, None),
        "no GGUF file in a folder": (none, None),
        "a pipe": (tmp_path / "pipe-secret.gguf", None),
        "a link to a device": (tmp_path / "link-secret.gguf", None),
        "another sha256": (tmp_path / "real.gguf", "0" * 64),
        "a sha256 for a folder": (two, GGUF_SHA),
    }
    paths = Paths.under(tmp_path / "app")

    words = {}
    for case, (path, sha256) in cases.items():
        model = protocol.EngineModel(source=str(path), sha256=sha256, weights_mib=1)
        with pytest.raises(ProvisionError) as failure:
            await asyncio.wait_for(ensure_model(model, "llamacpp", paths, Settings(), lambda _: None), timeout=10)
        words[case] = (failure.value.problem.title, failure.value.problem.message)

    assert len(set(words.values())) == 1, words
    _, message = words["missing"]
    assert message.startswith(UNUSABLE_PATH)
    for leak in ("secret", "private", "alpha", "beta", "two", "2", "real", GGUF_SHA, str(tmp_path)):
        assert leak not in message, leak
