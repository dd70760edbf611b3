"""Tray and window icons, painted rather than loaded, so they need no image plugin.

Each icon is a disc in the state's colour with a white glyph and a thin dark rim plus a light
halo, so it reads on light and dark panels alike.
"""

from __future__ import annotations

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

from app.format import STATE_COLOURS, TrayState

ICON_SIZES = (16, 22, 24, 32, 48, 64, 128, 256)


def state_pixmap(state: TrayState, size: int) -> QPixmap:
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    unit = size / 16
    disc = QRectF(1 * unit, 1 * unit, 14 * unit, 14 * unit)
    painter.setPen(QPen(QColor(255, 255, 255, 200), max(1.0, unit)))
    painter.setBrush(QColor(STATE_COLOURS[state]))
    painter.drawEllipse(disc.adjusted(-0.5 * unit, -0.5 * unit, 0.5 * unit, 0.5 * unit))
    painter.setPen(QPen(QColor(0, 0, 0, 90), max(0.6, 0.5 * unit)))
    painter.drawEllipse(disc)
    _draw_glyph(painter, state, unit)
    painter.end()
    return pixmap


def _draw_glyph(painter: QPainter, state: TrayState, unit: float) -> None:
    white = QColor("#FFFFFF")
    painter.setBrush(white)
    painter.setPen(Qt.PenStyle.NoPen)
    if state == "serving":
        path = QPainterPath(QPointF(6.2 * unit, 4.6 * unit))
        path.lineTo(11.6 * unit, 8 * unit)
        path.lineTo(6.2 * unit, 11.4 * unit)
        path.closeSubpath()
        painter.drawPath(path)
    elif state == "paused":
        painter.drawRoundedRect(QRectF(5.2 * unit, 4.8 * unit, 2 * unit, 6.4 * unit), 0.5 * unit, 0.5 * unit)
        painter.drawRoundedRect(QRectF(8.8 * unit, 4.8 * unit, 2 * unit, 6.4 * unit), 0.5 * unit, 0.5 * unit)
    elif state == "degraded":  # "!": serving, but something needs a look
        painter.drawRoundedRect(QRectF(7.1 * unit, 3.8 * unit, 1.8 * unit, 5.4 * unit), 0.6 * unit, 0.6 * unit)
        painter.drawEllipse(QRectF(7.05 * unit, 10.2 * unit, 1.9 * unit, 1.9 * unit))
    elif state == "failed":  # "×": not serving; a different shape, not only a different red
        pen = QPen(white, 1.9 * unit, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap)
        painter.setPen(pen)
        painter.drawLine(QPointF(5.4 * unit, 5.4 * unit), QPointF(10.6 * unit, 10.6 * unit))
        painter.drawLine(QPointF(10.6 * unit, 5.4 * unit), QPointF(5.4 * unit, 10.6 * unit))
    elif state == "starting":
        pen = QPen(white, 1.8 * unit, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap)
        painter.setPen(pen)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawArc(QRectF(4.4 * unit, 4.4 * unit, 7.2 * unit, 7.2 * unit), 90 * 16, -270 * 16)
    else:
        painter.drawEllipse(QRectF(6 * unit, 6 * unit, 4 * unit, 4 * unit))


def state_icon(state: TrayState) -> QIcon:
    icon = QIcon()
    for size in ICON_SIZES:
        icon.addPixmap(state_pixmap(state, size))
    return icon
