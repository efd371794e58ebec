"""Renderer: what a request's engine outputs look like on one API's wire. Each API has its own (chat,
completions, responses); the one delivery loop (app/completions/delivery.py) drives any of them.

ChoiceRenderer is what chat and completions share: a request runs `n` choices for each of its prompts (a
/v1/completions prompt list), all in one engine request; output `index` p * n + j is prompt p's choice j,
OpenAI's order. Each choice keeps its own text, logprobs and finish reason. `heavy` says when shaping an
output (or the whole response) and rendering it as JSON is too much for the event loop every other request
shares.
"""

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from app.completions.logprobs import CompletionLogprobsBuilder
from app.completions.plan import RequestPlan, Shape
from app.completions.reasoning import ReasoningStream
from app.completions.tool_calls import ToolCallStream
from app.errors import to_api_error
from app.schemas.openai import CompletionLogprobs, CompletionTokensDetails, PromptTokensDetails, Usage
from app.served_models.token_texts import TokenTexts
from deployments.engine.interface import FinishReason, RequestOutput, RequestUsage, TokenLogprob

# Past these a response (or one stream piece) is shaped and rendered in the thread pool: below them the
# work is well under a millisecond, less than the hop to a thread and back.
HEAVY_CHARS = 1 << 16  # characters of text in it
HEAVY_BLOCKS = 64  # tool-call openings to parse (each closed one is a JSON decode)
DONE = "data: [DONE]\n\n"


class Renderer(Protocol):
    def heavy(self, out: RequestOutput | None = None) -> bool:
        """Whether shaping `out` (None: the whole response) belongs in the thread pool."""

    def reset(self) -> None:
        """Start over: the request runs again after a lost replica."""

    def add(self, out: RequestOutput) -> None:
        """Take one output into the whole response."""

    def body(self, last: RequestOutput) -> dict[str, Any]:
        """The whole response, once its last output is in."""

    async def keep(self, body: dict[str, Any]) -> dict[str, Any]:
        """After the request was billed: store what the API stores; the body to send."""

    def opening(self, first: RequestOutput) -> list[str]:
        """A stream's first events, before its first output's."""

    def events(self, out: RequestOutput) -> list[str]:
        """A stream's events for one output."""

    async def closing(self, last: RequestOutput) -> list[str]:
        """A stream's last events, after its last output (the request billed)."""

    def failure(self, error: Exception) -> list[str]:
        """A stream's events when the request fails partway."""


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage_block(usage: RequestUsage | None, reasoning_tokens: int | None = None) -> Usage:
    """The usage object; with `reasoning_tokens` (a thinking model's) its completion_tokens_details."""
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    if usage is None:
        return Usage(
            prompt_tokens=0,
            completion_tokens=0,
            total_tokens=0,
            prompt_tokens_details=PromptTokensDetails(),
            completion_tokens_details=details,
        )
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
        completion_tokens_details=details,
    )


def finish_reason(out: RequestOutput) -> str | None:
    if out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return str(out.finish_reason)
    return None


@dataclass
class Choice:
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # chat
    pieces: list[CompletionLogprobs] = field(default_factory=list)  # completions
    builder: CompletionLogprobsBuilder | None = None  # completions with logprobs
    finish: str | None = None
    seen: bool = False  # has had an output (an echo's prompt goes before the first)
    tools: ToolCallStream | None = None  # chat with tools
    reasoning: ReasoningStream | None = None  # chat of a thinking model
    thought: list[str] = field(default_factory=list)  # its reasoning text, in pieces
    calls: int = 0  # tool calls streamed so far
    forced: bool | None = None  # the grammar closed its output early (near max_tokens): True, else None
    gpu_limited: bool | None = None  # it ended at the request's GPU-time bound: True, else None

    def ended(self, out: RequestOutput) -> None:
        self.finish = finish_reason(out)
        self.forced = out.closing_forced or None
        self.gpu_limited = out.gpu_limited or None


class ChoiceRenderer:
    """The n x prompts choices of a chat or completions request; subclasses give them their shape."""

    def __init__(
        self,
        request_id: str,
        model: str,
        shape: Shape,
        prompts: list[list[int]],
        texts: TokenTexts,
        *,
        include_usage: bool = False,
        continuous_usage: bool = False,
    ) -> None:
        self.request_id = request_id
        self.model = model  # as the request named it
        self.shape = shape
        self.prompts = prompts
        self.texts = texts
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # vLLM's continuous_usage_stats: usage on every chunk
        self.created = int(time.time())
        self.total = len(prompts) * shape.n
        self._choices: dict[int, Choice] = {}
        self._chars = 0  # text added so far, all choices together

    @classmethod
    def for_plan(cls, request_id: str, plan: RequestPlan, **usage: bool) -> Self:
        target = plan.target
        return cls(request_id, target.name, plan.shape, plan.prompts, target.base.prompts.tokens, **usage)

    def heavy(self, out: RequestOutput | None = None) -> bool:
        """Many logprobs (a prompt's, or every token of every choice), a large text (an echo, a long
        output, a tool call's held text coming out), or many tool-call blocks to parse."""
        if out is None:
            return (
                self.shape.logprobs is not None
                or self._chars >= HEAVY_CHARS
                or self._openings(["".join(c.text) for c in self._choices.values()]) >= HEAVY_BLOCKS
            )
        if self.shape.logprobs is not None and out.prompt_logprobs is not None:
            return True
        chars = len(out.text) + self._held_chars(self._choices.get(out.index), out)
        return chars >= HEAVY_CHARS or self._openings([out.text]) >= HEAVY_BLOCKS

    def _openings(self, texts: list[str]) -> int:
        """Tool-call openings to parse in `texts` (only counted below HEAVY_CHARS: cheap)."""
        return 0

    def _held_chars(self, choice: Choice | None, out: RequestOutput) -> int:
        """Characters beyond `out.text` that its stream piece carries."""
        return 0

    def reset(self) -> None:
        self._choices.clear()
        self._chars = 0

    def _usage(self, usage: RequestUsage | None) -> Usage:
        """With a thinking model's reasoning tokens, all choices together."""
        if not self.shape.reasoning:
            return usage_block(usage)
        return usage_block(usage, sum(c.reasoning.tokens for c in self._choices.values() if c.reasoning))

    def _split(self, choice: Choice, out: RequestOutput) -> tuple[str, str]:
        """(reasoning, content) of an output's text."""
        if choice.reasoning is None:
            return "", out.text
        return choice.reasoning.take(out.text, out.steps(), out.finish_reason is not None or out.finished)

    def _get(self, index: int) -> Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = self._new_choice(index)
        return choice

    def _new_choice(self, index: int) -> Choice:
        return Choice(index)

    def _took(self, choice: Choice, text: str) -> None:
        choice.seen = True
        choice.text.append(text)
        self._chars += len(text)

    async def keep(self, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def opening(self, first: RequestOutput) -> list[str]:
        return []

    async def closing(self, last: RequestOutput) -> list[str]:
        if not self.include_usage:
            return [DONE]
        return [sse(self._envelope([], self._usage(last.usage))), DONE]

    def failure(self, error: Exception) -> list[str]:
        return [sse(to_api_error(error).body())]

    def _usage_so_far(self, out: RequestOutput) -> Usage | None:
        return self._usage(out.usage) if self.continuous_usage else None

    def _envelope(self, choices: list[Any], usage: Usage | None) -> dict[str, Any]:
        """A stream chunk around `choices`."""
        raise NotImplementedError
