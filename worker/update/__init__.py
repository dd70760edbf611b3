"""Signed self-update: verify an offer, download it resumably, stage it, apply it, roll it back.

`verify` is pure; `download` fetches and hashes; `install` owns the on-disk layout; `updater`
orders the steps. docs/releasing.md describes the feed, the signing and the layout for people.
"""

from __future__ import annotations

from worker.update.download import DownloadPolicy
from worker.update.install import (
    InstallRoot,
    install_root,
    mark_hello_reached,
    mark_started,
    newer_installed_executable,
    run_installed_if_newer,
)
from worker.update.updater import NodeHooks, Updater, UpdaterOptions, UpdateStatus
from worker.update.verify import UpdateOffer, UpdateRefused, platform_key, verify_offer

__all__ = [
    "DownloadPolicy",
    "InstallRoot",
    "NodeHooks",
    "UpdateOffer",
    "UpdateRefused",
    "UpdateStatus",
    "Updater",
    "UpdaterOptions",
    "install_root",
    "mark_hello_reached",
    "mark_started",
    "newer_installed_executable",
    "platform_key",
    "run_installed_if_newer",
    "verify_offer",
]
