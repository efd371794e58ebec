"""PromptBuilder: chat templating and tokenisation in the ingress, so prompt lengths are known up front."""

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.errors import InvalidParameter
from app.schemas.openai import ChatMessage
from app.served_models.token_texts import TokenTexts


def _arguments(text: str) -> Any:
    """A past call's arguments as the template wants them: a JSON object, or the text as sent."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    conversation: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
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
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the tool_use one, or the default
            template = template.get("tool_use") or template.get("default")
        return isinstance(template, str) and "tools" in template

    def chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidParameter("This model has no chat template; use /v1/completions.", param="messages")
        if tools and not self.supports_tools:
            raise InvalidParameter("This model's chat template does not support tools.", param="tools")
        try:
            ids = self.tokenizer.apply_chat_template(
                _conversation(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        except TemplateError as error:  # a template that refuses this conversation (raise_exception)
            message = f"This model's chat template refused the messages: {error}"
            raise InvalidParameter(message, param="messages") from None
        except RecursionError:  # JSON nested past what the decoder or the template's rendering goes
            message = (
                "The messages nest too deeply to render (a tool call's arguments, or a tool's parameters)."
            )
            raise InvalidParameter(message, param="messages") from None
        assert isinstance(ids, list)
        return [int(i) for i in ids]  # type: ignore[arg-type]

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
