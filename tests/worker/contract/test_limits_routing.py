"""The contract's `limits`, `status.download` and `routing` notice: read within their bounds, and
anything else refused as a bad message, never shown to a person."""

from __future__ import annotations

import json

import pytest

from worker.contract import protocol

ENGINES = ("vllm",)


def routing(**fields: object) -> str:
    return json.dumps({"type": "routing", **fields})


def test_a_routing_notice_is_read() -> None:
    notice = protocol.parse_from_coordinator(
        routing(share=0.0, reason="low_demand", message="No demand for this model right now"), engine_names=ENGINES)
    assert notice == protocol.Routing(share=0.0, reason="low_demand", message="No demand for this model right now")


@pytest.mark.parametrize("fields", [
    {"share": 1.5}, {"share": -0.1}, {"share": 0.5, "reason": "we_dislike_you"},
    {"share": 0.5, "message": "two\nlines"}, {"share": 0.5, "message": "x" * (protocol.MAX_ROUTING_MESSAGE + 1)},
    {"reason": "low_demand"},
])
def test_a_routing_notice_out_of_bounds_is_a_bad_message(fields: dict[str, object]) -> None:
    with pytest.raises(protocol.BadMessage):
        protocol.parse_from_coordinator(routing(**fields), engine_names=ENGINES)


def test_limits_and_download_ride_in_status_as_the_contract_spells_them() -> None:
    status = protocol.Status(state="configured",
                             limits=protocol.Limits(max_requests=4, memory_share_pct={"0": 80}, reason="too_hot"),
                             download=protocol.DownloadStatus(what="model", done_mib=1200, total_mib=4300,
                                                              mib_per_s=8.1))
    data = json.loads(protocol.encode(status))
    assert data["limits"] == {"max_requests": 4, "memory_share_pct": {"0": 80}, "reason": "too_hot"}
    assert data["download"] == {"what": "model", "done_mib": 1200, "total_mib": 4300, "mib_per_s": 8.1,
                                "paused": False}


@pytest.mark.parametrize("limits", [{"max_requests": 0}, {"memory_share_pct": {"0": 5}},
                                    {"memory_share_pct": {"x": 50}}, {"reason": "bored"}])
def test_limits_are_held_to_their_bounds(limits: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        protocol.Limits.model_validate(limits)
