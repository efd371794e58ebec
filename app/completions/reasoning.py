"""Reasoning: a thinking model's output split into its reasoning and its answer, as vLLM's qwen3 and
deepseek_r1 reasoning parsers split it.

The text between `<think>` and `</think>` is reasoning, the rest content. Where the chat template already
opened `<think>` in the prompt (`opened`: DeepSeek-R1, Qwen3-Thinking-2507), the output is reasoning from its
first character until `</think>`. Otherwise only a `<think>` that starts the output (after blanks) opens
reasoning: an answer that mentions the tag later is content, as written. Reasoning that never closes (the
output cut by max_tokens) is all reasoning, with no content. Blanks around either part are trimmed (Qwen3
writes `<think>\\n...\\n</think>\\n\\n` around its parts).

`ReasoningStream` reads the output as it streams, in one left-to-right pass: a `<think>` repeated inside
the reasoning is reasoning text, and only the few characters that could start a tag are held back, so no
piece of a tag leaks out as text.
"""

from dataclasses import dataclass, field
from typing import Literal

from app.completions.tool_calls import held_prefix
from app.errors import InvalidParameter
from app.schemas.openai import ChatCompletionRequest
from app.served_models.chat_format import THINK_BEGIN, THINK_END

State = Literal["start", "reasoning", "content"]


@dataclass
class _Trimmed:
    """A streamed text less its leading and trailing blanks: blanks are held until text follows them."""

    _started: bool = False
    _blank: list[str] = field(default_factory=list)

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        core = text.rstrip()
        if not core:
            self._blank.append(text)
            return ""
        out = "".join(self._blank) + core
        self._blank = [text[len(core) :]]
        return out


@dataclass
class ReasoningStream:
    """Incremental split: feed text as it streams, get (reasoning, content) pieces to send. `reasoned` says
    whether the last feed's text was (partly) reasoning or its tags; `tokens` counts the reasoning tokens of
    the outputs taken (`take`)."""

    opened: bool = False  # the prompt opened <think>: the output starts inside reasoning
    state: State = field(init=False)
    reasoned: bool = False
    tokens: int = 0
    _held: str = ""  # what could be the start of the tag looked for, held back
    _reasoning: _Trimmed = field(default_factory=_Trimmed)
    _content: _Trimmed = field(default_factory=_Trimmed)

    def __post_init__(self) -> None:
        self.state = "reasoning" if self.opened else "start"

    def feed(self, text: str) -> tuple[str, str]:
        self.reasoned = self.state == "reasoning"
        reasoning, content = [], []
        text, self._held = self._held + text, ""
        if self.state == "start":
            rest = text.lstrip()
            if rest.startswith(THINK_BEGIN):
                self.state, self.reasoned, text = "reasoning", True, rest[len(THINK_BEGIN) :]
            elif THINK_BEGIN.startswith(rest):  # blanks (dropped: both parts are trimmed), or the tag's start
                self._held = rest
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            close = text.find(THINK_END)
            if close < 0:
                keep = held_prefix(text, THINK_END)
                reasoning.append(self._reasoning.push(text[: len(text) - keep]))
                self._held = text[len(text) - keep :]
                text = ""
            else:
                reasoning.append(self._reasoning.push(text[:close]))
                self.state, text = "content", text[close + len(THINK_END) :]
        content.append(self._content.push(text))
        return "".join(reasoning), "".join(content)

    def take(self, text: str, steps: list[tuple[int, int]], ends: bool) -> tuple[str, str]:
        """One engine output: its text split, and the tokens of each of its steps ((end in `text`, tokens):
        RequestOutput.steps, one for a streamed output, one a token for a whole one) counted as reasoning
        if any of that step's text was (a step is one token but where the detokenizer held text back: the
        closing step's content tokens, if any, count with it), and all released when it `ends` the output."""
        parts: list[str] = []
        contents: list[str] = []
        start = 0
        for end, tokens in steps:
            part, more = self.feed(text[start:end])
            start = end
            parts.append(part)
            contents.append(more)
            if self.reasoned:
                self.tokens += tokens
        reasoning, content = "".join(parts), "".join(contents)
        if ends:
            more_reasoning, more_content = self.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: a held partial tag is text after all (reasoning's, or content's)."""
        held, self._held = self._held, ""
        if self.state == "reasoning":
            return self._reasoning.push(held), ""
        return "", self._content.push(held)


def split(text: str, opened: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for a part that is empty."""
    stream = ReasoningStream(opened)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


def thinking_switch(body: ChatCompletionRequest, thinks: bool, constrained: bool) -> bool | None:
    """`enable_thinking` for the template, from the request's chat_template_kwargs and reasoning_effort:
    None leaves the template's default. A model whose template does not think refuses a request to think
    (400 naming the field). A grammar over the whole output (response_format, a required or named tool
    call: `constrained`) leaves no room to think: thinking is then off, and asking for it is a 400."""
    kwargs = body.chat_template_kwargs
    enable = kwargs.enable_thinking if kwargs is not None else None
    effort = body.reasoning_effort
    wants = None if effort is None else effort != "none"
    if enable is not None and wants is not None and enable != wants:
        message = f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking {enable}"
        raise InvalidParameter(message, param="reasoning_effort")
    asked = enable if enable is not None else wants
    param = "chat_template_kwargs" if enable is not None else "reasoning_effort"
    if not thinks:
        if asked:
            message = (
                f"{param}: this model does not reason (its chat template has no thinking); leave "
                f"{param} out or turn thinking off"
            )
            raise InvalidParameter(message, param=param)
        return None
    if constrained:
        if asked:
            message = (
                f"{param}: thinking cannot be combined with response_format or a required tool call, "
                "whose grammar constrains the whole output; turn thinking off or drop the format"
            )
            raise InvalidParameter(message, param=param)
        return False
    return asked
