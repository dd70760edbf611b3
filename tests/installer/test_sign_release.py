"""installer/sign-release.py run as the release manager runs it, checked by the app's own verifier."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.contract import protocol
from worker.update.verify import (
    UpdateRefused,
    load_public_key,
    offer_from_feed,
    verify_offer,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "installer" / "sign-release.py"


def run(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env or dict(os.environ),
        check=False,
    )


@pytest.fixture
def release_key(tmp_path: Path) -> tuple[Path, str]:
    key = tmp_path / "keys" / "release.pem"
    made = run("keygen", "--out", str(key))
    assert made.returncode == 0, made.stderr
    public = re.search(r'RELEASE_PUBLIC_KEY_B64 = "([^"]+)"', made.stdout)
    assert public is not None
    return key, public.group(1)


def test_keygen_writes_a_private_key_only_its_owner_can_read(
    release_key: tuple[Path, str],
) -> None:
    key, _ = release_key
    assert key.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert key.stat().st_mode & 0o777 == 0o600


def test_keygen_refuses_to_write_inside_the_repository(tmp_path: Path) -> None:
    target = REPO / "installer" / "release-key-test.pem"
    refused = run("keygen", "--out", str(target))
    assert refused.returncode == 2 and "inside the repository" in refused.stderr
    assert not target.exists()


def test_keygen_never_overwrites_a_key(release_key: tuple[Path, str]) -> None:
    key, _ = release_key
    before = key.read_bytes()
    assert run("keygen", "--out", str(key)).returncode == 2
    assert key.read_bytes() == before


def test_a_signed_archive_verifies_with_the_printed_public_key(
    release_key: tuple[Path, str], tmp_path: Path
) -> None:
    key, public = release_key
    archive = tmp_path / "gpu-provider-0.2.0-linux-x86_64.tar.gz"
    archive.write_bytes(b"pretend build")
    signed = run(
        "sign",
        str(archive),
        "--version",
        "0.2.0",
        "--key",
        str(key),
        "--url",
        "https://dl.test/a.tar.gz",
    )
    assert signed.returncode == 0, signed.stderr
    update = protocol.Update.model_validate(json.loads(signed.stdout))
    offer = verify_offer(
        update, public_key=load_public_key(public), running_version="0.1.0"
    )
    assert offer.url == "https://dl.test/a.tar.gz"
    tampered = update.model_copy(update={"version": "0.3.0"})
    with pytest.raises(UpdateRefused):
        verify_offer(
            tampered, public_key=load_public_key(public), running_version="0.1.0"
        )


def test_signing_from_an_environment_variable_fills_the_feed(
    release_key: tuple[Path, str], tmp_path: Path
) -> None:
    key, public = release_key
    feed = tmp_path / "site" / "feed.json"
    env = {**os.environ, "RELEASE_KEY_PEM": key.read_text()}
    for platform, name in (("linux-x86_64", "l.tar.gz"), ("windows-x86_64", "w.zip")):
        (tmp_path / name).write_bytes(name.encode())
        done = run(
            "sign",
            str(tmp_path / name),
            "--version",
            "0.2.0",
            "--key-env",
            "RELEASE_KEY_PEM",
            "--feed",
            str(feed),
            "--platform",
            platform,
            env=env,
        )
        assert done.returncode == 0, done.stderr
    document = feed.read_bytes()
    assert set(json.loads(document)["channels"]["stable"]["builds"]) == {
        "linux-x86_64",
        "windows-x86_64",
    }
    update = offer_from_feed(
        document,
        feed_url="https://dl.test/feed.json",
        channel="stable",
        platform_name="windows-x86_64",
    )
    assert update is not None and update.url == "https://dl.test/w.zip"
    assert (
        verify_offer(
            update, public_key=load_public_key(public), running_version="0.1.0"
        ).version
        == "0.2.0"
    )
