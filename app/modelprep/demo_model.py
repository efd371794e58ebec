"""Small random-init HF causal-LM model directories, built offline and deterministically from a seed.

Tests, benchmarks and the product demo need real architectures (Llama, Qwen2, Mistral, Phi-3, Qwen3, Gemma 3
text) with a real
tokenizer, without a model hub. This module trains a byte-level BPE tokenizer on a synthetic corpus,
initialises a model from a named shape preset and saves both into one directory, which the engine
then loads like any HF model dir (`AutoModelForCausalLM.from_pretrained(dir)`,
`AutoTokenizer.from_pretrained(dir)`).

CLI: `python -m app.modelprep.demo_model OUT_DIR [--arch llama] [--preset demo] [--seed 0]
[--dtype float32|bfloat16]`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Self, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# phi3: fused qkv_proj and gate_up_proj
Arch = Literal["llama", "qwen2", "mistral", "phi3", "qwen3", "gemma3_text"]
ARCHS: tuple[Arch, ...] = get_args(Arch)

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)  # ids 0..4, in this order
# ChatML, with tools in the Hermes/Qwen2.5 format. Given `tools`, a system block (the caller's system message
# first, if any) lists them as JSON, one per line, inside <tools></tools>, and asks for calls written as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>. An assistant message's tool_calls render that way
# (one per line, after its content), and a tool message (a call's result) is a `tool` turn holding
# <tool_response>...</tool_response>. Without tools, plain ChatML: <|im_start|>ROLE\nCONTENT<|im_end|>\n.
TOOLS_PROMPT = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOL_CALL_PROMPT = (
    "\\n</tools>\\n\\nFor each function call, return a JSON object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n"
    '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
)
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_PROMPT + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + TOOL_CALL_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"  # already in the tools block
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MARKER_FILE = "loraplex-build.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# transformers 5 ignores tokenizer.json's pipeline for Qwen2 dirs (Qwen2Tokenizer rebuilds it with this
# split regex), so every arch is trained with it: token ids then agree across the three archs.
_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS_LINES = 6000
_WORDS = """
the of and to in is was he for it with as his on be at by had are but from or have an they which one you
were her all she there would their we him been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our over
man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work long
get here between both life being under never day same another know while last might us great old year off
come since against go came right used take three small large house water light night city road river tree
stone fire wind cloud rain snow garden window door table chair paper book letter story song music voice word
name number answer question reason idea plan problem model token adapter request batch server queue memory
cache layer weight matrix vector tensor kernel thread worker engine client system data file code test value
result error index order price market bank money trade
open close start stop send read write load save build run find keep give tell ask call show move turn follow
learn change grow carry bring hold begin happen walk speak listen watch wait leave stay serve share check
quick slow bright dark warm cold early late happy quiet simple clear strong soft hard green blue red white
black golden ancient modern public private local remote random
"""
_UNICODE_SNIPPETS = (
    "café naïve résumé façade jalapeño crème brûlée",
    "über Straße Grüße schön Ärger",
    "東京 北京 中文 日本語 你好 世界 学习 模型",
    "こんにちは ありがとう カタカナ",
    "Привет мир Ελληνικά 안녕하세요",
    "😀 🚀 🎉 ❤️ 👍🏽 🇫🇷 🍕 ✨ 🔥",
)


class ModelShape(BaseModel):
    """Architecture-independent size of a decoder-only transformer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(gt=0, description="Width of the residual stream.")
    intermediate_size: int = Field(gt=0, description="Width of the SwiGLU MLP; a multiple of 64.")
    num_hidden_layers: int = Field(gt=0, description="Number of decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads per layer.")
    num_key_value_heads: int = Field(
        gt=0, description="Key/value heads per layer (GQA); divides the query heads."
    )
    head_dim: int | None = Field(default=None, gt=0, description="Per-head width; None: hidden / heads.")
    vocab_size: int = Field(
        gt=0,
        description="Embedding rows; at least the tokenizer's size, larger rows are never produced by it.",
    )
    max_position_embeddings: int = Field(gt=0, description="Longest sequence the model supports.")
    sliding_window: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Attention window: Mistral and Phi-3 always, Qwen2 if qwen2_use_sliding_window, Qwen3 in its"
            " second half of layers, Gemma 3 in every other layer, Llama never."
        ),
    )
    qwen2_use_sliding_window: bool = Field(
        default=False,
        description="Qwen2 only: apply sliding_window in every layer (HF's use_sliding_window).",
    )
    tie_word_embeddings: bool = Field(
        default=False,
        description="Share embedding and LM head; presets untie: random tied models tend to repeat a token.",
    )
    initializer_range: float = Field(
        default=0.1,
        gt=0,
        description="Std of the normal init; larger than HF's 0.02 so that greedy top-1 margins are clear.",
    )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _check_divisibility(self) -> Self:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads when head_dim is None")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.resolved_head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings)")
        if self.intermediate_size % 64:
            raise ValueError("intermediate_size must be a multiple of 64")
        # bitsandbytes 4-bit on CPU needs every quantized Linear's output width divisible by 32.
        widths = {
            "q_proj": self.num_attention_heads * self.resolved_head_dim,
            "k_proj/v_proj": self.num_key_value_heads * self.resolved_head_dim,
            "o_proj/down_proj": self.hidden_size,
            "gate_proj/up_proj": self.intermediate_size,
            "lm_head": self.vocab_size,
        }
        if bad := {name: width for name, width in widths.items() if width % 32}:
            raise ValueError(f"output widths must be multiples of 32, got {bad}")
        return self


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=1024,
        sliding_window=64,  # short so that tests can exceed it
    ),
    "demo": ModelShape(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=2048,
        sliding_window=512,
    ),
    "bench-150m": ModelShape(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
        sliding_window=1024,
    ),
    # bench-1b's 22 layers at hidden 64: a step's per-layer host cost with nearly no compute
    # (bench/host_overhead.py).
    "narrow-22": ModelShape(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=22,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=1024,
        sliding_window=64,
    ),
    # TinyLlama-1.1B's shape: the GPU benches' larger model (random init, built where it runs).
    "bench-1b": ModelShape(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
        sliding_window=1024,
    ),
}


