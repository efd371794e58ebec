"""PromptBuilder: chat templating and tokenisation in the ingress, so prompt lengths are known up front."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from app.errors import InvalidParameter
from app.schemas.openai import ChatMessage


class PromptBuilder:
    def __init__(self, model_dir: Path) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)

    def chat(self, messages: list[ChatMessage]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidParameter("This model has no chat template; use /v1/completions.", param="messages")
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert isinstance(ids, list)
        return [int(i) for i in ids]  # type: ignore[arg-type]

    def completion(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not prompt:
            raise InvalidParameter("prompt must not be empty", param="prompt")
        ids: list[int] = self.tokenizer(prompt)["input_ids"]
        return [int(i) for i in ids]
