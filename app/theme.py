"""Light and dark, following the system, for every window of the app at once.

One call, `install(qapp)`, sets the application palette and stylesheet, so dialogs made later
(settings, sign-in, logs, first run) follow without code of their own: they only name their
widgets ("card", "heading", "error", ...). Font sizes are multiples of the system font, so a
person who reads at 14 pt gets larger headline figures, never smaller ones.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from PySide6.QtCore import QObject, QPointF, Qt, Signal
from PySide6.QtGui import QColor, QGuiApplication, QImage, QPainter, QPalette, QPen, QPolygonF
from PySide6.QtWidgets import QApplication

Scheme = Literal["light", "dark"]
DEFAULT_POINT_SIZE = 10.0  # when the platform reports its font in pixels only


@dataclass(frozen=True)
class Colours:
    """The colours of one scheme: widgets, banners and the charts' lines."""

    window: str
    card: str
    border: str  # a card's edge (decoration)
    control: str  # a control's edge (input, button, check box): 3:1 or more on window, card and button
    text: str
    muted: str
    accent: str  # the primary button's fill, behind `on_accent` text
    on_accent: str
    link: str  # accent-coloured text on a card (Details toggles, links)
    button: str
    track: str
    error: str
    error_bg: str
    error_border: str
    warning: str
    warning_bg: str
    warning_border: str
    info_bg: str
    info_border: str
    chart_bg: str
    chart_fg: str
    series: tuple[str, ...]  # one line colour per series or GPU, in order


LIGHT = Colours(
    window="#F4F6F9", card="#FFFFFF", border="#DDE2E9", control="#7C8594", text="#1F2937", muted="#5B6472",
    accent="#2563EB", on_accent="#FFFFFF", link="#1D4ED8", button="#FFFFFF", track="#E5E9EF",
    error="#B91C1C", error_bg="#FEF2F2", error_border="#FCA5A5",
    warning="#92400E", warning_bg="#FFFBEB", warning_border="#FCD34D",
    info_bg="#EFF6FF", info_border="#93C5FD",
    chart_bg="#FFFFFF", chart_fg="#5B6472",
    series=("#2563EB", "#16A34A", "#D97706", "#7C3AED", "#DB2777", "#0891B2"),
)  # fmt: skip

DARK = Colours(
    window="#14171C", card="#1E232B", border="#333A45", control="#7B8594", text="#E6E9EE", muted="#A3ACB9",
    accent="#2563EB", on_accent="#FFFFFF", link="#60A5FA", button="#2A313B", track="#2E3540",
    error="#F87171", error_bg="#3A1D20", error_border="#7F2A2E",
    warning="#FBBF24", warning_bg="#3A2E12", warning_border="#7A5B14",
    info_bg="#172338", info_border="#2D4A7A",
    chart_bg="#1E232B", chart_fg="#A3ACB9",
    series=("#60A5FA", "#4ADE80", "#FBBF24", "#A78BFA", "#F472B6", "#22D3EE"),
)  # fmt: skip

SCHEMES: dict[Scheme, Colours] = {"light": LIGHT, "dark": DARK}


class _Theme(QObject):
    """The installed scheme; `changed` tells painted widgets (the charts) to recolour."""

    changed = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.scheme: Scheme = "light"
        self.follow_system = True
        self.listening = False  # connected to the system's colorSchemeChanged (once per process)


_theme: _Theme | None = None


def _state() -> _Theme:
    global _theme
    if _theme is None:
        _theme = _Theme()
    return _theme


def notifier() -> _Theme:
    """Connect to `notifier().changed` to recolour what a stylesheet does not reach."""
    return _state()


def colours() -> Colours:
    return SCHEMES[_state().scheme]


def system_scheme(qapp: QGuiApplication) -> Scheme:
    dark = qapp.styleHints().colorScheme() == Qt.ColorScheme.Dark
    return "dark" if dark else "light"


def install(qapp: QApplication, scheme: Scheme | None = None) -> None:
    """Style every window of `qapp`: `scheme` forces one (tests), None follows the system, also
    when the person switches it while the app runs."""
    state = _state()
    if not state.listening:
        qapp.styleHints().colorSchemeChanged.connect(lambda _scheme: _follow(qapp))
        state.listening = True
    state.follow_system = scheme is None
    _apply(qapp, scheme or system_scheme(qapp))


def _follow(qapp: QApplication) -> None:
    if _state().follow_system:
        _apply(qapp, system_scheme(qapp))


