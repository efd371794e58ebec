"""HF PEFT as the reference: greedy generation with one adapter at a time (or the plain model)."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel


class PeftReference:
    """One base model with every adapter loaded by PEFT; `greedy` switches adapter per request."""

    def __init__(
        self,
        model_dir: Path,
        adapter_dirs: dict[str, Path],
        *,
        dtype: torch.dtype = torch.float32,
        base: PreTrainedModel | None = None,
    ):
        if base is None:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        names = list(adapter_dirs)
        self.model = PeftModel.from_pretrained(
            base, adapter_dirs[names[0]], adapter_name=names[0], autocast_adapter_dtype=False
        )
        for name in names[1:]:
            self.model.load_adapter(adapter_dirs[name], adapter_name=name, autocast_adapter_dtype=False)
        self.model.eval()

    @torch.inference_mode()
    def greedy(self, prompt: Sequence[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([list(prompt)])
        kwargs = {
            "max_new_tokens": max_new_tokens,
            "do_sample": False,
            "attention_mask": torch.ones_like(ids),
        }
        # PEFT's generate is unannotated; without return_dict_in_generate it returns the token ids.
        generate = cast(Callable[..., torch.Tensor], self.model.generate)
        if adapter is None:
            with self.model.disable_adapter():
                out = generate(input_ids=ids, **kwargs)
        else:
            self.model.set_adapter(adapter)
            out = generate(input_ids=ids, **kwargs)
        return [int(t) for t in out[0, ids.shape[1] :]]

    @torch.inference_mode()
    def last_logits(self, prompt: Sequence[int], adapter: str | None) -> torch.Tensor:
        ids = torch.tensor([list(prompt)])
        if adapter is None:
            with self.model.disable_adapter():
                return self._logits(ids)[0, -1].float()
        self.model.set_adapter(adapter)
        return self._logits(ids)[0, -1].float()

    @torch.inference_mode()
    def all_logits(self, ids: Sequence[int], adapter: str | None) -> torch.Tensor:
        """[len(ids), V] logits of one teacher-forced forward."""
        batch = torch.tensor([list(ids)])
        if adapter is None:
            with self.model.disable_adapter():
                return self._logits(batch)[0].float()
        self.model.set_adapter(adapter)
        return self._logits(batch)[0].float()

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[1, len, V] logits of the active adapter (or the plain model) for a [1, len] batch."""
        logits: torch.Tensor = self.model(input_ids=ids).logits
        return logits
