from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.contract import protocol

ENGINES = ("vllm", "llamacpp")  # the engines the node hands in; the contract itself knows none


def from_coordinator(frame: str | bytes) -> protocol.CoordinatorMessage | protocol.Unknown:
    return protocol.parse_from_coordinator(frame, engine_names=ENGINES)

HARDWARE = {
    "gpus": [{"index": 0, "uuid": "GPU-1", "name": "NVIDIA GeForce RTX 4090", "vendor": "nvidia",
              "memory_total_mib": 24564, "memory_free_mib": 23980, "compute_capability": "8.9",
              "pcie": {"gen": 4, "width": 16}, "peer_to_peer": False, "power_limit_w": 450,
              "memory_bandwidth_gbps": 1008}],
    "groups": [{"gpu_indices": [0], "name": "NVIDIA GeForce RTX 4090", "usable_mib_per_gpu": 20600,
                "peer_to_peer": False}],
    "effective_vram_mib": 20600, "unified_memory": False, "ram_mib": 64000,
    "cpu": {"model": "AMD Ryzen 9 7950X", "cores": 16},
}
ENGINE_MODEL = {"source": "org/Model-W4A16", "revision": "main", "engine_version": "0.33.0", "weights_mib": 17800,
                "base_args": ["--max-model-len", "32768"], "tiers": {"24000": ["--max-num-seqs", "128"]}}

FROM_COORDINATOR = [
    {"type": "welcome", "node_id": "n1", "heartbeat_s": 10,
     "price": {"currency": "USD", "per_million_output_tokens": 0.4, "per_million_input_tokens": 0.05}},
    {"type": "assign", "assignment_id": "a-17", "model": {"name": "m", "vllm": ENGINE_MODEL,
     "llamacpp": {"source": "https://example.org/m.gguf", "sha256": "a" * 64, "weights_mib": 16500}}},
    {"type": "unassign", "assignment_id": "a-17"},
    {"type": "pause"},
    {"type": "resume"},
    {"type": "request", "id": "r-91", "method": "POST", "path": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, "deadline_s": 300},
    {"type": "cancel", "id": "r-91"},
    {"type": "update", "version": "0.5.0", "url": "https://example.org/p.tar.gz", "sha256": "b" * 64,
     "signature": "c2ln"},
    {"type": "error", "code": "bad_message", "message": "nope", "ref": "r-1"},
]
FROM_NODE = [
    {"type": "hello", "protocol": 1, "node_id": "n1", "app_version": "0.1.0",
     "platform": {"os": "linux", "runtime": "native", "arch": "x86_64"}, "hardware": HARDWARE,
     "engines": {"vllm": "0.33.0", "llamacpp": None}, "paused": False},
    {"type": "status", "state": "ready", "assignment_id": "a-17", "model": "m", "last_error": None,
     "engines": [{"engine_id": "e0", "gpu_indices": [0, 1], "layout": "tensor", "argv": ["vllm", "serve"],
                  "state": "ready", "kv_cache_tokens": 350518, "kv_cache_gib": 10.5, "max_model_len": 131072,
                  "max_concurrency": 2.67, "restarts": 0, "last_error": None}],
     "throughput": {"tokens_per_s": 654.0, "per_request_tokens_per_s": 25.1, "run_tokens": 120331,
                    "run_seconds": 184.0, "requests": 212},
     "gpus": [{"index": 0, "util_pct": 97, "memory_used_mib": 23100, "power_w": 402, "temperature_c": 71}],
     "in_flight": 12},
    {"type": "response.head", "id": "r-91", "status": 200, "content_type": "text/event-stream"},
    {"type": "response.chunk", "id": "r-91", "data": "data: {\"x\": \"é😀\"}\n\n"},
    {"type": "response.end", "id": "r-91", "usage": {"prompt_tokens": 9, "completion_tokens": 256}},
    {"type": "response.error", "id": "r-91", "status": 503, "code": "paused", "message": "paused"},
    {"type": "error", "code": "bad_message", "message": "nope", "ref": None},
]


@pytest.mark.parametrize("document", FROM_COORDINATOR, ids=lambda d: d["type"])
def test_every_coordinator_message_round_trips(document: dict) -> None:
    message = from_coordinator(json.dumps(document))
    assert message.type == document["type"]
    assert from_coordinator(protocol.encode(message)) == message


@pytest.mark.parametrize("document", FROM_NODE, ids=lambda d: d["type"])
def test_every_node_message_round_trips(document: dict) -> None:
    message = protocol.parse_from_node(json.dumps(document))
    assert message.type == document["type"]
    assert protocol.parse_from_node(protocol.encode(message)) == message


def test_encoded_chunk_keeps_multibyte_text() -> None:
    chunk = protocol.ResponseChunk(id="r", data="é€😀")
    assert json.loads(protocol.encode(chunk))["data"] == "é€😀"


def test_unknown_type_is_unknown_not_an_error() -> None:
    assert from_coordinator('{"type": "telemetry.v2", "x": 1}') == protocol.Unknown(type="telemetry.v2")
    # a node-only type coming from the coordinator is unknown to the node, too
    assert isinstance(from_coordinator('{"type": "hello"}'), protocol.Unknown)


