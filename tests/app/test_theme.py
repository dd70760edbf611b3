"""One theme for every window: light or dark as the system says (also when it changes while the
app runs), sizes relative to the system font, and names other windows can style themselves by."""

from __future__ import annotations

import re

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import QDialog, QLabel, QPushButton, QVBoxLayout

from app import theme

OBJECT_NAMES = (
    "card", "cardTitle", "appTitle", "heading", "statValue", "caption", "muted",
    "rowTitle", "banner", "primary", "error", "warning", "panel", "dimmed",
)  # fmt: skip


@pytest.fixture
def clean(qapp):
    font = qapp.font()
    yield qapp
    qapp.setFont(font)
    qapp.setStyleSheet("")
    qapp.setPalette(qapp.style().standardPalette())


def window_lightness(qapp) -> int:
    return qapp.palette().color(QPalette.ColorRole.Window).lightness()


def test_follows_the_system_scheme_also_when_it_changes(clean, qtbot, monkeypatch):
    """The offscreen platform has no scheme of its own: the test plays the system's part."""
    system = ["light"]
    monkeypatch.setattr(theme, "system_scheme", lambda qapp: system[0])
    theme.install(clean)
    assert theme.colours() is theme.LIGHT and window_lightness(clean) > 200
    system[0] = "dark"
    with qtbot.waitSignal(theme.notifier().changed, timeout=1000):
        clean.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Dark)
    assert theme.colours() is theme.DARK and window_lightness(clean) < 60
    assert theme.DARK.window in clean.styleSheet()


def test_a_forced_scheme_stops_following(clean, qtbot, monkeypatch):
    monkeypatch.setattr(theme, "system_scheme", lambda qapp: "light")
    theme.install(clean, "dark")
    with qtbot.assertNotEmitted(theme.notifier().changed):
        clean.styleHints().colorSchemeChanged.emit(Qt.ColorScheme.Light)
    assert theme.colours() is theme.DARK and window_lightness(clean) < 60
    theme.install(clean, "light")
    assert theme.colours() is theme.LIGHT and window_lightness(clean) > 200


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_names_other_windows_use_are_styled(clean, scheme):
    theme.install(clean, scheme)
    sheet = clean.styleSheet()
    for name in OBJECT_NAMES:
        assert re.search(rf"#{name}\b", sheet), name


@pytest.mark.parametrize("points", [9.0, 14.0])
def test_sizes_follow_the_system_font(clean, points):
    font = QFont(clean.font())
    font.setPointSizeF(points)
    clean.setFont(font)
    theme.install(clean, "light")
    sizes = {m[0]: float(m[1]) for m in re.findall(r"#(\w+) \{[^}]*font-size: ([\d.]+)pt", clean.styleSheet())}
    assert sizes["statValue"] == pytest.approx(points * 1.9, abs=0.1)
    assert sizes["appTitle"] > sizes["heading"] > points > sizes["caption"]
    fixed = re.sub(r"(border(-radius)?|padding|max-height|letter-spacing|margin): [^;]*;", "", clean.styleSheet())
    part = r"(?<![-\w])(width|height|padding-right|border-radius): (\d+)px"
    sized = [(name, int(value)) for name, value in re.findall(part, fixed)]
    assert sized, "a control's parts (check box, arrow, slider) are sized"
    doubled = [(name, int(value)) for name, value in
               re.findall(part, re.sub(r"(border(-radius)?|padding|max-height|letter-spacing|margin): [^;]*;", "",
                                       theme.stylesheet(theme.LIGHT, points * 2)))]
    assert [name for name, _ in doubled] == [name for name, _ in sized]
    assert all(big >= 2 * small - 1 for (_, small), (_, big) in zip(sized, doubled))  # they follow the font


def test_a_dialog_made_later_follows_with_no_code_of_its_own(clean, qtbot):
    """What the settings or sign-in window gets by naming its widgets."""
    theme.install(clean, "dark")
    dialog = QDialog()
    qtbot.addWidget(dialog)
    layout = QVBoxLayout(dialog)
    error = QLabel("Wrong token")
    error.setObjectName("error")
    button = QPushButton("Save")
    layout.addWidget(error)
    layout.addWidget(button)
    dialog.show()
    qtbot.waitExposed(dialog)
    assert error.palette().color(QPalette.ColorRole.WindowText).name().upper() == theme.DARK.error.upper()
    assert button.palette().color(QPalette.ColorRole.ButtonText).name().upper() == theme.DARK.text.upper()
    assert dialog.palette().color(QPalette.ColorRole.Window).lightness() < 60


def test_each_scheme_has_chart_colours_that_stand_out(qapp):
    for colours in (theme.LIGHT, theme.DARK):
        assert colours.chart_bg != colours.chart_fg
        assert len(set(colours.series)) == len(colours.series) >= 4
