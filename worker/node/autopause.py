"""Pause for games and outside serve hours; resume only what was paused here.

The policy is pure: `find_game` says which process (if any) is a game from what this tick saw,
and `decide` turns that, the settings and what the previous tick remembered into a command, so
every rule is tested without a GPU or a clock. `AutoPauser` is the thin poller the node runs on
its loop: it reads the GPU process list in a thread (NVML blocks), names the processes (psutil),
asks the policy, and calls `pause` / `resume` on the node.

Rules a person can rely on:
- a game is a process on a lent GPU that is not one of our engines, whose name is neither on
  the desktop list (`DESKTOP_PROCESSES`: compositors, shells, browsers, launchers) nor on the
  user's `autopause_ignored` list, and which does real GPU work: at least `GAME_MIN_MIB` of GPU
  memory or `GAME_MIN_SM_PCT` % SM utilisation. A full-screen app (where the platform says so)
  is one too. It pauses with reason ``game``, naming the process; serving resumes once it has
  been gone for ``auto_resume_after_s``;
- outside ``serve_hours`` the node pauses with reason ``schedule``;
- a pause the user (or the coordinator) made is never lifted here, and when the user resumes
  during an automatic pause, that episode is left alone until its cause goes away.

Windows (WDDM) gives NVML no per-process memory (`used_mib` is None for every process) and lists
every process with a Direct3D device, Explorer, chat apps and all, so being listed says nothing.
There a process counts by its sampled SM utilisation (NVML's per-process sampling), and where
the driver cannot sample either (`sm_pct` None) it never counts by the list alone: the
full-screen probe is then what sees a game.

macOS has no NVML: there a game is what fills a display, read from the window list
(`worker.node.macwindows`): a normal-level window (layer 0) of another app whose bounds cover a
whole display, which a native full-screen app and a borderless full-screen game both are and a
zoomed window (under the menu bar, beside the Dock) is not. Where neither the process list nor a
full-screen signal exists, `detection_limit` says so in words for the settings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Literal, Protocol

import psutil

from worker.contract.events import NodeSnapshot
from worker.node import macwindows
from worker.node.macwindows import Rect
from worker.system.config import Settings

log = logging.getLogger(__name__)

AutoReason = Literal["game", "schedule"]
AUTO_REASONS: frozenset[str] = frozenset(("game", "schedule"))

GAME_MIN_MIB = 1024  # a desktop app rarely holds a GiB; a game, even a small one, does
GAME_MIN_SM_PCT = 25  # sustained SM use a video call or a scrolling page stays under
FULLSCREEN_APP = "a full-screen app"
LINUX_NAME_LIMIT = 15  # characters of a process name the Linux kernel keeps

# Never a game by name, whatever they do: they draw the desktop, a browser or a launcher.
DESKTOP_PROCESSES: frozenset[str] = frozenset(
    name.casefold()
    for name in (
        # Linux display servers, compositors and shells
        "Xorg", "X", "Xwayland", "gnome-shell", "mutter", "kwin_wayland", "kwin_x11", "plasmashell",
        "cinnamon", "muffin", "xfwm4", "marco", "budgie-wm", "gala", "compiz", "picom", "sway",
        "Hyprland", "weston", "wayfire", "labwc",
        # Windows desktop
        "dwm.exe", "explorer.exe", "csrss.exe", "ShellExperienceHost.exe", "StartMenuExperienceHost.exe",
        "SearchHost.exe", "SearchApp.exe", "TextInputHost.exe", "LockApp.exe", "ApplicationFrameHost.exe",
        "Widgets.exe", "SystemSettings.exe", "msedgewebview2.exe", "NVIDIA Overlay.exe", "NVIDIA Share.exe",
        # browsers (their GPU process carries the browser's name)
        "chrome", "chrome.exe", "chromium", "chromium-browser", "msedge", "msedge.exe", "firefox",
        "firefox.exe", "firefox-bin", "firefox-esr", "brave", "brave.exe", "opera", "opera.exe",
        "vivaldi-bin", "vivaldi.exe",
        # macOS desktop and browsers (window owners)
        "Window Server", "Dock", "WindowManager", "Finder", "loginwindow", "Control Center",
        "Notification Center", "Safari", "Google Chrome", "Microsoft Edge", "Brave Browser", "Arc",
        # game launchers and stores, idle in the background
        "steam", "steam.exe", "steamwebhelper", "steamwebhelper.exe", "EpicGamesLauncher.exe",
        "EpicWebHelper.exe", "Battle.net.exe", "EADesktop.exe", "GalaxyClient.exe", "upc.exe",
        "Battle.net", "Epic Games Launcher",
    )
)
NORMAL_WINDOW_LAYER = 0  # kCGNormalWindowLevel: apps and games; menus, the Dock and overlays sit higher

# What the settings say next to "Pause for games" where not every game can be seen.
FULLSCREEN_ONLY_MAC = (
    "On a Mac, GPU Provider notices a game only when it fills the screen. "
    "Before you play a game in a window, pause serving from the menu bar."
)
FULLSCREEN_ONLY_WINDOWS = (
    "GPU Provider cannot read the NVIDIA driver's list of programs here, so it notices a game only "
    "when it runs full screen. Before you play a game in a window, pause serving from the tray."
)
GAMES_NOT_SEEN = (
    "GPU Provider cannot see games on this computer. Pause serving from the tray before you play."
)


class GpuProcessLike(Protocol):
    """What `worker.hardware.gpu_processes` returns per process (only these fields are read)."""

    @property
    def pid(self) -> int: ...

    @property
    def gpu_index(self) -> int: ...

    @property
    def used_mib(self) -> int | None: ...

    @property
    def sm_pct(self) -> int | None: ...


@dataclass(frozen=True)
class SeenProcess:
    """A foreign GPU process with its name; None where NVML or the OS cannot tell."""

    pid: int
    gpu_index: int
    name: str | None
    used_mib: int | None
    sm_pct: int | None

    @property
    def label(self) -> str:
        return self.name or f"process {self.pid}"

    def describe(self) -> str:
        memory = "memory unknown" if self.used_mib is None else f"{self.used_mib} MiB"
        sm = "SM unknown" if self.sm_pct is None else f"{self.sm_pct} % SM"
        return f"{self.label} (pid {self.pid} on GPU {self.gpu_index}: {memory}, {sm})"


@dataclass(frozen=True)
class Observation:
    """One tick's facts: time, the game seen now (by name), and the node's pause as it stands."""

    now: float
    local_hour: float  # 0 <= h < 24, local time, minutes as a fraction
    game: str | None  # "Cyberpunk2077.exe", FULLSCREEN_APP, or None
    paused: bool
    pause_reason: str | None


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks."""

    last_game_at: float | None = None  # last tick a game was seen
    holding: AutoReason | None = None  # the pause this policy asked for, if any
    game_overridden: bool = False  # the user resumed during a game pause: wait for the game to end
    schedule_overridden: bool = False  # the user resumed outside serve hours: wait for the window


