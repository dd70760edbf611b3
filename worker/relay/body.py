"""The relay's rules for bodies, pure: which requests may reach an engine and which are
generations, the body an engine is sent, and the engine's bytes back as text to relay.

A body that gives media by URL (`image_url: "http://192.168.1.1/…"`) is refused before it
reaches the engine, which would otherwise fetch it from the provider's home network: media come
inline, as `data:` URLs.

A body's constraints are bounded too (`unbounded`, `beyond_context`; contract, Relay, "Bounded
requests"): an engine compiles a grammar, a JSON schema or a regex recursively, and one nested
deep enough crashes it (llama-server fell to a grammar 20,000 parentheses deep, 40 kB). Each
check is linear in what it reads, and sizes are checked before nesting is counted.

`StreamFilter` cuts an event stream at SSE event boundaries (so a multi-byte character is never
split), looks for `"usage"` with one substring search over the whole block, and splits into events
only the tail from there on (the whole backlog, split per event, cost a quarter of the node's CPU).
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from pydantic import ValidationError

from worker.contract import protocol

log = logging.getLogger(__name__)

# The requests that generate tokens: the only ones measured and paid for.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_MAX_HELD_BYTES = 1 << 20  # an "event" this long without a blank line is relayed as it is
_PATH = re.compile(r"^/v1/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*(\?[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?$")
_EVENT_SEPARATOR = re.compile(rb"(\r?\n\r?\n)")
_USAGE_KEY = b'"usage"'
_LINE_BREAKS = frozenset(b"\r\n")
# Where a body names media: keys whose string value is a URL (OpenAI, responses and Anthropic
# forms), and media objects (inline base64 and plain fields). Only inline data passes.
_URL_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "file_url"})
_MEDIA_OBJECTS = frozenset({"input_audio", "file"})
_URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
MAX_BODY_DEPTH = 64
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CONSTRAINT_NESTING = 128
MAX_CONSTRAINTS_BYTES = 1 << 20  # all of a request's together: their checks stay within milliseconds
MAX_CHOICES = 16
MAX_LOGPROBS = 20
MAX_TOOLS = 128  # OpenAI's own limit; each tool's parameters are a constraint of up to 64 KiB
# Where the engines take a grammar, a JSON schema or a regex (llama-server's and vLLM's request
# parsers): each key's whole value is one constraint, and so is each tool (its parameters become
# a grammar).
_CONSTRAINT_KEYS = ("grammar", "json_schema", "response_format", "grammar_triggers", "structured_outputs",
                    "guided_json", "guided_regex", "guided_grammar", "guided_choice", "guided_whitespace_pattern")
_CHOICE_KEYS = ("n", "n_cmpl", "best_of")  # answers generated for one request
# completions' `logprobs` is a count, chat's a bool; vLLM's `prompt_logprobs` a count for each prompt token
_LOGPROB_KEYS = ("n_probs", "top_logprobs", "logprobs", "prompt_logprobs")
_LENGTH_KEYS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
_ESCAPED = re.compile(rb"\\.", re.DOTALL)
_ONE_KIND = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"()[]{}")
_RUNS = re.compile(rb"\(+|\)+")
_OPEN = ord("(")
_PAIR_PASSES = 8
_PLAIN_FORMATS = (None, "text")  # a `response_format` / `text.format` that constrains nothing


class StreamFilter:
    """The engine's bytes → UTF-8 text to relay, picking up `usage` on the way.

    For an event stream it relays whole SSE events only (a blank line is ASCII, so a multi-byte
    character split across network reads is always joined first) and, when the relay asked for
    usage on the caller's behalf, drops the usage-only chunk (`"choices": []`) from what is relayed.
    """

    def __init__(self, *, events: bool, strip_usage: bool) -> None:
        self._events = events
        self._strip_usage = strip_usage
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = b""
        self.usage: protocol.Usage | None = None

    def feed(self, data: bytes) -> str:
        if not self._events:
            return self._decoder.decode(data)
        if self._held:
            data = self._held + data
            self._held = b""
        elif data.endswith(b"\n\n") and _USAGE_KEY not in data:
            return data.decode("utf-8", "replace")  # the common case: whole events, no usage
        end = _end_of_last_event(data)
        if end == 0 and len(data) <= _MAX_HELD_BYTES:
            self._held = data
            return ""
        if end == 0:
            end = _utf8_safe_end(data)
        complete, self._held = data[:end], data[end:]
        return self._read_usage(complete).decode("utf-8", "replace")

    def finish(self) -> str:
        rest, self._held = self._held, b""
        if self._events:
            return self._read_usage(rest).decode("utf-8", "replace")
        return self._decoder.decode(b"", final=True)

    def read_json_usage(self, body: bytes) -> None:
        """Usage of a whole (non-streamed) JSON answer."""
        if _USAGE_KEY not in body:
            return
        try:
            document = json.loads(body)
        except ValueError:
            return
        if isinstance(document, dict):
            self._remember_usage(document.get("usage"))

    def _read_usage(self, block: bytes) -> bytes:
        first = block.find(_USAGE_KEY)
        if first < 0:
            return block
        start = _events_start_before(block, first)
        return block[:start] + self._without_usage_only(block[start:])

    def _without_usage_only(self, block: bytes) -> bytes:
        parts = _EVENT_SEPARATOR.split(block)
        kept: list[bytes] = []
        for event, separator in zip(parts[0::2], parts[1::2] + [b""]):
            if _USAGE_KEY in event and self._is_usage_only(event):
                continue
            kept.append(event + separator)
        return b"".join(kept)

    def _is_usage_only(self, event: bytes) -> bool:
        """Reads the event's usage; True when the event should be left out of the relay."""
        payload = b"\n".join(
            line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")
        )
        try:
            document = json.loads(payload)
        except ValueError:
            return False
        if not isinstance(document, dict):
            return False
        self._remember_usage(document.get("usage"))
        return self._strip_usage and document.get("choices") == [] and document.get("usage") is not None

    def _remember_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        try:
            self.usage = protocol.Usage.model_validate(usage)
        except ValidationError:
            log.debug("the engine's usage %r does not fit the protocol; ignored", usage)


