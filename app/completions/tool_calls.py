"""Tool calls: how a request's tools become a grammar or a parser, and how output text becomes calls.

Each family writes calls in its own format (`ToolFormat`, chosen from the chat template by
app/served_models/chat_format.py): Hermes/Qwen (Qwen2.5, Qwen3, the demo templates in
app/modelprep/demo_model.py) as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call a block;
Phi-4-mini as `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`, a list of calls a
block (its grammar writes one call a list, a block a call). With "required" or a named function,
decoding is constrained (`StructuredOutput`) to exactly such blocks, which the same parser then reads. With
tool_choice "auto" the model may write free text, and once it opens a block the rest is constrained
the same way (a triggered grammar): a call, once begun, is a whole call of a listed tool that completes
within max_tokens, and only further calls (with parallel_tool_calls) may follow it. Where a
`response_format` is also given, it constrains the output instead and the text is only parsed. Well-formed
blocks that name a known tool become OpenAI `tool_calls`; anything else stays content.

`ToolCallStream` does the same while streaming, and never lets a block (or the start of one still
arriving) leak out as content.

Model output is hostile input here: a `response_format` pattern can force thousands of openings, so both
parsers read the text in one left-to-right pass (a lazy regex retried every later opening to the end:
quadratic), and JSON too deep for the decoder is a malformed call, not an error.
"""

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from app.errors import InvalidParameter
from app.schemas.openai import ChatCompletionRequest, ResponseFormatText, Tool
from app.served_models.chat_format import HERMES, ToolFormat
from deployments.engine.interface import StructuredOutput

BEGIN, END = HERMES.begin, HERMES.end
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_block(body: str, names: frozenset[str], fmt: ToolFormat = HERMES) -> list[ParsedCall] | None:
    """One block's inside as its calls, or None if it is not well-formed calls of known tools (a listed
    format's block may also hold one bare call; an empty list is no call)."""
    try:
        value = json.loads(body)
        if fmt.listed and isinstance(value, list):
            calls = [_call(v, names) for v in value]
            return [c for c in calls if c is not None] if value and None not in calls else None
        call = _call(value, names)
    except (ValueError, RecursionError):  # nested deeper than the decoder goes: as malformed as bad JSON
        return None
    return None if call is None else [call]


def _call(value: Any, names: frozenset[str]) -> ParsedCall | None:
    if not isinstance(value, dict) or set(value) - {"name", "arguments"}:
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def blocks(text: str, fmt: ToolFormat = HERMES) -> Iterator[tuple[int, int, str]]:
    """(start, end, inside) of each block, left to right: a block ends at the first end after its begin.
    One pass: once an opening has no end after it, no later one has either, so the scan stops there."""
    begin, end = fmt.begin, fmt.end
    position = 0
    while (start := text.find(begin, position)) >= 0:
        close = text.find(end, start + len(begin))
        if close < 0:
            return
        position = close + len(end)
        yield start, position, text[start + len(begin) : close]


