"""Keeping the computer awake while it serves: each platform's calls checked against a fake of its
library (the prototypes ctypes is given, the arguments, the thread), never called for real; and
`KeepAwake` taking and giving back exactly once, a refusal logged once and never raised."""

from __future__ import annotations

import array
import ctypes
import logging
import os
import select
import socket
import threading
from collections.abc import Callable
from ctypes import wintypes
from pathlib import Path
from typing import Any

import pytest
from jeepney import HeaderFields, new_error, new_method_return
from jeepney.low_level import Parser

from worker.system import keepawake
from worker.system.keepawake import KeepAwake, LogindInhibitor, MacSleepAssertion, WindowsExecutionState


class Function:
    """One C function as ctypes hands it out: argtypes and restype to be set, then calls."""

    def __init__(self, calls: list[tuple[Any, ...]], name: str, result: Callable[..., Any]) -> None:
        self.argtypes: list[Any] | None = None
        self.restype: Any = "unset"
        self._calls, self._name, self._result = calls, name, result

    def __call__(self, *args: Any) -> Any:
        assert self.argtypes is not None and self.restype != "unset", f"{self._name} called without its prototype"
        assert len(args) == len(self.argtypes), f"{self._name} takes {len(self.argtypes)} arguments"
        self._calls.append((self._name, threading.get_ident(), *args))
        return self._result(*args)


class Kernel32:
    def __init__(self, previous_state: int = 0x80000000) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.SetThreadExecutionState = Function(self.calls, "SetThreadExecutionState", lambda state: previous_state)


def test_windows_holds_the_system_on_a_thread_of_its_own_and_clears_it_there() -> None:
    kernel32 = Kernel32()
    state = WindowsExecutionState(kernel32)
    assert kernel32.SetThreadExecutionState.argtypes == [wintypes.DWORD]
    assert kernel32.SetThreadExecutionState.restype is wintypes.DWORD
    state.acquire()
    [(_, holder, flags)] = kernel32.calls
    assert flags == 0x80000001 and holder != threading.get_ident()  # ES_CONTINUOUS | ES_SYSTEM_REQUIRED
    assert any(t.ident == holder for t in threading.enumerate())  # the hold lives as long as its thread
    state.release()
    assert kernel32.calls[1] == ("SetThreadExecutionState", holder, 0x80000000)  # cleared by the same thread
    assert not any(t.ident == holder for t in threading.enumerate())


def test_windows_refusing_is_logged_once_and_serving_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    awake = KeepAwake(WindowsExecutionState(Kernel32(previous_state=0)))  # 0: the call failed
    with caplog.at_level(logging.WARNING, logger="worker.system.keepawake"):
        awake.want(True)
        awake.want(False)
        awake.want(True)
    assert not awake.held
    assert [r.getMessage() for r in caplog.records] == [
        "could not start keeping this computer awake: Windows refused SetThreadExecutionState"]


class MacLibraries:
    """IOKit and CoreFoundation as far as the assertion uses them."""

    ASSERTION_ID = 4242

    def __init__(self, created: int = 0) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.strings: dict[int, bytes] = {}
        self.CFStringCreateWithCString = Function(self.calls, "CFStringCreateWithCString", self._string)
        self.CFRelease = Function(self.calls, "CFRelease", lambda ref: None)
        self.IOPMAssertionCreateWithName = Function(self.calls, "IOPMAssertionCreateWithName",
                                                    lambda kind, level, name, out: self._create(out, created))
        self.IOPMAssertionRelease = Function(self.calls, "IOPMAssertionRelease", lambda assertion: 0)

    def _string(self, allocator: Any, text: bytes, encoding: int) -> int:
        assert allocator is None and encoding == 0x08000100
        ref = 0x1000 + len(self.strings)
        self.strings[ref] = text
        return ref

    def _create(self, out: Any, code: int) -> int:
        out._obj.value = self.ASSERTION_ID  # what IOKit writes through the IOPMAssertionID pointer
        return code


