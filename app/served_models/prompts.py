"""PromptBuilder: chat templating and tokenisation in the ingress, so prompt lengths are known up front."""

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.errors import InvalidParameter
from app.schemas.openai import ChatMessage
from app.served_models.chat_format import THINK_BEGIN, ChatFormat, ToolFormat, template_text
from app.served_models.token_texts import TokenTexts


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    opened: bool  # the rendered prompt ends inside an opened <think>: the output starts as reasoning


def _arguments(text: str) -> Any:
    """A past call's arguments as the template wants them: a JSON object, or the text as sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _conversation(
    messages: list[ChatMessage], tools: list[dict[str, Any]] | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    conversation: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
        if fmt.listed and m.tool_calls:  # Phi-4-mini's template renders no tool_calls: past calls as written
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls
            ]
            turn["content"] = (m.text() or "") + fmt.begin + json.dumps(calls, ensure_ascii=False) + fmt.end
        if m.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        conversation.append(turn)
    if fmt.listed and tools:  # Phi-4-mini's template reads the tools from the system message's `tools`
        if not conversation or conversation[0]["role"] != "system":
            conversation.insert(0, {"role": "system", "content": ""})
        conversation[0]["tools"] = json.dumps(tools, ensure_ascii=False)
    return conversation


class PromptBuilder:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)

    @cached_property
    def tokens(self) -> TokenTexts:
        """Token strings and bytes, for logprobs."""
        return TokenTexts(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """Token ids this tokenizer knows: 0 .. vocab_size - 1."""
        return len(self.tokenizer)

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders `tools` (one that ignores them would silently drop them)."""
        template = template_text(self.tokenizer.chat_template)
        return template is not None and "tools" in template

    @cached_property
    def format(self) -> ChatFormat:
        """Whether the model thinks, and its tool-call format, from its chat template."""
        return ChatFormat.of(template_text(self.tokenizer.chat_template))

    def chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.chat_prompt(messages, tools).ids

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        thinking: bool | None = None,
    ) -> ChatPrompt:
        """The templated prompt; `thinking` is passed as `enable_thinking` (None: the template's default)."""
        if not self.tokenizer.chat_template:
            raise InvalidParameter("This model has no chat template; use /v1/completions.", param="messages")
        if tools and not self.supports_tools:
            raise InvalidParameter("This model's chat template does not support tools.", param="tools")
        try:
            extra: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
            text = self.tokenizer.apply_chat_template(
                _conversation(messages, tools, self.format.tools),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=False,
                **extra,
            )
        except TemplateError as error:  # a template that refuses this conversation (raise_exception)
            message = f"This model's chat template refused the messages: {error}"
            raise InvalidParameter(message, param="messages") from None
        except RecursionError:  # JSON nested past what the decoder or the template's rendering goes
            message = (
                "The messages nest too deeply to render (a tool call's arguments, or a tool's parameters)."
            )
            raise InvalidParameter(message, param="messages") from None
        assert isinstance(text, str)
        return ChatPrompt(self._encode(text), text.rstrip().endswith(THINK_BEGIN))

    def _encode(self, text: str) -> list[int]:
        """A rendered chat's ids, no special tokens added (what `apply_chat_template(tokenize=True)` gives).
        A fast tokenizer with no truncation or padding set is asked directly: `encode`, not the wrapper's
        `encode_batch` of one (~0.1 ms less a request, and no batch worker pool woken)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if isinstance(backend, Tokenizer) and backend.truncation is None and backend.padding is None:
            return list(backend.encode(text, add_special_tokens=False).ids)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def count(self, texts: list[str]) -> list[int]:
        """Tokens of each text alone (no special tokens): what a text adds to a templated prompt, near enough
        for arithmetic (Responses truncation counts each turn once with it)."""
        if not texts:
            return []
        ids: list[list[int]] = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(i) for i in ids]

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not prompt:
            raise InvalidParameter("prompt must not be empty", param="prompt")
        ids: list[int] = self.tokenizer(prompt)["input_ids"]
        return [int(i) for i in ids]

    def completions(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        return [self.completion(p) for p in prompts]

    def decode(self, ids: list[int]) -> str:
        """Token ids as text (an echoed prompt that was sent as ids)."""
        known = [i for i in ids if i < self.vocab_size]  # the engine refuses the others
        return str(self.tokenizer.decode(known, skip_special_tokens=False))
