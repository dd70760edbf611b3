"""Release signing: make the release key, sign an archive, publish it in the update feed.

    python installer/sign-release.py keygen --out ~/secure/gpu-provider-release.pem
    python installer/sign-release.py sign dist/gpu-provider-0.2.0-linux-x86_64.tar.gz \
        --version 0.2.0 --key ~/secure/gpu-provider-release.pem \
        --feed site/feed.json --channel stable --platform linux-x86_64 [--url URL]

The private key never enters the repository: `keygen` refuses to write inside it, and CI passes
the key through an environment variable (`--key-env NAME`) rather than a file. The public half
that `keygen` prints goes into `worker/update/verify.py` (RELEASE_PUBLIC_KEY_B64).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The app's own definition of what is signed, so the two can never differ.
from worker.contract.protocol import signed_update_payload


def public_key_b64(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return base64.b64encode(raw).decode("ascii")


def keygen(out: Path) -> int:
    out = out.expanduser().resolve()
    if out.is_relative_to(REPO):
        print(
            f"refusing to write the private key inside the repository ({out}); choose a path outside it",
            file=sys.stderr,
        )
        return 2
    if out.exists():
        print(f"{out} exists; not overwriting a key", file=sys.stderr)
        return 2
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(pem)
    print(
        f"private key written to {out} (mode 0600): store it offline or in the CI secret store"
    )
    print("public key for worker/update/verify.py:")
    print(f'RELEASE_PUBLIC_KEY_B64 = "{public_key_b64(key)}"')
    return 0


def load_key(path: str | None, env: str | None) -> Ed25519PrivateKey:
    pem = (
        os.environ[env].encode() if env else Path(path or "").expanduser().read_bytes()
    )
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise TypeError("the release key must be an Ed25519 private key")
    return key


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for block in iter(lambda: source.read(1024 * 1024), b""):
            digest.update(block)
    return digest.hexdigest()


def sign(args: argparse.Namespace) -> int:
    key = load_key(args.key, args.key_env)
    archive = Path(args.archive)
    digest = sha256_of(archive)
    signature = base64.b64encode(
        key.sign(signed_update_payload(args.version, digest))
    ).decode("ascii")
    url = args.url or archive.name
    update = {
        "type": "update",
        "version": args.version,
        "url": url,
        "sha256": digest,
        "signature": signature,
    }
    if args.feed:
        publish(Path(args.feed), args.channel, args.platform, update)
    print(json.dumps(update, indent=2))
    return 0


def publish(feed: Path, channel: str, platform: str, update: dict[str, Any]) -> None:
    """Add this build to the feed; a new version on a channel replaces the builds of the old one."""
    document: dict[str, Any] = (
        json.loads(feed.read_text(encoding="utf-8"))
        if feed.exists()
        else {"channels": {}}
    )
    release = document.setdefault("channels", {}).get(channel)
    if not release or release.get("version") != update["version"]:
        release = {"version": update["version"], "builds": {}}
    release["builds"][platform] = {k: update[k] for k in ("url", "sha256", "signature")}
    document["channels"][channel] = release
    feed.parent.mkdir(parents=True, exist_ok=True)
    temporary = feed.with_name(feed.name + ".tmp")
    temporary.write_text(
        json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    os.replace(temporary, feed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sign-release", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("keygen", help="make a new release key pair")
    make.add_argument(
        "--out",
        required=True,
        type=Path,
        help="where to write the private key (outside the repository)",
    )
    signing = commands.add_parser(
        "sign", help="sign an update archive and print its `update` message"
    )
    signing.add_argument("archive")
    signing.add_argument("--version", required=True)
    source = signing.add_mutually_exclusive_group(required=True)
    source.add_argument("--key", help="the private key's PEM file")
    source.add_argument(
        "--key-env",
        metavar="NAME",
        help="an environment variable holding the PEM (CI secrets)",
    )
    signing.add_argument(
        "--url",
        help="where the archive will be served (default: its name, relative to the feed)",
    )
    signing.add_argument(
        "--feed", help="a feed document to add this build to (created if absent)"
    )
    signing.add_argument("--channel", default="stable")
    signing.add_argument(
        "--platform",
        default="linux-x86_64",
        help="linux-x86_64, windows-x86_64, macos-arm64, …",
    )
    args = parser.parse_args(argv)
    if args.command == "keygen":
        return keygen(args.out)
    return sign(args)


if __name__ == "__main__":
    sys.exit(main())