# --------------------------------------------------------------------------------------------- tokenizer


def _sentence(rng: random.Random, words: Sequence[str]) -> str:
    text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 16)))
    if rng.random() < 0.2:
        text += f" {rng.randint(0, 10 ** rng.randint(1, 6))}"
    return text.capitalize() + rng.choice(".,!?:;")


def _code_line(rng: random.Random, words: Sequence[str]) -> str:
    # Identifiers give BPE enough distinct pairs to fill the vocabulary from a small word list.
    a, b, c = (rng.choice(words) for _ in range(3))
    return f"{a}_{b} = {c}{b.capitalize()}({a}, {rng.randint(0, 999)})  # {rng.choice(words)}"


def _unicode_line(rng: random.Random, words: Sequence[str]) -> str:
    snippet = rng.choice(_UNICODE_SNIPPETS).split()
    mixed = [
        rng.choice(snippet) if rng.random() < 0.5 else rng.choice(words) for _ in range(rng.randint(3, 10))
    ]
    return " ".join(mixed)


def synthetic_corpus(seed: int, lines: int = _CORPUS_LINES) -> Iterator[str]:
    """Deterministic mix of English-like sentences, code-like lines and multilingual/emoji lines."""
    rng = random.Random(seed)
    words = _WORDS.split()
    for _ in range(lines):
        kind = rng.random()
        if kind < 0.7:
            yield _sentence(rng, words)
        elif kind < 0.9:
            yield _code_line(rng, words)
        else:
            yield _unicode_line(rng, words)


