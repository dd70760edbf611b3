"""Game detection on macOS: the policy on window lists in the shape `CGWindowListCopyWindowInfo`
returns them (a 14-inch MacBook Pro's 1512×982-point display, a 2560×1440 one beside it), and the
ctypes edge against stand-ins for the framework functions themselves."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest

from worker.node import autopause, macwindows
from worker.node.autopause import (
    FULLSCREEN_ONLY_MAC,
    FULLSCREEN_ONLY_WINDOWS,
    GAMES_NOT_SEEN,
    AutoPauser,
    MacFullScreen,
    ScreenWindow,
    default_fullscreen_probe,
    detection_limit,
    full_screen_apps,
)
from worker.node.macwindows import Rect
from worker.system.config import Settings
from tests.worker.node.test_autopause import FakeNode

OWN_PID = 812
LAPTOP = Rect(0, 0, 1512, 982)
EXTERNAL = Rect(1512, -458, 2560, 1440)


def window(owner: str, pid: int, layer: int, x: float, y: float, w: float, h: float, alpha: float = 1.0) -> dict[str, Any]:
    return {"kCGWindowLayer": layer, "kCGWindowOwnerName": owner, "kCGWindowOwnerPID": pid, "kCGWindowAlpha": alpha,
            "kCGWindowBounds": {"X": x, "Y": y, "Width": w, "Height": h}}


MENU_BAR = window("Window Server", 391, 24, 0, 0, 1512, 37)
DOCK = window("Dock", 604, 20, 0, 0, 1512, 982)  # the Dock's own window spans the display, above apps
CONTROL_CENTER = window("Control Center", 611, 25, 1380, 0, 40, 37)
DESKTOP = window("Finder", 640, -2147483603, 0, 0, 1512, 982)  # the desktop, if it were listed
SAFARI_ZOOMED = window("Safari", 2210, 0, 0, 37, 1512, 870)  # under the menu bar, above the Dock
OURS = window("GPU Provider", OWN_PID, 0, 0, 0, 1512, 982)  # our dashboard, full screen
GAME = window("Baldur's Gate 3", 5120, 0, 0, 0, 1512, 982)
GAME_ON_EXTERNAL = window("Cyberpunk 2077", 5200, 0, 1512, -458, 2560, 1440)
INVISIBLE = window("Magnet", 733, 0, 0, 0, 1512, 982, alpha=0.0)  # a transparent overlay

DESKTOP_NOW = [MENU_BAR, CONTROL_CENTER, SAFARI_ZOOMED, DOCK, DESKTOP]


def apps(infos: list[dict[str, Any]], displays: list[Rect] | None = None) -> list[str]:
    windows = [w for info in infos if (w := ScreenWindow.from_info(info)) is not None]
    return full_screen_apps(windows, displays or [LAPTOP], own_pid=OWN_PID)


def test_a_full_screen_game_is_seen_by_its_name() -> None:
    assert apps([GAME, *DESKTOP_NOW]) == ["Baldur's Gate 3"]


def test_a_maximised_browser_the_menu_bar_dock_and_desktop_are_not_full_screen() -> None:
    assert apps(DESKTOP_NOW) == []


def test_our_own_window_and_a_transparent_overlay_never_count() -> None:
    assert apps([OURS, INVISIBLE, *DESKTOP_NOW]) == []


def test_a_game_full_screen_on_the_second_display_is_seen() -> None:
    assert apps([GAME_ON_EXTERNAL, *DESKTOP_NOW], [LAPTOP, EXTERNAL]) == ["Cyberpunk 2077"]
    assert apps([GAME_ON_EXTERNAL], [LAPTOP]) == []  # not covering the laptop's display


def test_a_window_missing_what_the_policy_needs_is_skipped() -> None:
    assert ScreenWindow.from_info({"kCGWindowLayer": 0, "kCGWindowOwnerPID": 7}) is None
    assert ScreenWindow.from_info({**GAME, "kCGWindowBounds": {"X": 0, "Y": 0}}) is None
    unnamed = ScreenWindow.from_info({k: v for k, v in GAME.items() if k != "kCGWindowOwnerName"})
    assert unnamed is not None and full_screen_apps([unnamed], [LAPTOP], own_pid=OWN_PID) == [autopause.FULLSCREEN_APP]


class RecordedWindowList:
    def __init__(self, *lists: list[dict[str, Any]], displays: list[Rect] | None = None) -> None:
        self.lists = list(lists)
        self._displays = displays or [LAPTOP]

    def windows(self) -> list[dict[str, Any]]:
        if not self.lists:
            raise OSError("macOS gave no window list")
        return self.lists.pop(0)

    def displays(self) -> list[Rect]:
        return self._displays


def mac_pauser(node: FakeNode, window_list: RecordedWindowList, settings: Settings, now: list[float]) -> AutoPauser:
    probe = MacFullScreen(window_list, own_pid=OWN_PID)  # type: ignore[arg-type]
    return AutoPauser(node, lambda: settings, lambda: [], fullscreen=probe, clock=lambda: now[0], local_hour=lambda: 12.0)


async def test_the_mac_poller_pauses_for_a_full_screen_game_and_resumes_after_it() -> None:
    node, now = FakeNode(), [0.0]
    listing = RecordedWindowList(DESKTOP_NOW, [GAME, *DESKTOP_NOW], DESKTOP_NOW, DESKTOP_NOW)
    pauser = mac_pauser(node, listing, Settings(auto_resume_after_s=60), now)
    assert await pauser.tick() is None
    assert await pauser.tick() == autopause.Action("pause", "game", "Baldur's Gate 3")
    now[0] = 30
    assert await pauser.tick() is None
    now[0] = 61
    assert await pauser.tick() == autopause.Action("resume")


async def test_an_ignored_app_full_screen_does_not_pause_and_an_unreadable_list_sees_nothing() -> None:
    settings = Settings(autopause_ignored=("Baldur's Gate 3",))
    pauser = mac_pauser(FakeNode(), RecordedWindowList([GAME]), settings, [0.0])
    assert await pauser.tick() is None
    assert await pauser.tick() is None  # the list is gone now: logged once, nothing paused


async def test_a_browser_playing_a_video_full_screen_is_not_a_game() -> None:
    safari_full = window("Safari", 2210, 0, 0, 0, 1512, 982)
    pauser = mac_pauser(FakeNode(), RecordedWindowList([safari_full, *DESKTOP_NOW[:2]]), Settings(), [0.0])
    assert await pauser.tick() is None


def test_where_games_cannot_all_be_seen_the_setting_says_so() -> None:
    assert detection_limit(nvml=True, platform="linux") is None
    assert detection_limit(nvml=True, platform="win32") is None
    assert detection_limit(nvml=False, platform="win32") == FULLSCREEN_ONLY_WINDOWS
    assert detection_limit(nvml=False, platform="linux") == GAMES_NOT_SEEN
    assert detection_limit(nvml=False, platform="darwin", window_list=lambda: object()) == FULLSCREEN_ONLY_MAC
    assert detection_limit(nvml=False, platform="darwin", window_list=lambda: None) == GAMES_NOT_SEEN


def test_without_coregraphics_the_mac_probe_sees_nothing_and_says_so() -> None:
    """On this Linux machine the frameworks really are absent: the load fails as it would."""
    assert default_fullscreen_probe("darwin")() == []
    assert detection_limit(nvml=False, platform="darwin") == GAMES_NOT_SEEN


# --- the ctypes edge ----------------------------------------------------------------------------

C = ctypes
HEADERS = {  # from CGWindow.h, CGDirectDisplay.h, CGGeometry.h, CFString.h, CFArray.h, CFDictionary.h, CFNumber.h
    "CGWindowListCopyWindowInfo": ("CFArrayRef", ["CGWindowListOption", "CGWindowID"]),
    "CGRectMakeWithDictionaryRepresentation": ("bool", ["CFDictionaryRef", "CGRect *"]),
    "CGGetActiveDisplayList": ("CGError", ["uint32_t", "CGDirectDisplayID *", "uint32_t *"]),
    "CGDisplayBounds": ("CGRect", ["CGDirectDisplayID"]),
    "CFStringCreateWithCString": ("CFStringRef", ["CFAllocatorRef", "const char *", "CFStringEncoding"]),
    "CFArrayGetCount": ("CFIndex", ["CFArrayRef"]),
    "CFArrayGetValueAtIndex": ("const void *", ["CFArrayRef", "CFIndex"]),
    "CFDictionaryGetValue": ("const void *", ["CFDictionaryRef", "const void *"]),
    "CFNumberGetValue": ("Boolean", ["CFNumberRef", "CFNumberType", "void *"]),
    "CFStringGetCString": ("Boolean", ["CFStringRef", "char *", "CFIndex", "CFStringEncoding"]),
    "CFRelease": ("void", ["CFTypeRef"]),
}
C_TYPES: dict[str, Any] = {  # each C type as ctypes spells it on a 64-bit Mac
    "CFArrayRef": C.c_void_p, "CFDictionaryRef": C.c_void_p, "CFStringRef": C.c_void_p, "CFNumberRef": C.c_void_p,
    "CFTypeRef": C.c_void_p, "CFAllocatorRef": C.c_void_p, "const void *": C.c_void_p, "void *": C.c_void_p,
    "const char *": C.c_char_p, "char *": C.c_char_p, "CFIndex": C.c_long, "CFNumberType": C.c_long,
    "CFStringEncoding": C.c_uint32, "CGWindowListOption": C.c_uint32, "CGWindowID": C.c_uint32,
    "CGDirectDisplayID": C.c_uint32, "uint32_t": C.c_uint32, "CGError": C.c_int32, "bool": C.c_bool,
    "Boolean": C.c_bool, "void": None, "CGRect": macwindows.CGRect, "CGRect *": C.POINTER(macwindows.CGRect),
    "CGDirectDisplayID *": C.POINTER(C.c_uint32), "uint32_t *": C.POINTER(C.c_uint32),
}


def test_every_prototype_matches_its_header() -> None:
    assert set(macwindows.PROTOTYPES) == set(HEADERS)
    for name, (restype, argtypes) in HEADERS.items():
        assert macwindows.PROTOTYPES[name] == (C_TYPES[restype], [C_TYPES[a] for a in argtypes]), name
    assert C.sizeof(macwindows.CGRect) == 32  # CGPoint + CGSize of CGFloat (double)


class Function:
    """A stand-in for one ctypes foreign function: the prototype set on it, then Python behind it."""

    def __init__(self, behaviour: Any) -> None:
        self.behaviour, self.restype, self.argtypes = behaviour, "unset", "unset"

    def __call__(self, *args: Any) -> Any:
        assert self.restype != "unset" and self.argtypes != "unset", "called before its prototype was set"
        return self.behaviour(*args)


class Frameworks:
    """CoreGraphics and CoreFoundation over Python objects: an id stands for each CF object."""

    def __init__(self, windows: list[dict[str, Any]], displays: list[Rect], *, listed: bool = True) -> None:
        self.objects: dict[int, Any] = {}
        self.released: list[int] = []
        self.loaded: list[str] = []
        self.windows = windows
        self.display_bounds = displays
        self.listed = listed
        self.functions = {name: Function(getattr(self, name)) for name in macwindows.PROTOTYPES}

    def load(self, path: str) -> SimpleNamespace:
        """`ctypes.CDLL(path)`: a library whose attributes are its functions."""
        self.loaded.append(path)
        prefix = "CG" if path == macwindows.CORE_GRAPHICS else "CF"
        return SimpleNamespace(**{n: f for n, f in self.functions.items() if n.startswith(prefix)})

    def _new(self, value: Any) -> int:
        self.objects[len(self.objects) + 1] = value
        return len(self.objects)

    def CGWindowListCopyWindowInfo(self, option: int, relative_to: int) -> int | None:
        assert option == macwindows.ON_SCREEN_ONLY | macwindows.EXCLUDE_DESKTOP_ELEMENTS and relative_to == 0
        if not self.listed:
            return None
        return self._new([self._new({self._key(k): self._new(v) for k, v in w.items()}) for w in self.windows])

    def _key(self, text: str) -> int:
        return next(i for i, v in self.objects.items() if v == ("key", text))

    def CFStringCreateWithCString(self, allocator: None, text: bytes, encoding: int) -> int:
        assert encoding == macwindows.UTF8
        return self._new(("key", text.decode()))

    def CFArrayGetCount(self, array: int) -> int:
        return len(self.objects[array])

    def CFArrayGetValueAtIndex(self, array: int, index: int) -> int:
        return int(self.objects[array][index])

    def CFDictionaryGetValue(self, dictionary: int, key: int) -> int | None:
        return self.objects[dictionary].get(key)

    def CFNumberGetValue(self, number: int, kind: int, out: Any) -> bool:
        out._obj.value = self.objects[number]
        return True

    def CFStringGetCString(self, text: int, buffer: Any, size: int, encoding: int) -> bool:
        buffer.value = self.objects[text].encode()[: size - 1]
        return True

    def CGRectMakeWithDictionaryRepresentation(self, dictionary: int, rect: Any) -> bool:
        box = self.objects[dictionary]
        rect._obj.x, rect._obj.y, rect._obj.width, rect._obj.height = box["X"], box["Y"], box["Width"], box["Height"]
        return True

    def CGGetActiveDisplayList(self, most: int, ids: Any, count: Any) -> int:
        for i in range(len(self.display_bounds)):
            ids[i] = 100 + i
        count._obj.value = len(self.display_bounds)
        return 0

    def CGDisplayBounds(self, display: int) -> macwindows.CGRect:
        r = self.display_bounds[display - 100]
        return macwindows.CGRect(r.x, r.y, r.width, r.height)

    def CFRelease(self, handle: int) -> None:
        self.released.append(handle)


def test_the_edge_sets_every_prototype_and_reads_the_window_list() -> None:
    frameworks = Frameworks([GAME, MENU_BAR], [LAPTOP, EXTERNAL])
    listing = macwindows.WindowList(load=frameworks.load)
    assert frameworks.loaded == [macwindows.CORE_GRAPHICS, macwindows.CORE_FOUNDATION]
    for name, (restype, argtypes) in macwindows.PROTOTYPES.items():
        assert (frameworks.functions[name].restype, frameworks.functions[name].argtypes) == (restype, argtypes)
    assert listing.windows() == [GAME, MENU_BAR]
    assert listing.displays() == [LAPTOP, EXTERNAL]
    array = max(i for i, v in frameworks.objects.items() if isinstance(v, list))
    assert frameworks.released == [array]  # the copied array, and only what was copied


def test_no_window_list_is_an_os_error_the_probe_survives() -> None:
    frameworks = Frameworks([GAME], [LAPTOP], listed=False)
    listing = macwindows.WindowList(load=frameworks.load)
    with pytest.raises(OSError, match="no window list"):
        listing.windows()
    assert MacFullScreen(listing, own_pid=OWN_PID)() == []


def test_the_probe_reads_a_game_through_the_edge() -> None:
    frameworks = Frameworks([*DESKTOP_NOW[:2], GAME, *DESKTOP_NOW[2:]], [LAPTOP])
    assert MacFullScreen(macwindows.WindowList(load=frameworks.load), own_pid=OWN_PID)() == ["Baldur's Gate 3"]
