"""macOS: the windows on screen now and the displays they sit on, from CoreGraphics via ctypes.

The one place auto-pause touches a macOS framework, kept to what the policy needs: per window its
layer, owner (pid and name), alpha and bounds, as `CGWindowListCopyWindowInfo` names them, and
each display's bounds. Window titles are never asked for (they need the Screen Recording
permission; owners and bounds do not). Every C function's prototype is declared in `PROTOTYPES`
and set before any call, so a wrong type cannot reach the frameworks silently.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CORE_GRAPHICS = "/System/Library/Frameworks/CoreGraphics.framework/CoreGraphics"
CORE_FOUNDATION = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"

ON_SCREEN_ONLY = 1 << 0  # kCGWindowListOptionOnScreenOnly: the current Space, not minimised or hidden
EXCLUDE_DESKTOP_ELEMENTS = 1 << 4  # kCGWindowListExcludeDesktopElements: no wallpaper or desktop icons
NULL_WINDOW_ID = 0  # kCGNullWindowID
SINT64 = 4  # kCFNumberSInt64Type
FLOAT64 = 6  # kCFNumberFloat64Type
UTF8 = 0x08000100  # kCFStringEncodingUTF8
MAX_DISPLAYS = 16
MAX_WINDOWS = 2048  # a desktop has a few hundred; more is read no further
NAME_BYTES = 256

LAYER, OWNER_PID, ALPHA = "kCGWindowLayer", "kCGWindowOwnerPID", "kCGWindowAlpha"
OWNER_NAME, BOUNDS = "kCGWindowOwnerName", "kCGWindowBounds"
NUMBER_KEYS = {LAYER: SINT64, OWNER_PID: SINT64, ALPHA: FLOAT64}


class CGRect(ctypes.Structure):
    """CGRect on a 64-bit Mac: origin then size, four CGFloat (double)."""

    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_double),
                ("width", ctypes.c_double), ("height", ctypes.c_double)]


# name: (restype, argtypes), from the CoreGraphics and CoreFoundation headers.
PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "CGWindowListCopyWindowInfo": (ctypes.c_void_p, [ctypes.c_uint32, ctypes.c_uint32]),
    "CGRectMakeWithDictionaryRepresentation": (ctypes.c_bool, [ctypes.c_void_p, ctypes.POINTER(CGRect)]),
    "CGGetActiveDisplayList": (
        ctypes.c_int32, [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]),
    "CGDisplayBounds": (CGRect, [ctypes.c_uint32]),
    "CFStringCreateWithCString": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]),
    "CFArrayGetCount": (ctypes.c_long, [ctypes.c_void_p]),
    "CFArrayGetValueAtIndex": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_long]),
    "CFDictionaryGetValue": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]),
    "CFNumberGetValue": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]),
    "CFStringGetCString": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_long, ctypes.c_uint32]),
    "CFRelease": (None, [ctypes.c_void_p]),
}


@dataclass(frozen=True)
class Rect:
    """A rectangle in global display points (origin at the main display's top left)."""

    x: float
    y: float
    width: float
    height: float


class WindowList:
    """The two frameworks, loaded and typed once; raises OSError where they cannot be loaded."""

    def __init__(self, load: Callable[[str], Any] = ctypes.CDLL) -> None:
        libraries = {path: load(path) for path in (CORE_GRAPHICS, CORE_FOUNDATION)}
        self._fn: dict[str, Any] = {}
        for name, (restype, argtypes) in PROTOTYPES.items():
            function = getattr(libraries[CORE_GRAPHICS if name.startswith("CG") else CORE_FOUNDATION], name)
            function.restype, function.argtypes = restype, argtypes
            self._fn[name] = function
        self._keys = {key: self._fn["CFStringCreateWithCString"](None, key.encode(), UTF8)
                      for key in (*NUMBER_KEYS, OWNER_NAME, BOUNDS)}

    def windows(self) -> list[dict[str, object]]:
        """Each on-screen window's known keys, in front-to-back order, with Python values."""
        array = self._fn["CGWindowListCopyWindowInfo"](ON_SCREEN_ONLY | EXCLUDE_DESKTOP_ELEMENTS, NULL_WINDOW_ID)
        if not array:
            raise OSError("macOS gave no window list")
        try:
            count = min(int(self._fn["CFArrayGetCount"](array)), MAX_WINDOWS)
            return [self._window(self._fn["CFArrayGetValueAtIndex"](array, i)) for i in range(count)]
        finally:
            self._fn["CFRelease"](array)

    def displays(self) -> list[Rect]:
        """The bounds of every active display."""
        ids = (ctypes.c_uint32 * MAX_DISPLAYS)()
        count = ctypes.c_uint32(0)
        if self._fn["CGGetActiveDisplayList"](MAX_DISPLAYS, ids, ctypes.byref(count)) != 0:
            raise OSError("macOS gave no display list")
        bounds = [self._fn["CGDisplayBounds"](ids[i]) for i in range(min(count.value, MAX_DISPLAYS))]
        return [Rect(b.x, b.y, b.width, b.height) for b in bounds]

    def _window(self, info: Any) -> dict[str, object]:
        window: dict[str, object] = {}
        for key, kind in NUMBER_KEYS.items():
            number = ctypes.c_int64() if kind == SINT64 else ctypes.c_double()
            value = self._get(info, key)
            if value and self._fn["CFNumberGetValue"](value, kind, ctypes.byref(number)):
                window[key] = number.value
        name = self._get(info, OWNER_NAME)
        text = ctypes.create_string_buffer(NAME_BYTES)
        if name and self._fn["CFStringGetCString"](name, text, NAME_BYTES, UTF8):
            window[OWNER_NAME] = text.value.decode("utf-8", "replace")
        bounds, rect = self._get(info, BOUNDS), CGRect()
        if bounds and self._fn["CGRectMakeWithDictionaryRepresentation"](bounds, ctypes.byref(rect)):
            window[BOUNDS] = {"X": rect.x, "Y": rect.y, "Width": rect.width, "Height": rect.height}
        return window

    def _get(self, info: Any, key: str) -> Any:
        return self._fn["CFDictionaryGetValue"](info, self._keys[key])
