"""Load a HuggingFace causal LM once, resident, in the configured precision, and wrap it for multi-LoRA.

transformers owns architectures, weights and quantized linears (bitsandbytes nf4/int8, AWQ through
gptqmodel on the CPU); we only swap in our paged attention by name and wrap the LoRA target linears
afterwards. AWQ on CUDA, or without gptqmodel, loads through awq_loader.py (our int4 linear).
"""

import importlib.util
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from deployments.engine.config import EngineConfig
from deployments.engine.model.attention import register_paged_attention
from deployments.engine.model.awq_loader import load_awq_model
from deployments.engine.model.lora_layers import LoRAContext, MultiLoRALinear, wrap_lora_modules

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    lora_modules: dict[str, MultiLoRALinear]  # module path (as in the unwrapped model) -> wrapper
    lora_context: LoRAContext
    device: torch.device
    dtype: torch.dtype  # activations, KV cache and LoRA slots
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    weights_bytes: int  # the base model's parameters and buffers, as resident
    lora_slot_bytes: int  # all adapter pages together
    lora_pages: int  # device adapter pages (the config's max_loras, or sized from lora_memory_mb)
    lora_page_rank: int  # rank units per page
    lora_run_pages: int  # the most pages one adapter spans (one of max_lora_rank)


def _quantization_config(config: EngineConfig, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    bnb = BitsAndBytesConfig  # untyped in transformers
    if config.quantization == "nf4":
        return bnb(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)  # type: ignore[no-untyped-call]
    if config.quantization == "int8":
        return bnb(load_in_8bit=True)  # type: ignore[no-untyped-call]
    return None  # "none", or "awq" whose quantization_config lives in the checkpoint's config.json


def _check_checkpoint(config: EngineConfig, hf_config: PretrainedConfig) -> None:
    quant = getattr(hf_config, "quantization_config", None)
    method = (
        (quant or {}).get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    )
    if config.quantization == "awq" and str(method).lower() != "awq":
        raise ValueError(
            f"quantization=awq but {config.model} is not an AWQ checkpoint (quant_method={method})"
        )
    if config.quantization != "awq" and method is not None:
        raise ValueError(f"{config.model} is pre-quantized ({method}); set quantization to match")


def check_rope(hf_config: PretrainedConfig) -> None:
    """Refuse RoPE variants that neither forward serves exactly in a batch: LongRoPE (Phi-3 128k, Phi-3.5,
    Phi-4-mini) picks short or long factors by the longest position in the forward call, so one long
    sequence would change every other sequence's rotary in the same step."""
    rope = getattr(hf_config.get_text_config(), "rope_parameters", None) or {}
    tables = [t for t in rope.values() if isinstance(t, dict)] or [rope]  # per layer type, or one
    if any(str(t.get("rope_type", t.get("type", ""))) in ("longrope", "su") for t in tables):
        raise ValueError(
            "LongRoPE (rope_scaling type 'longrope') is not served: LongRoPE switches its factors with the "
            "sequence length, which a batch of sequences of different lengths cannot share"
        )


def _awq_ours(config: EngineConfig, device: torch.device) -> bool:
    """Our AWQ linear on CUDA (gptqmodel is absent from the GPU image and its kernels are not captured) or
    where gptqmodel is not installed; gptqmodel's CPU int4 kernel otherwise, unless the config names one."""
    if config.awq_kernel != "auto":
        return config.awq_kernel == "ours"
    return device.type == "cuda" or importlib.util.find_spec("gptqmodel") is None


def _eos_ids(tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig | None) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = None if generation is None else generation.eos_token_id
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(i) for i in eos)
    return frozenset(ids)


def pages_for_memory(model: nn.Module, config: EngineConfig, dtype: torch.dtype, page_rank: int) -> int:
    """How many adapter pages fit in lora_memory_mb: a page is page_rank x (in + out) per target; at least
    one adapter of max_lora_rank, at most 256 of them."""
    per_page = (
        sum(
            page_rank * (int(getattr(m, "in_features")) + int(getattr(m, "out_features")))  # noqa: B009
            for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in config.lora_target_modules
        )
        * dtype.itemsize
    )
    widest = -(-config.max_lora_rank // page_rank)
    pages = max(widest, min(256 * widest, config.lora_memory_mb * 2**20 // max(1, per_page)))
    log.info(
        "%d adapter pages of rank %d (%.2f MiB each) fit in lora_memory_mb=%d",
        pages,
        page_rank,
        per_page / 2**20,
        config.lora_memory_mb,
    )
    return pages


def load_model(config: EngineConfig) -> LoadedModel:
    device = config.torch_device()
    dtype, why = config.dtype_choice()
    log.info("compute dtype %s (%s)", dtype, why)
    hf_config = AutoConfig.from_pretrained(config.model)
    _check_checkpoint(config, hf_config)
    check_rope(hf_config)
    quantization = _quantization_config(config, dtype)
    # Passing quantization_config=None would override (drop) an AWQ checkpoint's own config.
    extra = {} if quantization is None else {"quantization_config": quantization}
    model: PreTrainedModel
    if config.quantization == "awq" and _awq_ours(config, device):
        model = load_awq_model(
            config.model,
            dtype=dtype,
            device=device,
            attn_implementation=register_paged_attention(),
            fused_max_rows=config.awq_fused_max_rows,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(
            config.model,
            dtype=dtype,
            attn_implementation=register_paged_attention(),
            device_map={"": device},
            **extra,
        )
    model.eval().requires_grad_(False)  # type: ignore[no-untyped-call]
    weights_bytes = int(model.get_memory_footprint())  # type: ignore[no-untyped-call]

    page_rank = config.page_rank_for(device.type)
    if config.max_loras:
        lora_pages = config.max_loras * config.pages_per_adapter(device.type)
    else:
        lora_pages = pages_for_memory(model, config, dtype, page_rank)
    context = LoRAContext()
    lora_modules = wrap_lora_modules(
        model,
        targets=config.lora_target_modules,
        pages=lora_pages,
        page_rank=page_rank,
        dtype=dtype,
        device=device,
        context=context,
    )
    slot_bytes = sum(m.lora_a.nbytes + m.lora_b.nbytes for m in lora_modules.values())
    tokenizer = AutoTokenizer.from_pretrained(config.model)
    try:
        generation = GenerationConfig.from_pretrained(config.model)
    except OSError:
        generation = None

    text_config = hf_config.get_text_config()
    heads = int(text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    max_len = config.max_model_len or int(text_config.max_position_embeddings)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        lora_modules=lora_modules,
        lora_context=context,
        device=device,
        dtype=dtype,
        num_layers=int(text_config.num_hidden_layers),
        num_kv_heads=int(getattr(text_config, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab_size=len(tokenizer),
        max_model_len=max_len,
        eos_token_ids=_eos_ids(tokenizer, generation),
        weights_bytes=weights_bytes,
        lora_slot_bytes=slot_bytes,
        lora_pages=lora_pages,
        lora_page_rank=page_rank,
        lora_run_pages=config.pages_per_adapter(device.type),
    )
    log.info(
        "loaded %s (%s, %s on %s): weights %.1f MiB, %d LoRA modules x %d pages = %.1f MiB",
        config.model,
        config.quantization,
        dtype,
        device,
        weights_bytes / 2**20,
        len(lora_modules),
        lora_pages,
        slot_bytes / 2**20,
    )
    return loaded