@dataclass(frozen=True)
class Action:
    kind: Literal["pause", "resume"]
    reason: AutoReason | None = None
    detail: str | None = None  # what the pause is for, as the user should read it: the game's name


def in_serve_hours(serve_hours: tuple[int, int] | None, local_hour: float) -> bool:
    """True inside the window; a window such as (22, 6) wraps past midnight; None = always."""
    if serve_hours is None:
        return True
    start, end = serve_hours
    if start == end:
        return True
    if start < end:
        return start <= local_hour < end
    return local_hour >= start or local_hour < end


def foreign_processes(
    processes: Iterable[GpuProcessLike], *, lent_gpus: Iterable[int] | None, own_pids: Iterable[int]
) -> list[GpuProcessLike]:
    """Processes on a lent GPU that are not our engines (None = every GPU is lent)."""
    lent = None if lent_gpus is None else set(lent_gpus)
    ours = set(own_pids)
    return [p for p in processes if p.pid not in ours and (lent is None or p.gpu_index in lent)]


def does_gpu_work(process: GpuProcessLike) -> bool:
    """Real GPU work by the numbers; an unknown figure (None) is no evidence either way."""
    return (process.used_mib or 0) >= GAME_MIN_MIB or (process.sm_pct or 0) >= GAME_MIN_SM_PCT


def find_game(settings: Settings, processes: Iterable[SeenProcess]) -> SeenProcess | None:
    """The busiest process that counts as a game, or None: desktop and ignored names never do."""
    games = [p for p in processes if does_gpu_work(p) and counts_as_game(settings, p.name or "")]
    return max(games, key=lambda p: (p.sm_pct or 0, p.used_mib or 0), default=None)