def test_extra_fields_are_ignored_so_the_coordinator_can_add_some() -> None:
    message = from_coordinator('{"type": "cancel", "id": "r-1", "reason": "later"}')
    assert message == protocol.Cancel(id="r-1")


def test_an_engine_block_this_app_does_not_run_is_ignored_as_an_unknown_type_is() -> None:
    """The coordinator may offer engines a newer node runs; their blocks, whatever their shape,
    neither refuse the assignment nor reach a plan."""
    model = {"name": "m", "vllm": ENGINE_MODEL, "sglang": {"source": 7, "tiers": "no"}, "llamacpp": None}
    message = from_coordinator(json.dumps({"type": "assign", "assignment_id": "a", "model": model}))
    assert isinstance(message, protocol.Assign)
    assert message.model == protocol.ModelSpec(name="m", vllm=protocol.EngineModel.model_validate(ENGINE_MODEL))
    assert message.model.for_engine("sglang") is None and message.model.for_engine("llamacpp") is None
    assert set(json.loads(protocol.encode(message))["model"]) == {"name", "prefer", "vllm"}  # prefer: model's own


def test_the_engines_read_are_the_names_handed_in_with_the_frame() -> None:
    """The contract reads no registry: the same block is read or dropped by the names the caller
    hands in; a model built in code keeps the blocks it names."""
    frame = json.dumps({"type": "assign", "assignment_id": "a", "model": {"name": "m", "toy": ENGINE_MODEL}})
    without = protocol.parse_from_coordinator(frame, engine_names=ENGINES)
    with_toy = protocol.parse_from_coordinator(frame, engine_names=(*ENGINES, "toy"))
    assert isinstance(without, protocol.Assign) and without.model.engines == {}
    assert isinstance(with_toy, protocol.Assign) and with_toy.model.for_engine("toy") is not None
    built = protocol.ModelSpec(name="m", toy=protocol.EngineModel.model_validate(ENGINE_MODEL), vllm=None)
    assert set(built.engines) == {"toy"}
    assert protocol.Assign.model_validate(json.loads(frame), context={protocol.ENGINE_NAMES: ()}).model.engines == {}


def test_many_unknown_engine_blocks_are_dropped_in_one_pass_and_named_in_the_frames_order(caplog) -> None:
    blocks = {f"engine-{i}": {"source": "x"} for i in range(200_000, 0, -1)}  # sorting would put engine-1 first
    frame = json.dumps({"type": "assign", "assignment_id": "a", "model": {"name": "m", **blocks, "vllm": ENGINE_MODEL}})
    with caplog.at_level("INFO", logger="worker.contract.protocol"):
        message = from_coordinator(frame)
    assert isinstance(message, protocol.Assign) and set(message.model.engines) == {"vllm"}
    assert ("ignoring 200000 block(s) for engines this app does not run: 'engine-200000', 'engine-199999', "
            "'engine-199998', 'engine-199997', 'engine-199996'") in caplog.text


@pytest.mark.parametrize("depth", [900, 5_000, 100_000])
def test_a_deeply_nested_assign_frame_is_a_bad_message_never_a_crash(depth: int) -> None:
    """Under the JSON parser's recursion limit the schema refuses it, naming the assignment (the
    node then refuses that assignment); over it, the frame is not JSON at all."""
    deep = "[" * depth + "]" * depth
    frame = json.dumps({"type": "assign", "assignment_id": "a-9", "model": {"name": "m", "vllm": {
        **ENGINE_MODEL, "base_args": "BASE"}}}).replace('"BASE"', deep)
    with pytest.raises(protocol.BadMessage) as raised:
        from_coordinator(frame)
    if depth < 1000:
        assert (raised.value.message_type, raised.value.ref) == ("assign", "a-9")
    else:
        assert "not valid JSON" in str(raised.value)


@pytest.mark.parametrize("tiers", [{"x" * 1_000_000: []}, {"y" * 1_000_000: [5]}])
def test_a_bad_messages_reason_quotes_a_huge_key_short(tiers: dict[str, list[object]]) -> None:
    """The reason is logged and, for an `assign`, repeated in every `status` as the refusal."""
    frame = json.dumps({"type": "assign", "assignment_id": "a-9", "model": {"name": "m", "vllm": {
        **ENGINE_MODEL, "tiers": tiers}}})
    with pytest.raises(protocol.BadMessage) as raised:
        from_coordinator(frame)
    assert str(raised.value).startswith("invalid 'assign' message: model.vllm.tiers")
    assert "…" in str(raised.value) and len(str(raised.value)) < 300


@pytest.mark.parametrize("frame, fragment", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "one JSON object"),
    ('{"id": "r-1"}', 'no string "type"'),
    ('{"type": 7}', 'no string "type"'),
    ('{"type": "cancel"}', "id"),
    ('{"type": "request", "id": "r-1", "method": "POST", "path": "/v1/x", "deadline_s": -1}', "deadline_s"),
    ('{"type": "welcome", "node_id": 5}', "node_id"),
    (('{"type": "assign", "assignment_id": "a", "model": {"name": "m", "llamacpp": {"source": "x", '
      '"weights_mib": 1, "tiers": {"big": []}}}}'), "tier threshold"),
])
def test_malformed_messages_are_bad_with_a_reason(frame: str, fragment: str) -> None:
    with pytest.raises(protocol.BadMessage) as caught:
        from_coordinator(frame)
    assert fragment in str(caught.value)


