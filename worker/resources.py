"""Find the app's bundled files (icons, tray images) the same way frozen and unfrozen.

A PyInstaller build unpacks them under `sys._MEIPASS/assets`; a checkout keeps them in the
repository's `assets/`; an installed wheel finds them under `<prefix>/share/gpu-provider/assets`.
Everything that loads an asset asks `asset_path`, so no module guesses at paths of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path, PurePosixPath

_REPO_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def asset_dirs() -> list[Path]:
    """Where assets may be, most specific first."""
    bundle = getattr(sys, "_MEIPASS", None)
    if getattr(sys, "frozen", False) and bundle:
        return [Path(bundle) / "assets"]
    return [_REPO_ASSETS, Path(sys.prefix) / "share" / "gpu-provider" / "assets"]


def asset_path(name: str) -> Path:
    """The file `name` (e.g. "icon.png", "tray/serving.svg") among the assets; raises if absent."""
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise ValueError(f"asset name {name!r} must be a relative path inside assets/")
    searched = asset_dirs()
    for folder in searched:
        candidate = folder.joinpath(*relative.parts)
        if candidate.is_file():
            return candidate
    looked = ", ".join(str(folder) for folder in searched)
    raise FileNotFoundError(
        f"asset {name!r} is missing (looked in {looked}); reinstall the app"
    )