def _apply(qapp: QApplication, scheme: Scheme) -> None:
    state = _state()
    state.scheme = scheme
    c = SCHEMES[scheme]
    qapp.setStyle("Fusion")  # the platform styles ignore a dark palette on Windows
    qapp.setPalette(palette(c))
    qapp.setStyleSheet(stylesheet(c, base_point_size(qapp)))
    state.changed.emit()


def base_point_size(qapp: QGuiApplication) -> float:
    size = qapp.font().pointSizeF()
    return size if size > 0 else DEFAULT_POINT_SIZE


def palette(c: Colours) -> QPalette:
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: c.window,
        QPalette.ColorRole.WindowText: c.text,
        QPalette.ColorRole.Base: c.card,
        QPalette.ColorRole.AlternateBase: c.window,
        QPalette.ColorRole.Text: c.text,
        QPalette.ColorRole.Button: c.button,
        QPalette.ColorRole.ButtonText: c.text,
        QPalette.ColorRole.BrightText: c.error,
        QPalette.ColorRole.ToolTipBase: c.card,
        QPalette.ColorRole.ToolTipText: c.text,
        QPalette.ColorRole.PlaceholderText: c.muted,
        QPalette.ColorRole.Highlight: c.accent,
        QPalette.ColorRole.HighlightedText: c.on_accent,
        QPalette.ColorRole.Link: c.link,
        QPalette.ColorRole.Mid: c.border,
    }
    for role, colour in roles.items():
        p.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c.muted))
    return p


