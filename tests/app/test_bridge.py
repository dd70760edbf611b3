"""The bridge: snapshots from the core's thread to the GUI's, commands the other way."""

from __future__ import annotations

import threading
from dataclasses import replace

from app.bridge import Bridge
from tests.app import snapshots
from tests.app.scripted_node import ScriptedNode, headed


def test_a_snapshot_that_only_moves_the_clock_does_not_cross_to_the_gui(qtbot) -> None:
    """An idle node publishes every second; only what changes the picture wakes the GUI thread."""
    first = snapshots.serving()
    node = ScriptedNode(snapshots.idle())
    bridge = Bridge(node)
    crossed: list[float] = []
    bridge.snapshot_changed.connect(lambda snap: crossed.append(snap.at))

    def publish(snapshot) -> None:  # from another thread, as the core does
        thread = threading.Thread(target=node.emit, args=(snapshot,))
        thread.start()
        thread.join()
        qtbot.wait(20)

    publish(first)
    later = replace(first, at=first.at + 1,
                    throughput=replace(first.throughput, run_seconds=first.throughput.run_seconds + 1))
    publish(later)
    assert crossed == [first.at]
    changed = replace(later, at=later.at + 1, in_flight=later.in_flight + 1)
    publish(changed)
    assert crossed == [first.at, changed.at] and bridge.latest == headed(changed)
