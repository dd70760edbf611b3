"""Decide whether an update offer may be downloaded at all. Pure: no I/O.

Everything an offer claims is checked here before a single byte is fetched: its shape, that it is
signed by the release key built into the app, and that it is newer than the running version. A
signed old build can never be replayed as a new one, because the signature binds the version and
the archive's hash together (`protocol.signed_update_payload`).
"""

from __future__ import annotations

import base64
import binascii
import json
import platform
import sys
from dataclasses import dataclass
from typing import Any

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from worker.contract import protocol

# The release key's public half (raw 32 bytes, base64). Its private half lives only with the
# release manager (see docs/releasing.md); replace this line when the key is rotated.
RELEASE_PUBLIC_KEY_B64 = "p6mbJ9QNlt5CxPALVP0Jw0KN+ms9/z2wffTvt2R939k="


class UpdateRefused(Exception):
    """An offer or a download that must not be installed; the message says why, for the log."""


@dataclass(frozen=True)
class UpdateOffer:
    """An offer whose signature checked out and whose version is newer than ours."""

    version: str
    url: str
    sha256: str


def load_public_key(raw_b64: str) -> Ed25519PublicKey:
    """A public key from its raw 32 bytes in base64 (the form docs/releasing.md prints)."""
    return Ed25519PublicKey.from_public_bytes(base64.b64decode(raw_b64, validate=True))


def release_public_key() -> Ed25519PublicKey:
    return load_public_key(RELEASE_PUBLIC_KEY_B64)


def parse_version(text: str) -> Version:
    try:
        return Version(text)
    except InvalidVersion:
        raise UpdateRefused(
            f"version {text!r} is not a valid PEP 440 version"
        ) from None


def is_newer(candidate: str, running: str) -> bool:
    return parse_version(candidate) > parse_version(running)


def verify_offer(
    update: protocol.Update, *, public_key: Ed25519PublicKey, running_version: str
) -> UpdateOffer:
    """An `update` message → a verified offer, or `UpdateRefused` saying why."""
    version = parse_version(update.version)
    sha256 = _checked_sha256(update.sha256)
    if not update.url.startswith("https://"):
        raise UpdateRefused(
            f"update {update.version} is offered over {update.url!r}; only https is accepted"
        )
    _check_signature(update, sha256, public_key)
    if not is_newer(update.version, running_version):
        raise UpdateRefused(
            f"update {update.version} is not newer than the running version {running_version}"
        )
    return UpdateOffer(version=str(version), url=update.url, sha256=sha256)


def _checked_sha256(value: str) -> str:
    digest = value.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise UpdateRefused("the offer's sha256 is not 64 hexadecimal digits")
    return digest


def _check_signature(
    update: protocol.Update, sha256: str, public_key: Ed25519PublicKey
) -> None:
    if not update.signature.strip():
        raise UpdateRefused(f"update {update.version} is unsigned")
    try:
        signature = base64.b64decode(update.signature, validate=True)
    except (binascii.Error, ValueError):
        raise UpdateRefused(
            f"update {update.version}'s signature is not valid base64"
        ) from None
    try:
        public_key.verify(
            signature, protocol.signed_update_payload(update.version, sha256)
        )
    except InvalidSignature:
        raise UpdateRefused(
            f"update {update.version}'s signature does not match the release key built into this app"
        ) from None


def platform_key() -> str:
    """This build's key in the update feed: `linux-x86_64`, `windows-x86_64`, `macos-arm64`, …"""
    system = {"win32": "windows", "darwin": "macos"}.get(sys.platform, sys.platform)
    machine = platform.machine().lower()
    arch = {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64"}.get(
        machine, machine
    )
    return f"{system}-{arch}"


def offer_from_feed(
    document: bytes, *, feed_url: str, channel: str, platform_name: str
) -> protocol.Update | None:
    """The feed's entry for this channel and platform as an `update` message; None when it has none.

    The feed format is in docs/releasing.md. A relative `url` is resolved against the feed's own.
    """
    try:
        data = json.loads(document)
    except ValueError as exc:
        raise UpdateRefused(
            f"the update feed at {feed_url} is not valid JSON: {exc}"
        ) from None
    entry = _feed_entry(data, channel, platform_name)
    if entry is None:
        return None
    fields = {**entry["build"], "version": entry["version"]}
    if isinstance(fields.get("url"), str):
        fields["url"] = str(httpx.URL(feed_url).join(fields["url"]))
    try:
        return protocol.Update.model_validate(fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(entry)'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        raise UpdateRefused(
            f"the update feed's {channel}/{platform_name} entry is malformed: {problems}"
        ) from None


def _feed_entry(data: Any, channel: str, platform_name: str) -> dict[str, Any] | None:
    channels = data.get("channels") if isinstance(data, dict) else None
    if not isinstance(channels, dict):
        raise UpdateRefused('the update feed has no "channels" object')
    release = channels.get(channel)
    if release is None:
        return None
    if not isinstance(release, dict) or not isinstance(release.get("builds"), dict):
        raise UpdateRefused(
            f'the update feed\'s channel {channel!r} has no "builds" object'
        )
    build = release["builds"].get(platform_name)
    if build is None:
        return None
    if not isinstance(build, dict):
        raise UpdateRefused(
            f"the update feed's {channel}/{platform_name} build is not an object"
        )
    return {"version": release.get("version"), "build": build}
