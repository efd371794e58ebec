"""Tiny models with other families' chat templates: a Qwen3-style thinking template, and Phi-4-mini's tools.

`build_thinker` makes a Llama-architecture model whose weights are set (not trained) so that greedy
decoding is a fixed chain of tokens: every layer's output projections are zero, so the last hidden state is
the current token's embedding; each chain token's embedding is a unit vector of its own, and the LM head
row of its successor points along it. From a prompt's last token (the generation prompt's newline) it
writes `<think> plan first</think> answer` and ends, whatever the prompt (the template's empty thinking
block with thinking off included). `<think>` and `</think>` are added (non-special) tokens, as in Qwen3's
tokenizer.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from app.modelprep.demo_model import CHAT_TEMPLATE, IM_END, PRESETS, ModelShape, build_model, build_tokenizer

THINK_TOKENS = ("<think>", "</think>")
WORDS = (" plan", " first", " answer")  # single tokens of the demo tokenizer
GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
# Qwen3's own ending: with enable_thinking false, an empty thinking block opens the answer.
QWEN3_GENERATION_PROMPT = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
QWEN3_TEMPLATE = CHAT_TEMPLATE.replace(GENERATION_PROMPT, QWEN3_GENERATION_PROMPT)
# DeepSeek-R1 / Qwen3-Thinking-2507: the template opens the thinking block itself.
OPENING_TEMPLATE = CHAT_TEMPLATE.replace(
    GENERATION_PROMPT,
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}",
)
# Phi-4-mini-instruct's shape: tools as JSON text in the system message's `tools`, between <|tool|> tags.
PHI4_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{- '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{%- else %}{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


def with_template(tokenizer_dir: Path, template: str) -> None:
    """Rewrite a saved tokenizer's chat template in place."""
    path = tokenizer_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


def build_thinker(root: Path) -> Path:
    assert QWEN3_TEMPLATE != CHAT_TEMPLATE and OPENING_TEMPLATE != CHAT_TEMPLATE
    tokenizer_dir = root / "tokenizer"
    tokenizer = build_tokenizer(tokenizer_dir)
    tokenizer.add_tokens(list(THINK_TOKENS))
    tokenizer.chat_template = QWEN3_TEMPLATE
    tokenizer.save_pretrained(tokenizer_dir, save_jinja_files=False)
    shape = ModelShape(**{**PRESETS["tiny"].model_dump(), "vocab_size": 2080, "sliding_window": None})
    model_dir = build_model(root / "model", preset=shape, tokenizer_dir=tokenizer_dir)
    _chain(model_dir, PreTrainedTokenizerFast.from_pretrained(model_dir))
    return model_dir


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return int(ids[0])


def _prompt_end(tokenizer: PreTrainedTokenizerFast, thinking: bool) -> int:
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
    )
    assert isinstance(text, str)
    return int(tokenizer(text, add_special_tokens=False)["input_ids"][-1])


def _chain(model_dir: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    think, end_think = (_ids(tokenizer, t) for t in THINK_TOKENS)
    plan, first, answer = (_ids(tokenizer, w) for w in WORDS)
    stop = _ids(tokenizer, IM_END)
    start = _prompt_end(tokenizer, True)
    assert _prompt_end(tokenizer, False) == start  # both end in a newline: the same chain follows
    successor = {start: think, think: plan, plan: first, first: end_think, end_think: answer, answer: stop}
    assert len(successor) == 6, "the prompt's last token and the chain must be distinct tokens"
    (weights_path,) = model_dir.glob("*.safetensors")
    weights = load_file(weights_path)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()  # every layer adds nothing: the last hidden state is the token's embedding
    weights["model.norm.weight"].fill_(1.0)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    head.zero_()
    for slot, (source, target) in enumerate(successor.items()):
        embed[source] = 0.0
        embed[source, slot] = 1.0
        head[target, slot] = 10.0
    save_file({k: v.contiguous() for k, v in weights.items()}, str(weights_path), metadata={"format": "pt"})
    assert torch.equal(load_file(weights_path)["lm_head.weight"], head)
