"""Keeping the computer awake while it serves: an idle gaming PC or Mac is exactly the one that
lends its card, and one that sleeps on its power plan's timer drops off the network.

`KeepAwake` takes the platform's assertion when the node starts serving and gives it back when it
stops (a pause, no engine ready, quitting, or the setting turned off); what the platform refuses
is logged once, never raised: serving goes on, only sleep may come.

- Windows: `SetThreadExecutionState(ES_CONTINUOUS | ES_SYSTEM_REQUIRED)`, as Microsoft asks of
  programs that serve the network. The state belongs to the calling thread, so a thread of its own
  sets it and lives exactly as long as the hold, then clears it.
- macOS: an IOKit `PreventUserIdleSystemSleep` assertion (IOPMAssertionCreateWithName /
  IOPMAssertionRelease). It also keeps the app out of App Nap, whose conditions include "has not
  taken any IOKit power management or NSProcessInfo assertions" (Apple's Energy Efficiency Guide),
  so no `NSProcessInfo beginActivity` through the Objective-C runtime is needed.
- Linux: logind's `Inhibit("sleep:idle", …, "block")` on the system D-Bus, held while the file
  descriptor it returns stays open; through jeepney, which keyring already installs on Linux (no
  new dependency). Without a system bus (a container, a server) there is nothing to inhibit.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

WHY = "GPU Provider is lending this computer's graphics card"
HOLD_START_S = 2.0  # the platform answers in milliseconds; it is asked on the node's loop


class PowerAssertion(Protocol):
    """One platform's way to keep the computer from sleeping; `acquire` raises when it refuses."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class KeepAwake:
    """The assertion held exactly while wanted: `want(True)` takes it once, `want(False)` gives it back."""

    def __init__(self, assertion: PowerAssertion | None) -> None:
        self._assertion = assertion
        self.held = False
        self._refused = False  # logged once: a platform that refuses refuses every time

    def want(self, awake: bool) -> None:
        if awake == self.held or self._assertion is None:
            return
        try:
            if awake:
                self._assertion.acquire()
            else:
                self._assertion.release()
        except Exception as exc:  # a platform call: whatever it raises, serving goes on
            if not self._refused:
                log.warning("could not %s keeping this computer awake: %s", "start" if awake else "stop", exc)
            self._refused = True
            return
        self.held = awake
        log.info("keeping this computer awake while it serves" if awake else "this computer may sleep again")


def platform_assertion() -> PowerAssertion | None:
    """This platform's assertion; None where there is none to take."""
    if os.name == "nt":
        return WindowsExecutionState(ctypes.WinDLL("kernel32", use_last_error=True))  # type: ignore[attr-defined]
    if sys.platform == "darwin":
        return MacSleepAssertion(ctypes.CDLL("/System/Library/Frameworks/IOKit.framework/IOKit"),
                                 ctypes.CDLL("/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"))
    if sys.platform.startswith("linux"):
        return LogindInhibitor() if system_bus_exists() else None
    return None


def system_bus_exists(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether there is a system D-Bus to ask logind on: a container or a server has none, and
    then there is no sleep to keep away (nothing to warn about either)."""
    address = environ.get("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/var/run/dbus/system_bus_socket")
    paths = [part.removeprefix("unix:path=") for part in address.split(";") if part.startswith("unix:path=")]
    return not paths or any(os.path.exists(path) for path in paths)


class WindowsExecutionState:
    """`SetThreadExecutionState` on a thread that lives as long as the hold (the state is per thread)."""

    ES_CONTINUOUS = 0x80000000
    ES_SYSTEM_REQUIRED = 0x00000001

    def __init__(self, kernel32: Any) -> None:
        from ctypes import wintypes

        self._set_state = kernel32.SetThreadExecutionState
        self._set_state.argtypes = [wintypes.DWORD]  # EXECUTION_STATE
        self._set_state.restype = wintypes.DWORD  # the previous state; 0 when it failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        started, result = threading.Event(), [0]
        self._stop.clear()
        self._thread = threading.Thread(target=self._hold, args=(started, result), name="keep-awake", daemon=True)
        self._thread.start()
        if not started.wait(HOLD_START_S) or not result[0]:
            self.release()
            raise OSError("Windows refused SetThreadExecutionState")

    def _hold(self, started: threading.Event, result: list[int]) -> None:
        result[0] = self._set_state(self.ES_CONTINUOUS | self.ES_SYSTEM_REQUIRED)
        started.set()
        self._stop.wait()
        self._set_state(self.ES_CONTINUOUS)  # this thread no longer needs the system

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(HOLD_START_S)
            self._thread = None


class MacSleepAssertion:
    """An IOKit `PreventUserIdleSystemSleep` assertion, named for Activity Monitor and `pmset -g assertions`."""

    LEVEL_ON = 255  # kIOPMAssertionLevelOn
    UTF8 = 0x08000100  # kCFStringEncodingUTF8

    def __init__(self, iokit: Any, corefoundation: Any) -> None:
        self._cf_string = corefoundation.CFStringCreateWithCString
        self._cf_string.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
        self._cf_string.restype = ctypes.c_void_p  # CFStringRef
        self._cf_release = corefoundation.CFRelease
        self._cf_release.argtypes = [ctypes.c_void_p]
        self._cf_release.restype = None
        self._create = iokit.IOPMAssertionCreateWithName
        self._create.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
        self._create.restype = ctypes.c_int32  # IOReturn
        self._release = iokit.IOPMAssertionRelease
        self._release.argtypes = [ctypes.c_uint32]  # IOPMAssertionID
        self._release.restype = ctypes.c_int32
        self._id: int | None = None

    def acquire(self) -> None:
        kind = self._cf_string(None, b"PreventUserIdleSystemSleep", self.UTF8)
        name = self._cf_string(None, WHY.encode(), self.UTF8)
        assertion = ctypes.c_uint32(0)
        try:
            code = self._create(kind, self.LEVEL_ON, name, ctypes.byref(assertion))
        finally:
            for made in (kind, name):
                if made:
                    self._cf_release(made)
        if code != 0:
            raise OSError(f"IOPMAssertionCreateWithName returned {code & 0xFFFFFFFF:#x}")
        self._id = assertion.value

    def release(self) -> None:
        if self._id is not None:
            self._release(self._id)
            self._id = None


class LogindInhibitor:
    """logind's sleep and idle inhibitor: held while the descriptor `Inhibit` returned is open."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def acquire(self) -> None:
        from jeepney import DBusAddress, new_method_call  # type: ignore[import-untyped]
        from jeepney.io.blocking import open_dbus_connection  # type: ignore[import-untyped]
        from jeepney.wrappers import unwrap_msg  # type: ignore[import-untyped]

        manager = DBusAddress("/org/freedesktop/login1", bus_name="org.freedesktop.login1",
                              interface="org.freedesktop.login1.Manager")
        call = new_method_call(manager, "Inhibit", "ssss", ("sleep:idle", "GPU Provider", WHY, "block"))
        with open_dbus_connection(bus="SYSTEM", enable_fds=True) as bus:
            [descriptor] = unwrap_msg(bus.send_and_get_reply(call, timeout=HOLD_START_S))
        self._fd = int(descriptor.to_raw_fd())

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
