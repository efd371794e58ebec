"""Choices: one engine request's outputs, interleaved across its choices, shaped as OpenAI choices.

A request runs `n` choices for each of its prompts (a /v1/completions prompt list), all in one engine
request; output `index` p * n + j is prompt p's choice j, OpenAI's order. Each choice keeps its own text,
logprobs, finish reason and, for chat with tools, its tool-call parser. `final` builds whole choices
(a JSON body); `chunk` turns one output into the stream's choice deltas. `heavy` says when that work (and
rendering it as JSON) is too much for the event loop every other request shares.
"""

from dataclasses import dataclass, field
from typing import Literal

from app.completions.logprobs import CompletionLogprobsBuilder, TokenTexts, chat_logprobs, join
from app.completions.tool_calls import BEGIN, ParsedCall, ToolCallStream, parse
from app.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from deployments.engine.interface import FinishReason, RequestOutput, TokenLogprob

Kind = Literal["chat", "completion"]
# Past these a response (or one stream piece) is shaped and rendered in the thread pool: below them the
# work is well under a millisecond, less than the hop to a thread and back.
HEAVY_CHARS = 1 << 16  # characters of text in it
HEAVY_BLOCKS = 64  # tool-call openings to parse (each closed one is a JSON decode)


@dataclass(frozen=True)
class Shape:
    """What the response carries beyond text, as the route asked for it."""

    n: int = 1  # choices per prompt
    logprobs: int | None = None  # None: no logprobs; else with this many top alternatives
    echo: tuple[str, ...] | None = None  # /v1/completions echo: each prompt's text, before its completion
    tool_names: frozenset[str] = frozenset()  # chat: the output is parsed for calls of these tools


def finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return str(out.finish_reason)
    return None


@dataclass
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # chat
    pieces: list[CompletionLogprobs] = field(default_factory=list)  # completions
    builder: CompletionLogprobsBuilder | None = None
    finish: str | None = None
    seen: bool = False  # has had an output (an echo's prompt goes before the first)
    tools: ToolCallStream | None = None  # streamed chat with tools
    calls: int = 0  # tool calls streamed so far
    forced: bool | None = None  # the grammar closed its output early (near max_tokens): True, else None
    gpu_limited: bool | None = None  # it ended at the request's GPU-time bound: True, else None


