"""Every tray state has its own glyph, not only its own colour: degraded ("!") and failed ("×")
used to share one, which a colour-blind person (or a monochrome panel) could not tell apart."""

from __future__ import annotations

import itertools

import pytest
from PySide6.QtGui import QImage

from app.icons import state_pixmap

STATES = ("idle", "starting", "serving", "paused", "degraded", "failed")


def glyph(state: str, size: int = 32) -> frozenset[tuple[int, int]]:
    """Where the icon is (near) white: the glyph, whatever the disc's colour."""
    image = state_pixmap(state, size).toImage().convertToFormat(QImage.Format.Format_ARGB32)  # type: ignore[arg-type]
    inside = range(size // 8, size - size // 8)  # the disc, not its light halo
    return frozenset((x, y) for x in inside for y in inside
                     if min(image.pixelColor(x, y).red(), image.pixelColor(x, y).green(),
                            image.pixelColor(x, y).blue()) > 230 and image.pixelColor(x, y).alpha() > 200)


@pytest.mark.usefixtures("qapp")
def test_every_state_has_its_own_glyph() -> None:
    glyphs = {state: glyph(state) for state in STATES}
    assert all(glyphs.values())
    for first, second in itertools.combinations(STATES, 2):
        assert glyphs[first] != glyphs[second], f"{first} and {second} share a glyph"
