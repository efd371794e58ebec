"""Tool calls: how a request's tools become a grammar or a parser, and how output text becomes calls.

The chat templates we serve (Hermes/Qwen style, see app/modelprep/demo_model.py) ask the model to answer
a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. With tool_choice "auto" the model is
free and its text is parsed afterwards; with "required" or a named function, decoding is constrained
(`StructuredOutput`) to exactly such blocks, which the same parser then reads. Well-formed blocks that
name a known tool become OpenAI `tool_calls`; anything else stays content.

`ToolCallStream` does the same while streaming, and never lets a block (or the start of one still
arriving) leak out as content.
"""

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from app.errors import InvalidParameter
from app.schemas.openai import ChatCompletionRequest, ResponseFormatText, Tool
from deployments.engine.interface import StructuredOutput

BEGIN, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_block(body: str, names: frozenset[str]) -> ParsedCall | None:
    """One block's inside as a call, or None if it is not a well-formed call of a known tool."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
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


def parse(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole output: calls in order; content is the text outside them, less the
    whitespace before each call and at the end (None when nothing is left). Malformed blocks stay in the
    content, as written. `ToolCallStream` gives the same content, piece by piece."""
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = parse_block(match.group(1), names)
        if call is None:
            continue
        pieces.append(text[position : match.start()].rstrip())
        position = match.end()
        calls.append(call)
    if not calls:
        return text, []
    pieces.append(text[position:].rstrip())
    return "".join(pieces) or None, calls


def _held_prefix(text: str) -> int:
    """Length of the longest suffix of `text` that could be the start of BEGIN."""
    for size in range(min(len(text), len(BEGIN) - 1), 0, -1):
        if BEGIN.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallStream:
    """Incremental `parse`: feed text as it streams; get content to send and calls as they complete."""

    names: frozenset[str]
    calls: int = 0
    _buffer: str = ""
    _in_call: bool = False
    _blank: str = ""  # whitespace held back: dropped if it only separates calls
    _events: list[str | ParsedCall] = field(default_factory=list)

    def feed(self, text: str) -> list[str | ParsedCall]:
        self._buffer += text
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
                self._in_call = False
                call = parse_block(body, self.names)
                if call is None:
                    self._content(BEGIN + body + END)
                else:
                    self._blank = ""  # whitespace before a call is no content
                    self.calls += 1
                    self._events.append(call)
                continue
            begin = self._buffer.find(BEGIN)
            if begin >= 0:
                self._content(self._buffer[:begin])
                self._buffer = self._buffer[begin + len(BEGIN) :]
                self._in_call = True
                continue
            keep = _held_prefix(self._buffer)
            self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            break
        return self._take()

    def finish(self) -> list[str | ParsedCall]:
        """The end of the output: what was held back is content after all (an unclosed block included)."""
        rest = (BEGIN if self._in_call else "") + self._buffer
        self._buffer, self._in_call = "", False
        self._content(rest)
        if not self.calls and self._blank:
            self._events.append(self._blank)
        self._blank = ""
        return self._take()

    def _content(self, text: str) -> None:
        if not text:
            return
        if not text.strip():  # only whitespace: wait and see whether real content follows
            self._blank += text
            return
        core = text.rstrip()  # trailing whitespace waits too: it may end the content before a call
        self._events.append(self._blank + core)
        self._blank = text[len(core) :]

    def _take(self) -> list[str | ParsedCall]:
        events, self._events = self._events, []
        return events


# -- the request side --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for the engine and for its output."""

    tools: list[dict[str, Any]] | None  # for the chat template; None: no tools
    structured: StructuredOutput | None  # the grammar of required / named tool_choice
    names: frozenset[str]  # the output is parsed for calls of these; empty: not parsed


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def plan(body: ChatCompletionRequest) -> ToolPlan:
    """The request's tools and tool_choice, checked: 400s name the field at fault."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice is not None and choice not in ("none", "auto"):
            raise InvalidParameter("tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, None, frozenset())
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan(rendered, None, frozenset())
    names = frozenset(t.function.name for t in tools)
    if choice is None or choice == "auto":
        return ToolPlan(rendered, None, names)
    if body.response_format is not None and not isinstance(body.response_format, ResponseFormatText):
        message = "response_format cannot be combined with a required or named tool_choice"
        raise InvalidParameter(message, param="response_format")
    if choice == "required":
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
        begin=BEGIN,
        end=END,
        repeat=repeat,
        param=param,
    )
    return ToolPlan(rendered, structured, names)