def test_macos_takes_a_named_idle_sleep_assertion_and_releases_it() -> None:
    libraries = MacLibraries()
    mac = MacSleepAssertion(libraries, libraries)
    assert libraries.IOPMAssertionCreateWithName.argtypes == [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
    assert libraries.IOPMAssertionCreateWithName.restype is ctypes.c_int32
    assert libraries.IOPMAssertionRelease.argtypes == [ctypes.c_uint32]
    assert libraries.CFStringCreateWithCString.restype is ctypes.c_void_p
    assert libraries.CFRelease.argtypes == [ctypes.c_void_p] and libraries.CFRelease.restype is None
    mac.acquire()
    [create] = [c for c in libraries.calls if c[0] == "IOPMAssertionCreateWithName"]
    kind, level, name = create[2:5]
    assert libraries.strings[kind] == b"PreventUserIdleSystemSleep" and level == 255
    assert b"GPU Provider" in libraries.strings[name]
    released = sorted(c[2] for c in libraries.calls if c[0] == "CFRelease")
    assert released == sorted(libraries.strings)  # no CFString leaks
    mac.release()
    mac.release()  # once only
    assert [c[2] for c in libraries.calls if c[0] == "IOPMAssertionRelease"] == [MacLibraries.ASSERTION_ID]


def test_macos_refusing_is_an_error_and_nothing_is_released_later() -> None:
    libraries = MacLibraries(created=-536870212)  # kIOReturnError
    mac = MacSleepAssertion(libraries, libraries)
    with pytest.raises(OSError, match="0xe00002bc"):
        mac.acquire()
    mac.release()
    assert not [c for c in libraries.calls if c[0] == "IOPMAssertionRelease"]


def test_linux_without_a_system_bus_serves_on_and_says_so_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")
    awake = KeepAwake(LogindInhibitor())
    with caplog.at_level(logging.WARNING, logger="worker.system.keepawake"):
        awake.want(True)
        awake.want(True)
    assert not awake.held and len(caplog.records) == 1
    assert "could not start keeping this computer awake" in caplog.records[0].getMessage()


class Recorded:
    def __init__(self) -> None:
        self.events: list[str] = []

    def acquire(self) -> None:
        self.events.append("acquire")

    def release(self) -> None:
        self.events.append("release")


def test_keep_awake_takes_and_gives_back_only_on_a_change() -> None:
    power = Recorded()
    awake = KeepAwake(power)
    for wanted in (False, True, True, False, False, True):
        awake.want(wanted)
    assert power.events == ["acquire", "release", "acquire"] and awake.held
    KeepAwake(None).want(True)  # a platform without one: nothing to do


def test_each_platform_gets_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bus = tmp_path / "system_bus_socket"
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={bus}")
    assert keepawake.platform_assertion() is None  # a container or server: no system bus, nothing to warn about
    bus.touch()
    assert isinstance(keepawake.platform_assertion(), LogindInhibitor)
    opened: list[str] = []
    monkeypatch.setattr(keepawake.sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", lambda path: opened.append(path) or MacLibraries())
    assert isinstance(keepawake.platform_assertion(), MacSleepAssertion)
    assert opened == ["/System/Library/Frameworks/IOKit.framework/IOKit",
                      "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"]


class SystemBus:
    """A system D-Bus with logind on it, at the socket: the SASL conversation (EXTERNAL, file
    descriptors agreed), `Hello`, then `Inhibit` answered with the write end of a pipe, as logind
    does; the test keeps the read end and sees the inhibitor end when it reads EOF."""

    def __init__(self, path: Path, refuse: str | None = None) -> None:
        self.path, self._refuse = path, refuse
        self.calls: list[tuple[str, Any]] = []
        self.inhibitor_read_end: int | None = None
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen()
        self._thread = threading.Thread(target=self._serve_one, daemon=True)
        self._thread.start()

    def _serve_one(self) -> None:
        connection, _ = self._server.accept()
        with connection:
            lines = connection.makefile("rb")
            assert lines.readline().startswith(b"\0AUTH EXTERNAL ")
            connection.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
            assert lines.readline() == b"NEGOTIATE_UNIX_FD\r\n"
            connection.sendall(b"AGREE_UNIX_FD\r\n")
            assert lines.readline() == b"BEGIN\r\n"
            parser = Parser()
            while (message := self._next(parser, lines)) is not None:
                member = message.header.fields[HeaderFields.member]
                self.calls.append((member, message.body))
                if member == "Hello":
                    self._send(connection, new_method_return(message, "s", (":1.42",)))
                elif self._refuse is not None:
                    self._send(connection, new_error(message, self._refuse, "s", ("Permission denied",)))
                else:
                    self.inhibitor_read_end, write_end = os.pipe()
                    self._send(connection, new_method_return(message, "h", (write_end,)), write_end)
                    os.close(write_end)

    @staticmethod
    def _next(parser: Parser, lines: Any) -> Any:
        while (message := parser.get_next_message()) is None:
            data = lines.read1(4096)
            if not data:
                return None
            parser.add_data(data)
        return message

    @staticmethod
    def _send(connection: socket.socket, message: Any, *fds: int) -> None:
        sent: list[int] = []
        data = message.serialise(serial=7, fds=sent)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", sent))] if sent else []
        connection.sendmsg([data], ancillary)

    def close(self) -> None:
        self._server.close()
        self._thread.join(5)
        if self.inhibitor_read_end is not None:
            os.close(self.inhibitor_read_end)


def inhibitor_ended(read_end: int) -> bool:
    ready, _, _ = select.select([read_end], [], [], 5)
    return bool(ready) and os.read(read_end, 1) == b""


def test_linux_holds_loginds_sleep_and_idle_inhibitor_until_released(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bus = SystemBus(tmp_path / "system_bus_socket")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={bus.path}")
    try:
        awake = KeepAwake(LogindInhibitor())
        awake.want(True)
        assert awake.held
        [_, (member, body)] = bus.calls
        assert member == "Inhibit" and body[0] == "sleep:idle" and body[1] == "GPU Provider" and body[3] == "block"
        assert bus.inhibitor_read_end is not None
        assert not select.select([bus.inhibitor_read_end], [], [], 0.2)[0]  # held: the write end is open here
        awake.want(False)
        assert inhibitor_ended(bus.inhibitor_read_end)
    finally:
        bus.close()


def test_linux_logind_refusing_is_logged_and_nothing_is_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    bus = SystemBus(tmp_path / "system_bus_socket", refuse="org.freedesktop.DBus.Error.AccessDenied")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={bus.path}")
    try:
        awake = KeepAwake(LogindInhibitor())
        with caplog.at_level(logging.WARNING, logger="worker.system.keepawake"):
            awake.want(True)
        assert not awake.held and "Permission denied" in caplog.records[0].getMessage()
    finally:
        bus.close()