def test_bad_message_reply_refers_to_the_request() -> None:
    with pytest.raises(protocol.BadMessage) as caught:
        from_coordinator('{"type": "request", "id": "r-7", "method": "POST"}')
    reply = caught.value.reply()
    assert (reply.type, reply.code, reply.ref) == ("error", "bad_message", "r-7")
    assert "path" in reply.message


def test_binary_frames_are_refused() -> None:
    with pytest.raises(protocol.BadMessage, match="binary"):
        from_coordinator(b'{"type": "pause"}')


def test_frames_over_16_mib_are_refused_before_parsing() -> None:
    frame = '{"type": "error", "code": "x", "message": "' + "é" * (protocol.MAX_FRAME_BYTES // 2) + '"}'
    with pytest.raises(protocol.BadMessage, match="over the"):
        from_coordinator(frame)
    with pytest.raises(protocol.BadMessage, match="over the"):
        from_coordinator(b"x" * (protocol.MAX_FRAME_BYTES + 1))


def test_a_frame_just_under_the_limit_is_accepted() -> None:
    padding = "a" * (protocol.MAX_FRAME_BYTES - 100)
    message = from_coordinator('{"type": "error", "code": "x", "message": "' + padding + '"}')
    assert len(message.message) == len(padding)


def test_deep_nesting_is_a_bad_message_not_a_crash() -> None:
    deep = '{"type": "request", "id": "r", "method": "POST", "path": "/v1/x", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(protocol.BadMessage):
        from_coordinator(deep)


def test_signed_update_payload_binds_version_and_lower_case_hash() -> None:
    assert protocol.signed_update_payload("0.5.0", "AB" * 32) == ("gpu-provider-update:0.5.0:" + "ab" * 32).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
message_types = st.sampled_from(sorted({d["type"] for d in FROM_COORDINATOR + FROM_NODE}) + ["other"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.binary()))
def test_parser_raises_only_bad_message_on_arbitrary_frames(frame: str | bytes) -> None:
    for parse in (from_coordinator, protocol.parse_from_node):
        try:
            parse(frame)
        except protocol.BadMessage:
            pass


@settings(max_examples=120, deadline=None)
@given(message_types, st.dictionaries(st.sampled_from(
    ["id", "node_id", "assignment_id", "model", "method", "path", "body", "status", "data", "usage", "code",
     "heartbeat_s", "deadline_s", "hardware", "platform", "engines", "state", "version"]), json_values, max_size=6))
def test_parser_raises_only_bad_message_on_arbitrary_objects(kind: str, fields: dict) -> None:
    frame = json.dumps({"type": kind, **fields})
    for parse in (from_coordinator, protocol.parse_from_node):
        try:
            message = parse(frame)
        except protocol.BadMessage as exc:
            assert exc.reply().code == "bad_message"
        else:
            assert message.type == kind


# --- batching (Relay, "Batching") ---------------------------------------------------------------


def test_a_batch_of_node_messages_round_trips_in_order() -> None:
    messages = [protocol.ResponseHead(id="r-1", status=200), protocol.ResponseChunk(id="r-1", data="data: x\n\n"),
                protocol.ResponseEnd(id="r-1"), protocol.Error(code="bad_message", ref="r-2")]
    frame = protocol.encode_batch([protocol.encode(m) for m in messages])
    assert frame == protocol.encode(protocol.Batch(messages=messages))
    parsed = protocol.parse_from_node(frame)
    assert isinstance(parsed, protocol.Batch)
    assert protocol.unpack(parsed) == messages
    assert protocol.unpack(messages[0]) == [messages[0]]


@pytest.mark.parametrize("inner", [
    {"type": "batch", "messages": [{"type": "response.end", "id": "r-1"}]},  # a batch inside a batch
    {"type": "welcome", "node_id": "n"},  # a coordinator message
    {"type": "response.later", "id": "r-1"},  # a type this version does not know
    {"type": "response.chunk", "id": "r-1"},  # an element that is not a valid message
], ids=["nested", "coordinator-type", "unknown-type", "invalid"])
def test_a_batch_holds_only_node_messages_that_could_be_sent_alone(inner: dict) -> None:
    frame = json.dumps({"type": "batch", "messages": [{"type": "response.end", "id": "r-0"}, inner]})
    with pytest.raises(protocol.BadMessage, match="invalid 'batch' message: messages.1"):
        protocol.parse_from_node(frame)


def test_an_empty_batch_is_refused_and_the_coordinator_sends_none() -> None:
    with pytest.raises(protocol.BadMessage, match="batch"):
        protocol.parse_from_node('{"type": "batch", "messages": []}')
    assert isinstance(from_coordinator('{"type": "batch", "messages": []}'), protocol.Unknown)