@cache
def _image_dir() -> Path:
    """This process's own folder for the painted images (a stylesheet names images by path),
    removed when the process ends."""
    folder = Path(tempfile.mkdtemp(prefix="gpu-provider-theme-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _painted(name: str, colour: str, size: tuple[int, int], draw: Callable[[QPainter], None]) -> str:
    """An image a stylesheet names by path, painted once per colour into this process's folder."""
    path = _image_dir() / f"{name}-{colour.lstrip('#').lower()}.png"
    if not path.exists():
        image = QImage(*size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        draw(painter)
        painter.end()
        image.save(str(path))
    return path.as_posix()


def arrow_image(colour: str, up: bool) -> str:
    """A spin box's arrow in `colour`: with its buttons styled, Qt draws no arrow of its own (a spin
    box read as a plain text field)."""
    tip, base = (1.0, 11.0) if up else (11.0, 1.0)

    def draw(painter: QPainter) -> None:
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(colour))
        painter.drawPolygon(QPolygonF([QPointF(2, base), QPointF(18, base), QPointF(10, tip)]))

    return _painted("up" if up else "down", colour, (20, 12), draw)


def check_image(colour: str) -> str:
    """A ticked box's tick in `colour` (a styled indicator loses the style's own)."""

    def draw(painter: QPainter) -> None:
        painter.setPen(QPen(QColor(colour), 3.2, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap,
                            Qt.PenJoinStyle.RoundJoin))
        painter.drawPolyline(QPolygonF([QPointF(5, 12.5), QPointF(9.5, 17), QPointF(19, 7)]))

    return _painted("check", colour, (24, 24), draw)


def dot_image(colour: str) -> str:
    """A chosen radio button's dot in `colour`."""

    def draw(painter: QPainter) -> None:
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(QColor(colour))
        painter.drawEllipse(QPointF(12, 12), 5, 5)

    return _painted("dot", colour, (24, 24), draw)


def stylesheet(c: Colours, base_pt: float) -> str:
    """The object names other windows use; every size is a multiple of the system font's."""

    def pt(scale: float) -> str:
        return f"{base_pt * scale:.1f}pt"

    def px(scale: float) -> str:
        """A control's part (a box, an arrow) sized as the text beside it: pixels from the font's points."""
        return f"{max(1, round(base_pt * 96 / 72 * scale))}px"

    return f"""
QMainWindow, QDialog, QScrollArea, QWidget#content {{ background: {c.window}; }}
QLabel, QCheckBox, QRadioButton {{ color: {c.text}; }}
QFrame#card, QFrame#panel {{ background: {c.card}; border: 1px solid {c.border}; border-radius: 10px; }}
QLabel#cardTitle {{ color: {c.muted}; font-size: {pt(0.9)}; font-weight: 600; letter-spacing: 1px; }}
QLabel#appTitle {{ font-size: {pt(1.6)}; font-weight: 700; }}
QLabel#heading {{ font-size: {pt(1.3)}; font-weight: 700; }}
QLabel#statValue {{ font-size: {pt(1.9)}; font-weight: 700; }}
QLabel#rowTitle {{ font-weight: 600; }}
QLabel#muted, QLabel#subtitle {{ color: {c.muted}; }}
QLabel#caption {{ color: {c.muted}; font-size: {pt(0.9)}; }}
QLabel#error {{ color: {c.error}; }}
QLabel#warning {{ color: {c.warning}; }}
QLabel#dimmed {{ color: {c.muted}; }}
QLabel[dimmed="true"] {{ color: {c.muted}; }}
QFrame#banner {{ background: {c.error_bg}; border: 1px solid {c.error_border}; border-radius: 10px; }}
QFrame#banner[kind="info"] {{ background: {c.info_bg}; border: 1px solid {c.info_border}; }}
QFrame#banner[kind="warning"] {{ background: {c.warning_bg}; border: 1px solid {c.warning_border}; }}
QProgressBar {{ border: none; background: {c.track}; border-radius: 4px; max-height: 8px; }}
QProgressBar::chunk {{ background: {c.accent}; border-radius: 4px; }}
QPushButton {{ color: {c.text}; background: {c.button}; border: 1px solid {c.control};
    border-radius: 6px; padding: 6px 14px; }}
QPushButton:focus, QLineEdit:focus, QSpinBox:focus, QDoubleSpinBox:focus, QComboBox:focus, QSlider:focus {{
    border: 2px solid {c.accent}; }}
QPushButton:hover {{ border-color: {c.accent}; }}
QPushButton:disabled {{ color: {c.muted}; }}
QPushButton#primary {{ background: {c.accent}; color: {c.on_accent}; border: none; font-weight: 600; }}
QToolButton {{ color: {c.link}; background: transparent; border: none; padding: 2px 0; }}
QLineEdit, QSpinBox, QDoubleSpinBox, QComboBox, QTimeEdit {{ color: {c.text}; background: {c.card};
    border: 1px solid {c.control}; border-radius: 4px; padding: 3px 6px; }}
QSpinBox, QDoubleSpinBox {{ padding-right: {px(1.8)}; }}
QSpinBox::up-button, QDoubleSpinBox::up-button, QSpinBox::down-button, QDoubleSpinBox::down-button {{
    subcontrol-origin: padding; width: {px(1.4)}; background: {c.button}; border-left: 1px solid {c.control}; }}
QSpinBox::up-button, QDoubleSpinBox::up-button {{ subcontrol-position: top right; }}
QSpinBox::down-button, QDoubleSpinBox::down-button {{ subcontrol-position: bottom right; }}
QSpinBox::up-arrow, QDoubleSpinBox::up-arrow {{ image: url({arrow_image(c.text, True)}); width: {px(0.7)}; }}
QSpinBox::down-arrow, QDoubleSpinBox::down-arrow {{ image: url({arrow_image(c.text, False)}); width: {px(0.7)}; }}
QSpinBox::up-arrow:disabled, QSpinBox::up-arrow:off, QDoubleSpinBox::up-arrow:disabled,
QDoubleSpinBox::up-arrow:off {{ image: url({arrow_image(c.muted, True)}); }}
QSpinBox::down-arrow:disabled, QSpinBox::down-arrow:off, QDoubleSpinBox::down-arrow:disabled,
QDoubleSpinBox::down-arrow:off {{ image: url({arrow_image(c.muted, False)}); }}
QCheckBox::indicator, QRadioButton::indicator {{ width: {px(1.1)}; height: {px(1.1)};
    background: {c.card}; border: 1px solid {c.control}; }}
QCheckBox::indicator {{ border-radius: 3px; }}
QRadioButton::indicator {{ border-radius: {px(0.6)}; }}
QCheckBox::indicator:checked {{ background: {c.accent}; border-color: {c.accent};
    image: url({check_image(c.on_accent)}); }}
QRadioButton::indicator:checked {{ background: {c.accent}; border-color: {c.accent};
    image: url({dot_image(c.on_accent)}); }}
QCheckBox::indicator:disabled, QRadioButton::indicator:disabled {{ border-color: {c.border}; }}
QSlider::groove:horizontal {{ height: {px(0.3)}; background: {c.control}; border-radius: 2px; }}
QSlider::sub-page:horizontal {{ background: {c.accent}; border-radius: 2px; }}
QSlider::handle:horizontal {{ background: {c.accent}; border: 2px solid {c.card}; width: {px(1.2)};
    margin: -{px(0.5)} 0; border-radius: {px(0.6)}; }}
QPlainTextEdit, QTextEdit {{ color: {c.text}; background: {c.window}; border: 1px solid {c.border};
    font-family: monospace; font-size: {pt(0.9)}; }}
QToolTip {{ color: {c.text}; background: {c.card}; border: 1px solid {c.border}; }}
"""