def decide(settings: Settings, state: PolicyState, obs: Observation) -> tuple[PolicyState, Action | None]:
    """The next policy state and the command to send, if any."""
    game_now = settings.auto_pause_for_games and obs.game is not None
    last_game_at = obs.now if game_now else state.last_game_at
    game_lingers = last_game_at is not None and obs.now - last_game_at < settings.auto_resume_after_s
    out_of_hours = not in_serve_hours(settings.serve_hours, obs.local_hour)
    state = replace(state, last_game_at=last_game_at if (game_now or game_lingers) else None)

    if obs.paused and obs.pause_reason not in AUTO_REASONS:
        return replace(state, holding=None), None
    if state.holding is not None and not obs.paused:
        state = replace(
            state,
            holding=None,
            game_overridden=state.game_overridden or state.holding == "game",
            schedule_overridden=state.schedule_overridden or state.holding == "schedule",
        )
    state = replace(
        state,
        game_overridden=state.game_overridden and game_now,
        schedule_overridden=state.schedule_overridden and out_of_hours,
    )

    holding_for_game = obs.paused and obs.pause_reason == "game"
    wanted: AutoReason | None = None
    if (game_now or (game_lingers and holding_for_game)) and not state.game_overridden:
        wanted = "game"
    elif out_of_hours and not state.schedule_overridden:
        wanted = "schedule"

    if wanted is None:
        if obs.paused:
            return replace(state, holding=None), Action("resume")
        return state, None
    if obs.paused and obs.pause_reason == wanted:
        return replace(state, holding=wanted), None
    return replace(state, holding=wanted), Action("pause", wanted, obs.game if wanted == "game" else None)


def counts_as_game(settings: Settings, name: str) -> bool:
    """A name on the desktop list or the user's ignored list is never a game."""
    ignored = DESKTOP_PROCESSES | {n.casefold() for n in settings.autopause_ignored}
    return name.casefold() not in ignored


@dataclass(frozen=True)
class ScreenWindow:
    """One on-screen window as the macOS window list describes it."""

    owner_pid: int
    owner_name: str | None
    layer: int
    bounds: Rect
    alpha: float = 1.0

    @classmethod
    def from_info(cls, info: Mapping[str, object]) -> ScreenWindow | None:
        """From `CGWindowListCopyWindowInfo`'s keys; None for a window missing one it needs."""
        layer, pid, box = info.get(macwindows.LAYER), info.get(macwindows.OWNER_PID), info.get(macwindows.BOUNDS)
        if not isinstance(layer, int) or not isinstance(pid, int) or not isinstance(box, Mapping):
            return None
        edges = [box.get(edge) for edge in ("X", "Y", "Width", "Height")]
        numbers = [float(v) for v in edges if isinstance(v, int | float)]
        if len(numbers) != len(edges):
            return None
        name, alpha = info.get(macwindows.OWNER_NAME), info.get(macwindows.ALPHA, 1.0)
        return cls(pid, name if isinstance(name, str) else None, layer, Rect(*numbers),
                   float(alpha) if isinstance(alpha, int | float) else 1.0)


def covers(window: Rect, display: Rect) -> bool:
    """The window spans the whole display (a full-screen app's window is exactly its bounds)."""
    return (window.x <= display.x and window.y <= display.y
            and window.x + window.width >= display.x + display.width
            and window.y + window.height >= display.y + display.height)


def full_screen_apps(windows: Iterable[ScreenWindow], displays: Sequence[Rect], *, own_pid: int) -> list[str]:
    """The apps (by name) with a visible normal-level window covering a display, other than ours."""
    names = [
        w.owner_name or FULLSCREEN_APP
        for w in windows
        if w.layer == NORMAL_WINDOW_LAYER and w.alpha > 0 and w.owner_pid != own_pid
        and any(covers(w.bounds, d) for d in displays)
    ]
    return list(dict.fromkeys(names))


def windows_fullscreen() -> list[str]:
    """`[FULLSCREEN_APP]` when Windows reports a full-screen D3D app, presentation mode or a busy
    full screen (it does not say which app); on Linux it depends on the window manager (and is
    meaningless on a headless box), so there the GPU process list is the only signal."""
    import ctypes

    state = ctypes.c_int(0)
    shell32 = ctypes.windll.shell32  # type: ignore[attr-defined]
    if shell32.SHQueryUserNotificationState(ctypes.byref(state)) != 0:
        return []
    busy, d3d_full_screen, presentation = 2, 3, 4
    return [FULLSCREEN_APP] if state.value in (busy, d3d_full_screen, presentation) else []


class MacFullScreen:
    """The macOS probe: full-screen apps from the window list, nothing (logged once) if unreadable."""

    def __init__(self, window_list: macwindows.WindowList, own_pid: int | None = None) -> None:
        self._window_list = window_list
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._warned = False

    def __call__(self) -> list[str]:
        try:
            infos, displays = self._window_list.windows(), self._window_list.displays()
        except OSError as exc:
            if not self._warned:
                log.warning("auto-pause cannot read the window list: %s", exc)
                self._warned = True
            return []
        windows = [w for info in infos if (w := ScreenWindow.from_info(info)) is not None]
        return full_screen_apps(windows, displays, own_pid=self._own_pid)


def mac_window_list() -> macwindows.WindowList | None:
    """CoreGraphics' window list, or None where the frameworks cannot be loaded."""
    try:
        return macwindows.WindowList()
    except (OSError, AttributeError) as exc:
        log.warning("auto-pause cannot load CoreGraphics: %s", exc)
        return None