def _train_backend(vocab_size: int, corpus: Iterable[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())  # no unk token: all 256 bytes are in the vocabulary
    # No normalizer and no prefix space, so decode(encode(s)) == s for any string.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # No implicit BOS (ChatML adds none either): callers add it explicitly, so token counts stay predictable.
    tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_tokenizer(out_dir: Path, *, vocab_size: int = 2048, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with ChatML special tokens and save it into `out_dir`."""
    return train_tokenizer(out_dir, synthetic_corpus(seed), vocab_size=vocab_size)


def train_tokenizer(
    out_dir: Path, corpus: Iterable[str], *, vocab_size: int = 2048
) -> PreTrainedTokenizerFast:
    """`build_tokenizer` on a given corpus (the trained demo's chat text)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # unannotated __init__
        tokenizer_object=_train_backend(vocab_size, corpus),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,  # written explicitly: otherwise Qwen2Tokenizer adds its own <|endoftext|> unk
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # True would turn "a ." into "a." on decode
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_jinja_files=False: keep the template inside tokenizer_config.json (v5 writes chat_template.jinja).
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    return tokenizer


# ------------------------------------------------------------------------------------------------- model


def _arch_config(arch: Arch, shape: ModelShape, common: dict[str, Any]) -> PreTrainedConfig:
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=shape.sliding_window)
    if arch == "qwen2":
        return Qwen2Config(
            **common,
            use_sliding_window=shape.qwen2_use_sliding_window and shape.sliding_window is not None,
            sliding_window=shape.sliding_window,
            max_window_layers=0,  # layers >= max_window_layers slide: all of them, as in Mistral
        )
    if arch == "phi3":  # Phi-3 mini 4k's kind: one window in every layer, default RoPE
        return Phi3Config(**common, sliding_window=shape.sliding_window)
    if arch == "qwen3":
        # The second half of the layers slide (per layer_types), so that a forward must window per layer.
        return Qwen3Config(
            **common,
            use_sliding_window=shape.sliding_window is not None,
            sliding_window=shape.sliding_window,
            max_window_layers=shape.num_hidden_layers // 2,
        )
    if arch == "gemma3_text":
        head_dim = shape.resolved_head_dim
        return Gemma3TextConfig(
            **common,
            # Local (sliding, rope theta 1e4) and global (1e6) layers alternate, local first.
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(shape.num_hidden_layers)
            ],
            sliding_window=shape.sliding_window or shape.max_position_embeddings,
            query_pre_attn_scalar=2 * head_dim,  # not head_dim: a forward that scales by head_dim shows
            final_logit_softcapping=30.0,  # Gemma 2's cap (Gemma 3 ships None): the capped path is tested
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _model_config(arch: Arch, shape: ModelShape, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    common: dict[str, Any] = {
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.resolved_head_dim,  # undeclared in Qwen2Config, but Qwen2's modeling reads it
        "max_position_embeddings": shape.max_position_embeddings,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "initializer_range": shape.initializer_range,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    return _arch_config(arch, shape, common)


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    # One tokenizer eos (</s>), but chat turns end with <|im_end|>: generation stops on either.
    return GenerationConfig.from_dict(
        {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
            "pad_token_id": tokenizer.pad_token_id,
        }
    )


def _perturb_unit_params(model: PreTrainedModel, std: float) -> None:
    # HF zero-inits biases and sets RMSNorm weights to 1; random values make an implementation that drops
    # Qwen2's q/k/v biases or a norm weight produce visibly different logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, std)
            elif param.ndim == 1:
                param.normal_(1.0, 0.1)


def _init_model(
    arch: Arch, shape: ModelShape, tokenizer: PreTrainedTokenizerFast, seed: int
) -> PreTrainedModel:
    config = _model_config(arch, shape, tokenizer)
    model_class = {
        "llama": LlamaForCausalLM,
        "qwen2": Qwen2ForCausalLM,
        "mistral": MistralForCausalLM,
        "phi3": Phi3ForCausalLM,
        "qwen3": Qwen3ForCausalLM,
        "gemma3_text": Gemma3ForCausalLM,
    }[arch]
    with torch.random.fork_rng(devices=[]):  # seeded init without disturbing the caller's global RNG
        torch.manual_seed(seed)
        model: PreTrainedModel = model_class(config)
        _perturb_unit_params(model, shape.initializer_range)
    model.generation_config = _generation_config(tokenizer)
    return model


def _place_tokenizer(out_dir: Path, tokenizer_dir: Path | None, seed: int) -> PreTrainedTokenizerFast:
    if tokenizer_dir is None:
        return build_tokenizer(out_dir, seed=seed)
    if tokenizer_dir.resolve() != out_dir.resolve():
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    loaded: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(out_dir)
    return loaded


def resolve_shape(preset: str | ModelShape) -> ModelShape:
    """A preset by name, or a validated copy of a given shape."""
    if isinstance(preset, ModelShape):
        return ModelShape.model_validate(preset.model_dump())  # model_copy(update=...) skips validation
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[preset]


def _build_record(
    arch: Arch, shape: ModelShape, seed: int, dtype: torch.dtype, tokenizer_dir: Path | None
) -> dict[str, Any]:
    return {
        "format": 1,
        # A changed template rebuilds existing dirs (tokenizer_config.json holds it).
        "chat_template": hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16],
        "arch": arch,
        "shape": shape.model_dump(),
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        "tokenizer_dir": None if tokenizer_dir is None else str(tokenizer_dir),
    }


def build_model(
    out_dir: Path,
    *,
    arch: Arch = "llama",
    preset: str | ModelShape = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Build a random-init model dir: config, generation config, safetensors weights, tokenizer, marker.

    The tokenizer is trained into `out_dir` with the same seed, or copied from `tokenizer_dir`.
    """
    shape = resolve_shape(preset)
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / MARKER_FILE
    marker.unlink(missing_ok=True)  # an interrupted rebuild must not look complete
    tokenizer = _place_tokenizer(out_dir, tokenizer_dir, seed)
    if len(tokenizer) > shape.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the shape's vocab_size is {shape.vocab_size}"
        )
    model = _init_model(arch, shape, tokenizer, seed)
    module: torch.nn.Module = model  # typed view: mypy cannot see through PreTrainedModel.to's decorator
    module.to(dtype)  # after a float32 init, so a bfloat16 build is the rounded float32 one
    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors (safe_serialization is gone)
    for weights in out_dir.glob("*.safetensors"):
        weights.chmod(0o644)  # safetensors 0.8 creates files 0600; other users/containers must read them
    record = _build_record(arch, shape, seed, dtype, tokenizer_dir)
    marker.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out_dir


def ensure_model(
    out_dir: Path,
    *,
    arch: Arch = "llama",
    preset: str | ModelShape = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: Path | None = None,
) -> Path:
    """`build_model` unless `out_dir` already holds a complete build with the same arguments.

    A file lock inside `out_dir` makes concurrent callers (test workers, replicas) build it once.
    """
    expected = _build_record(arch, resolve_shape(preset), seed, dtype, tokenizer_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / ".loraplex-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_marker(out_dir) != expected:
            build_model(
                out_dir, arch=arch, preset=preset, seed=seed, dtype=dtype, tokenizer_dir=tokenizer_dir
            )
    return out_dir


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((out_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record


def count_parameters(model_dir: Path) -> int:
    """Stored parameters (a tied LM head counts once), read from the safetensors headers only."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as weights:
            for key in weights.keys():  # noqa: SIM118 - safe_open is not iterable
                total += math.prod(weights.get_slice(key).get_shape())
    return total


# --------------------------------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out_dir = build_model(
        args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=DTYPES[args.dtype]
    )
    print(out_dir)
    print(f"parameters: {count_parameters(out_dir):,} (built in {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
