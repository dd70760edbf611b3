"""The lender's reminders: once after the chosen hours online and earning nothing, once back
online after being offline; never for a pause the person chose, never again in the same episode."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pydantic import BaseModel

from worker.contract import protocol
from worker.contract.events import ConnectionSnapshot, NodeSnapshot, RoutingNotice
from worker.node.headline import headline
from worker.node.publisher import Publisher
from worker.node.reminders import Reminders
from worker.node.status import StatusFile
from worker.system.config import Paths, Settings

HOUR = 3600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snap(connection: str = "connected", **changes: object) -> NodeSnapshot:
    base = NodeSnapshot(at=1.0, state="ready", node_id="n", runtime="native", assignment_id="a", model="qwen3-8b",
                        connection=ConnectionSnapshot("wss://c", connection))  # type: ignore[arg-type]
    made = dataclasses.replace(base, **changes)  # type: ignore[arg-type]
    return dataclasses.replace(made, headline=headline(made, 1.0))


NO_DEMAND = RoutingNotice(share=0.0, reason="low_demand", message="No demand for this model right now", at=1.0)
IDLE = snap(state="idle", assignment_id=None, model=None)


def test_online_and_earning_nothing_for_the_chosen_hours_is_told_once_with_the_reason() -> None:
    clock = Clock()
    reminders = Reminders(lambda: Settings(notify_idle_hours=2.0), clock)
    assert reminders.check(snap(routing=NO_DEMAND)) == []
    clock.now += 2 * HOUR - 1
    assert reminders.check(snap(routing=NO_DEMAND)) == []
    clock.now += 1
    assert reminders.check(snap(routing=NO_DEMAND)) == [
        "Online but earning nothing for 2 hours: The network says: No demand for this model right now"]
    clock.now += 5 * HOUR
    assert reminders.check(snap(routing=NO_DEMAND)) == []  # once per episode
    assert reminders.check(snap()) == []  # earning: the episode ends
    assert reminders.check(IDLE) == []
    clock.now += 2 * HOUR
    assert reminders.check(IDLE) == ["Online but earning nothing for 2 hours: Waiting for the network to assign a model"]


def test_no_idle_reminder_for_a_pause_the_person_chose_or_when_turned_off_or_offline() -> None:
    clock = Clock()
    paused = Reminders(lambda: Settings(notify_idle_hours=1.0), clock)
    off = Reminders(lambda: Settings(notify_idle_hours=None), clock)
    away = Reminders(lambda: Settings(notify_idle_hours=1.0), clock)
    for _ in range(3):
        assert paused.check(snap(paused=True, pause_reason="game", pause_detail="Cyberpunk2077.exe")) == []
        assert off.check(IDLE) == []
        assert away.check(snap("offline")) == []
        clock.now += HOUR
    too_hot = snap(paused=True, pause_reason="too_hot", pause_detail="GPU 0 at 86 °C")
    assert paused.check(too_hot) == []
    clock.now += HOUR
    assert paused.check(too_hot) == ["Online but earning nothing for 1 hour: Paused: GPU 0 at 86 °C"]


def test_back_online_after_a_real_outage_once_not_after_a_blip() -> None:
    clock = Clock()
    reminders = Reminders(lambda: Settings(), clock)
    assert reminders.check(snap()) == []
    assert reminders.check(snap("offline")) == []
    clock.now += 10
    assert reminders.check(snap("connecting")) == []
    assert reminders.check(snap()) == []  # a 10 s blip
    assert reminders.check(snap("offline")) == []
    clock.now += 300
    assert reminders.check(snap("connecting")) == []
    assert reminders.check(snap("offline")) == []  # the first try failed: still the same outage
    clock.now += 3600
    assert reminders.check(snap()) == ["Back online after 1 h 5 min offline"]
    assert reminders.check(snap()) == []
    quiet = Reminders(lambda: Settings(notify_back_online=False), clock)
    quiet.check(snap("offline"))
    clock.now += 600
    assert quiet.check(snap()) == []


async def test_the_publisher_hands_a_due_reminder_to_the_app_with_the_snapshot(tmp_path: Path) -> None:
    clock = Clock()
    current = [snap("offline")]

    async def send(message: BaseModel) -> bool:
        return True

    publisher = Publisher(lambda: dataclasses.replace(current[0], notices=tuple(publisher.notices)),
                          lambda: protocol.Status(state="ready"), send,
                          StatusFile(Paths.under(tmp_path).ensure(), lambda: True),
                          reminders=Reminders(lambda: Settings(), clock))
    seen: list[NodeSnapshot] = []
    publisher.subscribe(seen.append)
    publisher.publish()
    clock.now += 120
    current[0] = snap()
    publisher.publish()
    assert seen[-1].notices == ("Back online after 2 min offline",)  # in the very snapshot that shows it online
    publisher.publish()
    assert seen[-1].notices == ("Back online after 2 min offline",) and len(publisher.notices) == 1
