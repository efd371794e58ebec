"""ChatRenderer: a chat request's outputs as a ChatCompletion or its chunk stream. A thinking model's text
is split into reasoning (`reasoning_content`) and content first; with tools, the content is parsed for
calls (whole at the end, or as the stream releases them)."""

from typing import Any

from app.completions.logprobs import chat_logprobs
from app.completions.reasoning import ReasoningStream
from app.completions.rendering import Choice, ChoiceRenderer, finish_reason, sse
from app.completions.tool_calls import ParsedCall, ToolCallStream, parse
from app.schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from deployments.engine.interface import RequestOutput, TokenLogprob


class ChatRenderer(ChoiceRenderer):
    def _new_choice(self, index: int) -> Choice:
        shape = self.shape
        tools = ToolCallStream(shape.tool_names, shape.tool_format) if shape.tool_names else None
        reasoning = ReasoningStream(shape.opened) if shape.reasoning else None
        return Choice(index, tools=tools, reasoning=reasoning)

    def _openings(self, texts: list[str]) -> int:
        if not self.shape.tool_names:
            return 0
        begin = self.shape.tool_format.begin
        return sum(text.count(begin) for text in texts)

    def _held_chars(self, choice: Choice | None, out: RequestOutput) -> int:
        """A tool call's held text comes out with the piece that closes it, or at the end."""
        if choice is None or choice.tools is None:
            return 0
        ends = out.finish_reason is not None or out.finished
        return choice.tools.held if ends or choice.tools.closes(out.text) else 0

    # -- whole responses --------------------------------------------------------------------------

    def add(self, out: RequestOutput) -> None:
        choice = self._get(out.index)
        reasoning, content = self._split(choice, out)
        if reasoning:
            choice.thought.append(reasoning)
            self._chars += len(reasoning)
        self._took(choice, content)
        if self.shape.logprobs is not None and out.logprobs:
            choice.logprobs += out.logprobs
        if out.finish_reason is not None:
            choice.ended(out)

    def body(self, last: RequestOutput) -> dict[str, Any]:
        return ChatCompletion(
            id=self.request_id, model=self.model, choices=self.choices(), usage=self._usage(last.usage)
        ).model_dump()

    def choices(self) -> list[ChatChoice]:
        """Every choice, whole: its text, or its content and tool calls."""
        chats = []
        for index in range(self.total):
            choice = self._get(index)
            text = "".join(choice.text)
            content: str | None = text
            calls: list[ParsedCall] = []
            if self.shape.tool_names:
                content, calls = parse(text, self.shape.tool_names, self.shape.tool_format)
            thought = None
            if self.shape.reasoning:  # a thinking model's empty parts are absent (vLLM's null)
                thought, content = "".join(choice.thought) or None, content or None
            message = AssistantMessage(
                content=content, reasoning_content=thought, tool_calls=[_tool_call(c) for c in calls] or None
            )
            chats.append(
                ChatChoice(
                    index=index,
                    message=message,
                    finish_reason="tool_calls" if calls else choice.finish,
                    logprobs=self._logprobs(choice.logprobs),
                    closing_forced=choice.forced,
                    gpu_time_limited=choice.gpu_limited,
                )
            )
        return chats

    def _logprobs(self, entries: list[TokenLogprob] | None) -> ChatLogprobs | None:
        if self.shape.logprobs is None:
            return None
        return chat_logprobs(entries or [], self.texts)

    # -- streams -----------------------------------------------------------------------------------

    def opening(self, first: RequestOutput) -> list[str]:
        """Chat streams open every choice with the assistant's role."""
        usage = self._usage_so_far(first)
        return [
            sse(
                self._envelope(
                    [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))], usage
                )
            )
            for i in range(self.total)
        ]

    def events(self, out: RequestOutput) -> list[str]:
        usage = self._usage_so_far(out)
        return [sse(self._envelope([piece], usage)) for piece in self._pieces(out)]

    def _pieces(self, out: RequestOutput) -> list[ChatChunkChoice]:
        """The stream's choice deltas for one output, in order (none when there is nothing to say)."""
        choice = self._get(out.index)
        choice.seen = True
        ended = out.finish_reason is not None
        reason = finish_reason(out) if ended else None
        forced = out.closing_forced or None
        limited = out.gpu_limited or None
        logprobs = self._logprobs(out.logprobs) if out.logprobs else None
        thought, text = self._split(choice, out)
        if choice.tools is None:
            if not (thought or text or logprobs is not None or ended or out.finished):
                return []
            delta = ChatDelta(
                content=text if text or not thought else None, reasoning_content=thought or None
            )
            return [
                ChatChunkChoice(
                    index=out.index,
                    delta=delta,
                    finish_reason=reason,
                    logprobs=logprobs,
                    closing_forced=forced,
                    gpu_time_limited=limited,
                )
            ]
        events = choice.tools.feed(text) + (choice.tools.finish() if ended else [])
        content = "".join(e for e in events if isinstance(e, str))
        deltas = []
        if content or thought or logprobs is not None:
            delta = ChatDelta(
                content=content if content or not thought else None, reasoning_content=thought or None
            )
            deltas.append(ChatChunkChoice(index=out.index, delta=delta, logprobs=logprobs))
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

    def _envelope(self, choices: list[Any], usage: Usage | None) -> dict[str, Any]:
        chunk = ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump()
        for piece, dumped in zip(choices, chunk["choices"], strict=True):
            delta = dumped["delta"]
            if delta["tool_calls"] is not None:  # only what each piece says: the SDK joins them by index
                delta["tool_calls"] = [
                    call.model_dump(exclude_none=True) for call in piece.delta.tool_calls or ()
                ]
        return chunk


def _tool_call(call: ParsedCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