def parse(text: str, names: frozenset[str], fmt: ToolFormat = HERMES) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole output: calls in order; content is the text outside them, less the
    whitespace before each call and at the end (None when nothing is left). Malformed blocks stay in the
    content, as written. `ToolCallStream` gives the same content, piece by piece."""
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    position = 0
    for start, end, body in blocks(text, fmt):
        found = parse_block(body, names, fmt)
        if found is None:
            continue
        pieces.append(text[position:start].rstrip())
        position = end
        calls += found
    if not calls:
        return text, []
    pieces.append(text[position:].rstrip())
    return "".join(pieces) or None, calls


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker` (held back in a stream)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallStream:
    """Incremental `parse`: feed text as it streams; get content to send and calls as they complete.

    A feed costs what it adds: a call's inside is kept in pieces, and its end is looked for only where the new
    text (with the few characters before it) could hold one, so a block that never closes costs one pass.
    """

    names: frozenset[str]
    fmt: ToolFormat = HERMES
    calls: int = 0
    _pending: str = ""  # outside a call: what could be the start of its begin, held back
    _inside: list[str] | None = None  # inside a call: its text so far, in pieces; None outside one
    _inside_chars: int = 0
    _tail: str = ""  # the inside's last len(end) - 1 characters: an end may begin there
    _blank: list[str] = field(
        default_factory=list
    )  # whitespace held back: dropped if it only separates calls
    _events: list[str | ParsedCall] = field(default_factory=list)

    @property
    def held(self) -> int:
        """Characters held back, to come out (as content or a call) when a call closes or the output ends."""
        return len(self._pending) + self._inside_chars

    def closes(self, text: str) -> bool:
        """Whether feeding `text` closes the call being read, releasing what it holds."""
        return self._inside is not None and self.fmt.end in self._tail + text

    def feed(self, text: str) -> list[str | ParsedCall]:
        while text:
            text = self._outside(text) if self._inside is None else self._within(text)
        return self._take()

    def finish(self) -> list[str | ParsedCall]:
        """The end of the output: what was held back is content after all (an unclosed block included)."""
        rest = self._pending if self._inside is None else self.fmt.begin + "".join(self._inside)
        self._pending, self._inside, self._inside_chars, self._tail = "", None, 0, ""
        self._content(rest)
        if not self.calls and self._blank:
            self._events.append("".join(self._blank))
        self._blank = []
        return self._take()

    def _outside(self, text: str) -> str:
        """Content up to the begin; returns what follows it (a call's inside), or "" when all is taken."""
        text, self._pending = self._pending + text, ""
        marker = self.fmt.begin
        begin = text.find(marker)
        if begin >= 0:
            self._content(text[:begin])
            self._inside, self._inside_chars, self._tail = [], 0, ""
            return text[begin + len(marker) :]
        keep = held_prefix(text, marker)
        self._content(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return ""

    def _within(self, text: str) -> str:
        """A call's inside up to the end; returns what follows it (content again), or "" when all is taken."""
        assert self._inside is not None
        end = self.fmt.end
        window = self._tail + text
        close = window.find(end)
        if close < 0:
            self._inside.append(text)
            self._inside_chars += len(text)
            self._tail = window[-(len(end) - 1) :]
            return ""
        before = "".join(self._inside)
        body = before[: len(before) - len(self._tail)] + window[:close]
        self._inside, self._inside_chars, self._tail = None, 0, ""
        found = parse_block(body, self.names, self.fmt)
        if found is None:
            self._content(self.fmt.begin + body + end)
        else:
            self._blank = []  # whitespace before a call is no content
            self.calls += len(found)
            self._events += found
        return window[close + len(end) :]

    def _content(self, text: str) -> None:
        if not text:
            return
        if not text.strip():  # only whitespace: wait and see whether real content follows
            self._blank.append(text)
            return
        core = text.rstrip()  # trailing whitespace waits too: it may end the content before a call
        self._events.append("".join(self._blank) + core)
        self._blank = [text[len(core) :]] if len(core) < len(text) else []

    def _take(self) -> list[str | ParsedCall]:
        events, self._events = self._events, []
        return events


# -- the request side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for the engine and for its output."""

    tools: list[dict[str, Any]] | None  # for the chat template; None: no tools
    structured: StructuredOutput | None  # the grammar of the calls (auto: triggered by their opening)
    names: frozenset[str]  # the output is parsed for calls of these; empty: not parsed
    fmt: ToolFormat = HERMES  # how the model writes them


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan(body: ChatCompletionRequest, fmt: ToolFormat = HERMES) -> ToolPlan:
    """The request's tools and tool_choice, checked: 400s name the field at fault; calls in `fmt`, the
    model's own format."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice not in ("none", "auto"):
            raise InvalidParameter("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, frozenset())
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(rendered, None, frozenset(), fmt)
    names = frozenset(t.function.name for t in tools)
    formatted = body.response_format is not None and not isinstance(body.response_format, ResponseFormatText)
    auto = choice is None or choice == "auto"
    if auto and formatted:  # the response_format's grammar decides the output
        return ToolPlan(rendered, None, names, fmt)
    # With a required or named tool_choice the turn's output is the call, never text: the call's grammar
    # decides it and response_format has nothing to shape until tool_choice goes back to auto (what the
    # Agents SDK does after forcing a first call on an agent with an output type).
    if choice is None or isinstance(choice, str):  # auto or required
        chosen, param, repeat = tools, "tools", body.parallel_tool_calls
    else:
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            message = f"tool_choice names the function {choice.function.name!r}, which is not in tools"
            raise InvalidParameter(message, param="tool_choice")
        param, repeat = "tool_choice", False
    schemas = [_call_schema(t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    structured = StructuredOutput(
        json_schema=json.dumps(schema, ensure_ascii=False),
        begin=fmt.grammar_begin,
        end=fmt.grammar_end,
        repeat=repeat,
        triggered=auto,
        param=param,
    )
    return ToolPlan(rendered, structured, names, fmt)