class Choices:
    def __init__(self, kind: Kind, shape: Shape, prompts: list[list[int]], texts: TokenTexts) -> None:
        self.kind = kind
        self.shape = shape
        self.prompts = prompts
        self.texts = texts
        self.total = len(prompts) * shape.n
        self._choices: dict[int, _Choice] = {}
        self._chars = 0  # text added so far, all choices together

    def heavy(self, out: RequestOutput | None = None) -> bool:
        """Whether shaping `out` as a stream piece (or, for None, the whole response) and rendering it is
        more than the event loop should do: many logprobs (a prompt's, or every token of every choice), a
        large text (an echo, a long output, a tool call's held text coming out), or many tool-call blocks
        to parse. The caller then does it in the thread pool."""
        if out is None:
            return (
                self.shape.logprobs is not None
                or self._chars >= HEAVY_CHARS
                or self._openings(["".join(c.text) for c in self._choices.values()]) >= HEAVY_BLOCKS
            )
        if self.shape.logprobs is not None and out.prompt_logprobs is not None:
            return True
        return self._piece_chars(out) >= HEAVY_CHARS or self._openings([out.text]) >= HEAVY_BLOCKS

    def _openings(self, texts: list[str]) -> int:
        """Tool-call openings to parse in `texts` (only counted below HEAVY_CHARS: cheap)."""
        if self.kind != "chat" or not self.shape.tool_names:
            return 0
        return sum(text.count(BEGIN) for text in texts)

    def _piece_chars(self, out: RequestOutput) -> int:
        """Characters of text the stream piece for `out` carries."""
        chars = len(out.text)
        choice = self._choices.get(out.index)
        if self.shape.echo is not None and (choice is None or not choice.seen):
            chars += len(self.shape.echo[out.index // self.shape.n])
        ends = out.finish_reason is not None or out.finished
        if choice is not None and choice.tools is not None and (ends or choice.tools.closes(out.text)):
            chars += choice.tools.held
        return chars

    def reset(self) -> None:
        """Start over (the request runs again after a lost replica)."""
        self._choices.clear()
        self._chars = 0

    def _get(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index)
            if self.kind == "completion" and self.shape.logprobs is not None:
                choice.builder = CompletionLogprobsBuilder(self.texts)
            if self.kind == "chat" and self.shape.tool_names:
                choice.tools = ToolCallStream(self.shape.tool_names)
        return choice

    # -- whole responses --------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        choice = self._get(out.index)
        text, piece = self._completion_piece(choice, out) if self.kind == "completion" else (out.text, None)
        choice.seen = True
        choice.text.append(text)
        self._chars += len(text)
        if piece is not None:
            choice.pieces.append(piece)
        if self.kind == "chat" and self.shape.logprobs is not None and out.logprobs:
            choice.logprobs += out.logprobs
        if out.finish_reason is not None:
            choice.finish = finish_reason(out)
            choice.forced = out.closing_forced or None
            choice.gpu_limited = out.gpu_limited or None

    def final(self) -> list[ChatChoice] | list[CompletionChoice]:
        if self.kind == "completion":
            completions = []
            for index in range(self.total):
                choice = self._get(index)
                if not choice.seen and self.shape.echo is not None:  # no output at all: still its echo
                    self.add(RequestOutput(request_id="", text="", index=index))
                    choice.finish = None
                logprobs = join(choice.pieces) if choice.builder is not None else None
                text = "".join(choice.text)
                completions.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        finish_reason=choice.finish,
                        logprobs=logprobs,
                        closing_forced=choice.forced,
                        gpu_time_limited=choice.gpu_limited,
                    )
                )
            return completions
        chats = []
        for index in range(self.total):
            choice = self._get(index)
            text = "".join(choice.text)
            content: str | None = text
            calls: list[ParsedCall] = []
            if self.shape.tool_names:
                content, calls = parse(text, self.shape.tool_names)
            message = AssistantMessage(
                content=content,
                tool_calls=[_tool_call(c) for c in calls] or None,
            )
            chats.append(
                ChatChoice(
                    index=index,
                    message=message,
                    finish_reason="tool_calls" if calls else choice.finish,
                    logprobs=self._chat_logprobs(choice.logprobs),
                    closing_forced=choice.forced,
                    gpu_time_limited=choice.gpu_limited,
                )
            )
        return chats

    def _chat_logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.shape.logprobs is None:
            return None
        return chat_logprobs(entries or [], self.texts)

    def _completion_piece(self, choice: _Choice, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The output's text and logprobs, with the prompt's in front on a choice's first output."""
        text = out.text
        token_ids: list[int] = []
        entries: list[TokenLogprob | None] = []
        if not choice.seen and self.shape.echo is not None:
            prompt = out.index // self.shape.n
            text = self.shape.echo[prompt] + text
            token_ids += self.prompts[prompt]
            given = out.prompt_logprobs or []
            entries += (
                given if len(given) == len(self.prompts[prompt]) else [None] * len(self.prompts[prompt])
            )
        if choice.builder is None:
            return text, None
        token_ids += out.token_ids
        logprobs = out.logprobs or []
        entries += logprobs if len(logprobs) == len(out.token_ids) else [None] * len(out.token_ids)
        return text, choice.builder.add(token_ids, entries)

    # -- streams -----------------------------------------------------------------------------------

    def opening(self) -> list[ChatChunkChoice]:
        """Chat streams open every choice with the assistant's role."""
        return [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(self.total)
        ]

    def chunk(self, out: RequestOutput) -> list[ChatChunkChoice] | list[CompletionChoice]:
        """The stream's choice deltas for one output, in order (none when there is nothing to say)."""
        choice = self._get(out.index)
        ended = out.finish_reason is not None
        reason = finish_reason(out) if ended else None
        forced = out.closing_forced or None
        limited = out.gpu_limited or None
        if self.kind == "completion":
            text, piece = self._completion_piece(choice, out)
            choice.seen = True
            if not (text or piece is not None or ended or out.finished):
                return []
            return [
                CompletionChoice(
                    index=out.index,
                    text=text,
                    finish_reason=reason,
                    logprobs=piece,
                    closing_forced=forced,
                    gpu_time_limited=limited,
                )
            ]
        choice.seen = True
        logprobs = self._chat_logprobs(out.logprobs) if out.logprobs else None
        if choice.tools is None:
            if not (out.text or logprobs is not None or ended or out.finished):
                return []
            return [
                ChatChunkChoice(
                    index=out.index,
                    delta=ChatDelta(content=out.text),
                    finish_reason=reason,
                    logprobs=logprobs,
                    closing_forced=forced,
                    gpu_time_limited=limited,
                )
            ]
        events = choice.tools.feed(out.text) + (choice.tools.finish() if ended else [])
        content = "".join(e for e in events if isinstance(e, str))
        deltas = []
        if content or logprobs is not None:
            deltas.append(
                ChatChunkChoice(index=out.index, delta=ChatDelta(content=content), logprobs=logprobs)
            )
        for call in (e for e in events if isinstance(e, ParsedCall)):
            k = choice.calls
            choice.calls += 1
            named = ToolCallDelta(
                index=k, id=call.id, type="function", function=FunctionCallDelta(name=call.name, arguments="")
            )
            arguments = ToolCallDelta(index=k, function=FunctionCallDelta(arguments=call.arguments))
            deltas.append(ChatChunkChoice(index=out.index, delta=ChatDelta(tool_calls=[named])))
            deltas.append(ChatChunkChoice(index=out.index, delta=ChatDelta(tool_calls=[arguments])))
        if ended or out.finished:
            if not deltas:
                deltas.append(ChatChunkChoice(index=out.index, delta=ChatDelta(content="")))
            deltas[-1].finish_reason = "tool_calls" if choice.calls else reason
            deltas[-1].closing_forced = forced
            deltas[-1].gpu_time_limited = limited
        return deltas


def _tool_call(call: ParsedCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
