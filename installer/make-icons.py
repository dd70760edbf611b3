"""Render assets/icon.svg into the raster icons the installers need (icon.png, icon.ico, icon.icns).

Run after changing the SVG: `.venv/bin/python installer/make-icons.py`. Uses Qt's own SVG
renderer and image writers (PySide6 from the `gui` extra), so no other tool is needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ASSETS = Path(__file__).resolve().parent.parent / "assets"
OUTPUTS = {"icon.png": 512, "icon.ico": 256, "icon.icns": 512}


def render(renderer: QSvgRenderer, size: int) -> QImage:
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    renderer.render(painter)
    painter.end()
    return image


def main() -> int:
    app = QGuiApplication(sys.argv[:1] + ["-platform", "offscreen"])
    renderer = QSvgRenderer(str(ASSETS / "icon.svg"))
    if not renderer.isValid():
        print(f"{ASSETS / 'icon.svg'} is not a valid SVG", file=sys.stderr)
        return 1
    for name, size in OUTPUTS.items():
        if not render(renderer, size).save(str(ASSETS / name)):
            print(f"Qt could not write {ASSETS / name}", file=sys.stderr)
            return 1
        print(f"wrote {ASSETS / name} ({size}x{size})")
    del app
    return 0


if __name__ == "__main__":
    sys.exit(main())
