from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from worker.contract import protocol
from worker.update.verify import (
    RELEASE_PUBLIC_KEY_B64,
    UpdateRefused,
    is_newer,
    load_public_key,
    offer_from_feed,
    verify_offer,
)

SHA = "ab" * 32


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def signed(
    key: Ed25519PrivateKey,
    version: str,
    sha256: str = SHA,
    url: str = "https://example.test/u.tar.gz",
) -> protocol.Update:
    signature = base64.b64encode(
        key.sign(protocol.signed_update_payload(version, sha256))
    ).decode()
    return protocol.Update(version=version, url=url, sha256=sha256, signature=signature)


def test_a_signed_newer_version_is_accepted(key: Ed25519PrivateKey) -> None:
    offer = verify_offer(
        signed(key, "0.2.0"), public_key=key.public_key(), running_version="0.1.0"
    )
    assert (offer.version, offer.sha256) == ("0.2.0", SHA)


def test_the_hash_is_compared_in_lower_case(key: Ed25519PrivateKey) -> None:
    update = signed(key, "0.2.0").model_copy(update={"sha256": SHA.upper()})
    assert (
        verify_offer(
            update, public_key=key.public_key(), running_version="0.1.0"
        ).sha256
        == SHA
    )


@pytest.mark.parametrize("version", ["0.1.0", "0.0.9", "0.1.0rc1"])
def test_versions_not_newer_are_refused(key: Ed25519PrivateKey, version: str) -> None:
    with pytest.raises(UpdateRefused, match="not newer"):
        verify_offer(
            signed(key, version), public_key=key.public_key(), running_version="0.1.0"
        )


def test_a_signature_from_another_key_is_refused(key: Ed25519PrivateKey) -> None:
    stranger = Ed25519PrivateKey.generate()
    with pytest.raises(UpdateRefused, match="does not match the release key"):
        verify_offer(
            signed(stranger, "0.2.0"),
            public_key=key.public_key(),
            running_version="0.1.0",
        )


def test_a_signature_for_another_version_cannot_be_replayed(
    key: Ed25519PrivateKey,
) -> None:
    old = signed(key, "0.0.5")
    replayed = old.model_copy(update={"version": "9.0.0"})
    with pytest.raises(UpdateRefused, match="does not match"):
        verify_offer(replayed, public_key=key.public_key(), running_version="0.1.0")


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"signature": ""}, "unsigned"),
        ({"signature": "not base64!"}, "not valid base64"),
        ({"sha256": "abc"}, "64 hexadecimal"),
        ({"url": "http://example.test/u.tar.gz"}, "only https"),
        ({"version": "next please"}, "not a valid PEP 440"),
    ],
)
def test_malformed_offers_are_refused_with_the_reason(
    key: Ed25519PrivateKey, changes: dict[str, str], reason: str
) -> None:
    update = signed(key, "0.2.0").model_copy(update=changes)
    with pytest.raises(UpdateRefused, match=reason):
        verify_offer(update, public_key=key.public_key(), running_version="0.1.0")


def test_pep_440_ordering() -> None:
    assert is_newer("0.10.0", "0.9.9")
    assert is_newer("1.0.0", "1.0.0rc2")
    assert not is_newer("1.0", "1.0.0")


def test_the_built_in_release_key_is_a_valid_public_key() -> None:
    assert len(base64.b64decode(RELEASE_PUBLIC_KEY_B64)) == 32
    load_public_key(RELEASE_PUBLIC_KEY_B64)


def feed(**builds: dict[str, str]) -> bytes:
    return json.dumps(
        {"channels": {"stable": {"version": "0.3.0", "builds": builds}}}
    ).encode()


def test_the_feed_entry_for_this_platform_becomes_an_update_message() -> None:
    document = feed(
        **{
            "linux-x86_64": {
                "url": "files/a.tar.gz",
                "sha256": SHA,
                "signature": "c2ln",
            }
        }
    )
    update = offer_from_feed(
        document,
        feed_url="https://updates.test/feed.json",
        channel="stable",
        platform_name="linux-x86_64",
    )
    assert update is not None
    assert (update.version, update.url, update.sha256) == (
        "0.3.0",
        "https://updates.test/files/a.tar.gz",
        SHA,
    )


def test_a_feed_without_our_channel_or_platform_offers_nothing() -> None:
    document = feed(
        **{"windows-x86_64": {"url": "w.zip", "sha256": SHA, "signature": "c2ln"}}
    )
    url = "https://updates.test/feed.json"
    assert (
        offer_from_feed(
            document, feed_url=url, channel="stable", platform_name="linux-x86_64"
        )
        is None
    )
    assert (
        offer_from_feed(
            document, feed_url=url, channel="beta", platform_name="windows-x86_64"
        )
        is None
    )


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", 'no "channels"'),
        (b'{"channels": {"stable": {"version": "1"}}}', 'no "builds"'),
        (feed(**{"linux-x86_64": {"url": "a.tar.gz"}}), "malformed"),
    ],
)
def test_a_malformed_feed_is_refused(document: bytes, reason: str) -> None:
    with pytest.raises(UpdateRefused, match=reason):
        offer_from_feed(
            document,
            feed_url="https://u.test/f.json",
            channel="stable",
            platform_name="linux-x86_64",
        )
