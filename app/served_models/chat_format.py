"""ChatFormat: what a model's chat template says about its output, read once from the template's text.

Whether the model thinks: its template handles `<think>` or takes `enable_thinking` (Qwen3, QwQ,
DeepSeek-R1 distills), so reasoning parameters mean something for it and its output is split into
reasoning and content (app/completions/reasoning.py). How it writes tool calls: Phi-4-mini's template lists
tools between `<|tool|>` and `<|/tool|>` and the model answers `<|tool_call|>[...]<|/tool_call|>`; every
other template gets the Hermes/Qwen `<tool_call>` format (Qwen2.5, Qwen3, Llama fine-tunes in ChatML, and
Gemma 3, which has no tool-call tokens of its own: docs/decisions.md).
"""

from dataclasses import dataclass
from typing import Any

THINK_BEGIN, THINK_END = "<think>", "</think>"
PHI4_MARKERS = ("<|tool_call|>", "<|tool|>")


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes its calls: each block is `begin` + JSON + `end`; the JSON is one call, or with
    `listed` a JSON list of calls (the grammar writes one call a list, its brackets part of the block)."""

    name: str
    begin: str
    end: str
    listed: bool = False

    @property
    def grammar_begin(self) -> str:
        return self.begin + "[" if self.listed else self.begin

    @property
    def grammar_end(self) -> str:
        return "]" + self.end if self.listed else self.end


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
PHI4 = ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", listed=True)


def template_text(template: Any) -> str | None:
    """A tokenizer's chat template as text: named templates give their tool_use one, or the default."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


@dataclass(frozen=True)
class ChatFormat:
    thinks: bool  # the template renders thinking: reasoning is parsed and can be switched
    tools: ToolFormat  # how the model writes its tool calls

    @classmethod
    def of(cls, template: str | None) -> "ChatFormat":
        text = template or ""
        thinks = "enable_thinking" in text or THINK_BEGIN in text
        tools = PHI4 if any(marker in text for marker in PHI4_MARKERS) else HERMES
        return cls(thinks, tools)
