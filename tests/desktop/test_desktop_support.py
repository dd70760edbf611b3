"""The real-desktop helpers' own logic: reading xwininfo's tree and naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import desktop
from tests.support.desktop import DesktopMissing, Window, parse_tree, real_desktop

TREE = """
xwininfo: Window id: 0x50d (the root window) (has no name)

  Root window id: 0x50d (the root window) (has no name)
  Parent window id: 0x0 (none)
     3 children:
     0x60001b "GPU Provider": ("gpu-provider" "GPU Provider")  167x72+1110+11  +1110+11
     0x400261 (has no name): ()  24x24+1256+0  +1256+0
        1 child:
        0x200003 "panel": ("panel" "trayer")  24x24+0+0  +1256+0
           1 child:
           0x600007 "GPU Provider": ("gpu-provider" "GPU Provider")  22x22+0+0  +1257+1
"""


def test_the_tree_gives_each_window_its_name_size_and_depth():
    assert parse_tree(TREE) == [
        Window("0x60001b", "GPU Provider", 167, 72, 0),
        Window("0x400261", "", 24, 24, 0),
        Window("0x200003", "panel", 24, 24, 1),
        Window("0x600007", "GPU Provider", 22, 22, 2),
    ]


def test_missing_tools_fail_with_the_packages_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(desktop.shutil, "which", lambda tool: None if tool in ("trayer", "xprop") else "/bin/x")
    with pytest.raises(DesktopMissing, match=r"packages: trayer x11-utils \(apt-get install trayer x11-utils"):
        with real_desktop(tmp_path):
            pass