def _end_of_last_event(data: bytes) -> int:
    """Index just past the last blank line (`\\n\\n` or `\\r\\n\\r\\n`); 0 when there is none."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n", max(lf - 1, 0))  # one ending before lf + 2 cannot be the last
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _events_start_before(block: bytes, index: int) -> int:
    """A place before `index` from which splitting `block[place:]` into events cuts it exactly as
    splitting all of `block` would, so only the tail holding `"usage"` (the stream's last events)
    is split, not the whole backlog: the start of the run of line breaks holding the last blank
    line before `index`. A separator is line breaks only, so none spans a run's start; 0 when
    there is no blank line before `index`."""
    blank = max(block.rfind(b"\n\n", 0, index), block.rfind(b"\n\r\n", 0, index))
    if blank < 0:
        return 0
    while blank > 0 and block[blank - 1] in _LINE_BREAKS:
        blank -= 1
    return blank


def _utf8_safe_end(data: bytes) -> int:
    """The longest prefix of `data` that does not end inside a multi-byte character."""
    end = len(data)
    start = end
    while start > 0 and end - start < 4 and data[start - 1] & 0xC0 == 0x80:
        start -= 1
    if start == 0 or data[start - 1] < 0x80:
        return end
    lead = data[start - 1]
    needed = 2 if lead >= 0xC0 and lead < 0xE0 else 3 if lead < 0xF0 else 4
    return end if end - (start - 1) >= needed else start - 1


def unrelayable(method: str, path: str) -> str | None:
    """Why this request may not reach the engine, or None."""
    if method not in ("GET", "POST"):
        return f"only GET and POST are relayed, not {method!r}"
    segments = unquote(path.split("?", 1)[0]).split("/")
    if not _PATH.match(path) or ".." in segments or any("\\" in s for s in segments):
        return f"only paths under /v1/ are relayed, not {path!r}"
    return None


def media_by_url(body: Any) -> str | None:
    """Why `body` would make the engine fetch something, or None (pure).

    Anywhere in the body (`messages[*].content[*]`, a responses `input`, an Anthropic `source`,
    a rerank document): the string value of a URL key must be a `data:` URL, and no string inside
    a media object (`input_audio`, `file`) may be a URL. Anything nested deeper than
    `MAX_BODY_DEPTH` is refused unread."""
    stack: list[tuple[Any, str, str | None, bool, int]] = [(body, "body", None, False, 0)]
    while stack:
        value, where, key, in_media, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            return f"the request body is nested more than {MAX_BODY_DEPTH} levels deep"
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}", k, in_media or k in _MEDIA_OBJECTS, depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", None, in_media, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str) and _fetched(value, key in _URL_KEYS, in_media):
            return (f"{where[:160]} gives media by URL; this node never fetches from the network for a request: "
                    "send the media inline as a data: URL (data:image/png;base64,…)")
    return None


def _fetched(text: str, url_key: bool, in_media: bool) -> bool:
    """A string the engine would fetch: a URL key's value that is not a `data:` URL, or a URL
    (`scheme://…`) inside a media object."""
    stripped = text.strip()
    if stripped[:5].lower() == "data:":
        return False
    return url_key or (in_media and _URL_SCHEME.match(stripped) is not None and "://" in stripped)


def unbounded(body: Any) -> str | None:
    """Why `body` asks more of an engine than any request may, whatever the engine, or None
    (pure): a constraint over `MAX_CONSTRAINT_BYTES` or nesting brackets deeper than
    `MAX_CONSTRAINT_NESTING`, all of them over `MAX_CONSTRAINTS_BYTES`, more than `MAX_TOOLS`
    tools, more than `MAX_CHOICES` answers, or more than `MAX_LOGPROBS` log-probabilities a
    token. Expects a body no deeper than `MAX_BODY_DEPTH` (`media_by_url`)."""
    if not isinstance(body, dict):
        return None
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        return f"the request gives {len(tools)} tools; this node takes at most {MAX_TOOLS} a request"
    budget = MAX_CONSTRAINTS_BYTES
    for name, value in _constraints(body):
        problem, budget = _constraint_problem(name, value, budget)
        if problem is not None:
            return problem
    choices = _over(body, _CHOICE_KEYS, MAX_CHOICES)
    if choices is not None:
        return f"the request asks for {choices} answers at once; this node gives at most {MAX_CHOICES} a request"
    logprobs = _over(body, _LOGPROB_KEYS, MAX_LOGPROBS)
    if logprobs is not None:
        return (f"the request asks for {logprobs} log-probabilities a token; "
                f"this node gives at most {MAX_LOGPROBS}")
    return None


def beyond_context(body: Any, context: int | None) -> str | None:
    """Why `body` asks for more tokens than the engine's context holds, or None; None too where
    the context is not known."""
    if context is None or not isinstance(body, dict):
        return None
    asked = _over(body, _LENGTH_KEYS, context)
    if asked is None:
        return None
    return (f"the request asks for up to {asked} tokens, more than this engine's context of {context} tokens; "
            f"ask for {context} or fewer")


def constrained(body: Any) -> bool:
    """Whether `body` asks for constrained decoding: a grammar, a JSON schema or format, a regex,
    a set of choices, or tools the engine may have to call."""
    if not isinstance(body, dict):
        return False
    for name, value in _constraints(body):
        if name.startswith("tools["):
            if body.get("tool_choice") != "none":
                return True
        elif name in ("response_format", "text.format"):
            if not isinstance(value, dict) or value.get("type") not in _PLAIN_FORMATS:
                return True
        elif value not in ("", []):  # an empty schema ({}) still means "any JSON object"
            return True
    return False


def _constraints(body: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each constraint in `body` and what to call it in a refusal."""
    for key in _CONSTRAINT_KEYS:
        if body.get(key) is not None:
            yield key, body[key]
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            yield f"tools[{i}]", tool
    text = body.get("text")  # the responses API's `text.format`
    if isinstance(text, dict) and text.get("format") is not None:
        yield "text.format", text["format"]


def _constraint_problem(name: str, value: Any, budget: int) -> tuple[str | None, int]:
    """Why constraint `value` is refused, or None; and the bytes the request's constraints may
    still take after it."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_CONSTRAINT_BYTES:
        return (f"the request's {name} is {len(data):,} bytes; this node takes constraints "
                f"(grammars, JSON schemas, regexes, tools) of at most {MAX_CONSTRAINT_BYTES // 1024} KiB"), 0
    budget -= len(data)
    if budget < 0:
        return (f"the request's constraints (grammars, JSON schemas, regexes, tools) come to more than "
                f"{MAX_CONSTRAINTS_BYTES // 1024} KiB together; this node takes at most that a request"), 0
    if _nests_deeper(data, MAX_CONSTRAINT_NESTING):
        return (f"the request's {name} nests brackets more than {MAX_CONSTRAINT_NESTING} levels deep; "
                f"this node takes constraints nested at most {MAX_CONSTRAINT_NESTING} deep"), 0
    return None, budget


def _nests_deeper(data: bytes, limit: int) -> bool:
    """Whether brackets of any kind (`(`, `[`, `{`) nest deeper than `limit` in UTF-8 `data` (no
    multi-byte character holds an ASCII byte), walking depth as a parser would: a backslash
    escapes the next character, and a closing bracket with none open is ignored (so no run of
    stray closers hides the openers after it).

    Mostly at C speed (a walk in Python over every bracket of 8 MiB took seconds): taking away
    every adjacent pair `()` lowers the deepest point by one and changes no other depth, so after
    up to `_PAIR_PASSES` passes the walk in Python goes over runs of brackets, each of which stood
    for that many pairs. Never too shallow; where brackets are left open, up to `_PAIR_PASSES`
    levels too deep."""
    if data.count(b"(") + data.count(b"[") + data.count(b"{") <= limit:
        return False  # the common case: too few openers to nest that deep
    if b"\\" in data:
        data = _ESCAPED.sub(b"", data)
    brackets = data.translate(_ONE_KIND, _NOT_BRACKETS)
    taken = 0
    while taken < _PAIR_PASSES and b"()" in brackets:
        brackets = brackets.replace(b"()", b"")
        taken += 1
    depth = taken
    for run in _RUNS.finditer(brackets):
        length = run.end() - run.start()
        if brackets[run.start()] == _OPEN:
            depth += length
            if depth > limit:
                return True
        else:
            depth = max(taken, depth - length)
    return depth > limit


def _over(body: dict[str, Any], keys: tuple[str, ...], limit: int) -> int | float | None:
    """The first number under `keys` that is over `limit` (`true` is no number), or None."""
    for key in keys:
        value = body.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            return value
    return None


def is_generation(method: str, path: str) -> bool:
    """A request that generates tokens (its query string aside): the relay meters these only."""
    return method == "POST" and path.split("?")[0] in GENERATION_PATHS


def asks_stream(body: Any) -> bool:
    return isinstance(body, dict) and body.get("stream") is True


def engine_body(body: Any, served_model_name: str) -> tuple[bytes | None, bool]:
    """The body sent to the engine, and whether the relay added `include_usage` (so that the
    usage-only chunk must be left out of what the caller gets)."""
    if body is None:
        return None, False
    if not isinstance(body, dict):
        return json.dumps(body, ensure_ascii=False).encode("utf-8"), False
    body = dict(body)
    body["model"] = served_model_name
    strip_usage = False
    if body.get("stream") is True:
        options = body.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        if options.get("include_usage") is not True:
            options["include_usage"] = True
            body["stream_options"] = options
            strip_usage = True
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), strip_usage


def engine_headers(api_key: str, has_body: bool) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {api_key}", "Accept-Encoding": "identity"}
    if has_body:
        headers["Content-Type"] = "application/json"
    return headers
