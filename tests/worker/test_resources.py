from __future__ import annotations

import sys
from pathlib import Path

import pytest

from worker.resources import asset_dirs, asset_path

REPO_ASSETS = Path(__file__).resolve().parents[2] / "assets"


def test_unfrozen_assets_come_from_the_repository() -> None:
    assert asset_path("icon.png") == REPO_ASSETS / "icon.png"
    assert asset_path("icon.svg").read_text().lstrip().startswith("<svg")


def test_frozen_assets_come_from_the_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "assets" / "tray").mkdir(parents=True)
    (tmp_path / "assets" / "tray" / "idle.svg").write_text("<svg/>")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "_MEIPASS", str(tmp_path), raising=False)
    assert asset_dirs() == [tmp_path / "assets"]
    assert asset_path("tray/idle.svg") == tmp_path / "assets" / "tray" / "idle.svg"
    with pytest.raises(FileNotFoundError, match="icon.png"):
        asset_path("icon.png")


def test_an_installed_wheel_finds_assets_under_the_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "share" / "gpu-provider" / "assets"
    shared.mkdir(parents=True)
    (shared / "only-installed.png").write_bytes(b"png")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert asset_path("only-installed.png") == shared / "only-installed.png"


def test_a_missing_asset_says_where_it_looked() -> None:
    with pytest.raises(FileNotFoundError, match=r"missing \(looked in .*assets"):
        asset_path("no-such-icon.png")


@pytest.mark.parametrize("name", ["../pyproject.toml", "/etc/passwd", ""])
def test_names_outside_the_assets_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="relative path inside assets"):
        asset_path(name)
