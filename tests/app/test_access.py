"""Fit and access: every control stands out from what it sits on (3:1 or more, WCAG's non-text
contrast) in both schemes, spin boxes show their arrows, and every control a keyboard or a screen
reader reaches has a name."""

from __future__ import annotations

from dataclasses import replace

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QAccessible, QColor, QImage
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractSpinBox,
    QCheckBox,
    QComboBox,
    QDialog,
    QFrame,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QRadioButton,
    QSlider,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app import theme
from app.dashboard import Dashboard
from app.first_run import FirstRunFlow
from app.logs import LogsWindow
from app.settings import SettingsDialog
from tests.app import snapshots
from tests.app.conftest import REAL
from tests.app.test_dashboard import contrast
from tests.app.test_downloads import downloading
from worker.system import networks
from worker.system.config import Settings

INTERACTIVE = (QAbstractButton, QLineEdit, QAbstractSpinBox, QComboBox, QSlider, QPlainTextEdit)


def controls() -> dict[str, QWidget]:
    """Each kind of control, bare (no text: only its own edges can set it apart)."""
    spin = QSpinBox()
    spin.setRange(0, 10)
    spin.setValue(5)
    slider = QSlider(Qt.Orientation.Horizontal)
    slider.setValue(50)
    button = QPushButton()
    button.setFixedSize(80, 30)
    return {"unchecked check box": QCheckBox(), "unchecked radio button": QRadioButton(), "text field": QLineEdit(),
            "spin box": spin, "list": QComboBox(), "button": button, "slider": slider}


def strongest_contrast(widget: QWidget, background: str) -> float:
    image = widget.grab().toImage().convertToFormat(QImage.Format.Format_RGB32)
    behind = QColor(background)
    colours = {image.pixel(x, y) for x in range(image.width()) for y in range(image.height())}
    return max(contrast(QColor(rgb), behind) for rgb in colours)


@pytest.mark.parametrize("on", ["window", "card"])
def test_every_control_stands_out_3_to_1_in_both_schemes(qtbot, scheme, on):
    colours = theme.colours()
    window = QDialog()
    qtbot.addWidget(window)
    holder = QFrame()
    holder.setObjectName("card" if on == "card" else "")
    QVBoxLayout(window).addWidget(holder)
    made = controls()
    column = QVBoxLayout(holder)
    for control in made.values():
        column.addWidget(control)
    window.show()
    qtbot.waitExposed(window)
    background = colours.card if on == "card" else colours.window
    for name, control in made.items():
        assert strongest_contrast(control, background) >= 3.0, f"{name} on the {on} ({scheme})"


def test_spin_boxes_show_their_arrows(qtbot, scheme):
    colours = theme.colours()
    box = controls()["spin box"]
    qtbot.addWidget(box)
    box.resize(140, box.sizeHint().height())
    box.show()
    qtbot.waitExposed(box)
    image = box.grab().toImage().convertToFormat(QImage.Format.Format_RGB32)
    text = QColor(colours.text)
    strip = [QColor(image.pixel(x, y)) for x in range(image.width() - 22, image.width())
             for y in range(image.height())]  # where the up and down buttons are
    near_text = [c for c in strip if contrast(c, text) < 2.0]
    assert len(near_text) >= 6, "no arrow drawn in the spin box's buttons"


def unnamed(root: QWidget) -> list[str]:
    """Interactive widgets a screen reader would announce without a name."""
    missing = []
    for widget in [root, *root.findChildren(QWidget)]:
        if not isinstance(widget, INTERACTIVE) or not widget.isVisibleTo(root):
            continue
        if isinstance(widget.parent(), QAbstractSpinBox):
            continue  # a spin box's own text field: the spin box carries the name
        name = QAccessible.queryAccessibleInterface(widget).text(QAccessible.Text.Name)
        if not name.strip():
            missing.append(f"{type(widget).__name__} {widget.objectName()!r} {widget.toolTip()!r} "
                           f"{getattr(widget, 'text', lambda: '')()!r} {getattr(widget, 'placeholderText', lambda: '')()!r}")
    return missing


def test_every_interactive_widget_has_a_name(qtbot, qapp, paths, node, bridge, login_item):
    theme.install(qapp, "light")
    node.emit(replace(downloading(), engines=snapshots.serving().engines))
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    settings = SettingsDialog(Settings(), paths, bridge, login_item, choices=(REAL, networks.LOCAL))
    qtbot.addWidget(settings)
    flow = FirstRunFlow(Settings(), bridge, login_item, choices=(REAL, networks.LOCAL))
    qtbot.addWidget(flow)
    logs = LogsWindow(bridge, lambda text: text)
    qtbot.addWidget(logs)
    windows: list[QWidget] = [dashboard, settings, logs, flow]
    for page in range(settings.tabs.count()):
        settings.tabs.setCurrentIndex(page)
        assert unnamed(settings) == [], (settings.tabs.tabText(page), unnamed(settings))
    while True:
        assert unnamed(flow) == [], flow.currentId()
        if flow.nextId() == -1:
            break
        flow.next()
    for window in windows:
        window.show()
        assert unnamed(window) == [], type(window).__name__


def test_the_settings_dialog_fits_a_1366_by_768_screen_at_150_percent(qtbot, qapp, paths, bridge, login_item):
    from PySide6.QtGui import QFont

    before = QFont(qapp.font())
    bigger = QFont(before)
    bigger.setPointSizeF(theme.base_point_size(qapp) * 1.5)
    qapp.setFont(bigger)
    try:
        theme.install(qapp, "dark")
        dialog = SettingsDialog(Settings(), paths, bridge, login_item, choices=(REAL, networks.LOCAL))
        qtbot.addWidget(dialog)
        hint = dialog.minimumSizeHint()
        assert hint.width() <= 1366 and hint.height() + 40 + 30 <= 768  # taskbar and title bar
    finally:
        qapp.setFont(before)