def default_fullscreen_probe(platform: str = sys.platform) -> Callable[[], list[str]]:
    """The platform's full-screen check; one that sees nothing where the platform cannot tell us."""
    if platform == "win32":
        return windows_fullscreen
    window_list = mac_window_list() if platform == "darwin" else None
    return MacFullScreen(window_list) if window_list is not None else (lambda: [])


def detection_limit(*, nvml: bool, platform: str = sys.platform,
                    window_list: Callable[[], object | None] = mac_window_list) -> str | None:
    """What the "Pause for games" setting should say where not every game can be seen; None
    where the GPU process list sees them (NVML on Linux and Windows)."""
    if platform == "darwin":
        return FULLSCREEN_ONLY_MAC if window_list() is not None else GAMES_NOT_SEEN
    if nvml:
        return None
    return FULLSCREEN_ONLY_WINDOWS if platform == "win32" else GAMES_NOT_SEEN


def process_name(pid: int) -> str | None:
    """The executable's name as the OS shows it ("Cyberpunk2077.exe"); None once it is gone.

    Linux keeps only 15 characters; psutil restores the rest from the command line's first
    word, but not when that is a Windows path, as it is for every game under Wine or Proton.
    """
    try:
        process = psutil.Process(pid)
        name = process.name()
    except psutil.Error:
        return None
    if len(name) == LINUX_NAME_LIMIT:
        try:
            first = next(iter(process.cmdline()), "")
        except psutil.Error:
            first = ""
        full = first.replace("\\", "/").rsplit("/", 1)[-1]
        name = full if full.startswith(name) else name
    return name or None


def local_hour_now() -> float:
    now = datetime.now()
    return now.hour + now.minute / 60


class PausableNode(Protocol):
    def snapshot(self) -> NodeSnapshot: ...

    def pause(self, duration_s: float | None = None, reason: str = "user", detail: str | None = None) -> None: ...

    def resume(self) -> None: ...


class AutoPauser:
    """Polls the GPU process list (and what is full screen) and applies `decide` to the node."""

    def __init__(
        self,
        node: PausableNode,
        settings: Callable[[], Settings],
        list_processes: Callable[[], Iterable[GpuProcessLike]],
        *,
        fullscreen: Callable[[], Sequence[str]] | None = None,
        name_of: Callable[[int], str | None] = process_name,
        clock: Callable[[], float] = time.time,
        local_hour: Callable[[], float] = local_hour_now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        interval_s: float = 2.0,
    ) -> None:
        self._node = node
        self._settings = settings
        self._list_processes = list_processes
        self._fullscreen = fullscreen or default_fullscreen_probe()
        self._name_of = name_of
        self._clock = clock
        self._local_hour = local_hour
        self._sleep = sleep
        self._interval_s = interval_s
        self._evidence = ""
        self.state = PolicyState()

    async def run(self) -> None:
        """Tick until cancelled; one failed reading is logged and the next tick tries again."""
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("auto-pause could not read the GPU process list; trying again")
            await self._sleep(self._interval_s)

    async def tick(self) -> Action | None:
        settings = self._settings()
        snapshot = self._node.snapshot()
        game = await asyncio.to_thread(self._game_now, settings, snapshot) if settings.auto_pause_for_games else None
        obs = Observation(
            now=self._clock(),
            local_hour=self._local_hour(),
            game=game,
            paused=snapshot.paused,
            pause_reason=snapshot.pause_reason,
        )
        self.state, action = decide(settings, self.state, obs)
        if action is not None:
            self._apply(action)
        return action

    def _game_now(self, settings: Settings, snapshot: NodeSnapshot) -> str | None:
        """The name of what counts as a game now: the busiest foreign process, else a full-screen app."""
        own_pids = [e.pid for e in snapshot.engines if e.pid is not None]
        foreign = foreign_processes(self._list_processes(), lent_gpus=settings.gpus_to_lend, own_pids=own_pids)
        seen = [  # only working processes need a name: the rest never count, whatever they are called
            SeenProcess(p.pid, p.gpu_index, self._name_of(p.pid), p.used_mib, p.sm_pct)
            for p in foreign
            if does_gpu_work(p)
        ]
        game = find_game(settings, seen)
        if game is not None:
            self._evidence = game.describe()
            return game.label
        full_screen = next((name for name in self._fullscreen() if counts_as_game(settings, name)), None)
        if full_screen is not None:
            self._evidence = f"{full_screen} (full screen)"
        return full_screen

    def _apply(self, action: Action) -> None:
        if action.kind == "pause":
            why = self._evidence if action.reason == "game" else "outside serve hours"
            log.info("auto-pause: pausing for %s", why)
            self._node.pause(None, action.reason or "game", detail=action.detail)
        else:
            log.info("auto-pause: resuming serving")
            self._node.resume()
