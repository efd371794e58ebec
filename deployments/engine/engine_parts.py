"""What an LLMEngine is made of, and how much memory each part takes: `build_engine_parts` builds its
collaborators from the config and the loaded model, sized by one `MemoryPlan`; `EngineCounters` are the
counts the engine keeps while it runs (its stats' raw material)."""

import logging
from dataclasses import dataclass

import torch

from adapters.registered_digest import DigestSource
from adapters.store import AdapterStore
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.config import EngineConfig
from deployments.engine.grammar.grammars import Grammars
from deployments.engine.logits_processor import LogitsProcessor
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.lora_kernels import select_kernel
from deployments.engine.model.model_loader import LoadedModel
from deployments.engine.model.model_runner import ModelRunner
from deployments.engine.output_assembler import OutputAssembler
from deployments.engine.sampler import Sampler
from deployments.engine.scheduler import Scheduler
from deployments.engine.sequence_builder import SequenceBuilder

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineCounters:
    busy_seconds: float = 0.0
    step_seconds: float = 0.0  # whole steps, plan to outputs: what a neighbour's next token waits for
    steps: int = 0
    last_step_tokens: int = 0
    adapter_requests: int = 0
    adapter_arrival_hits: int = 0
    aborts: int = 0  # requests stopped by abort() while still running or waiting
    prefill_tokens: int = 0  # prompt tokens run through the model (prefix-cache hits are not)


@dataclass(slots=True)
class MemoryPlan:
    """The sizes the engine is built to. `bytes`: where the memory goes, what the operator sizes with
    kv_cache_memory_mb, lora_memory_mb and prompt_logprobs_memory_mb, plus what the engine adds itself
    (step buffers, captured decode graphs); filled in once the parts that take it exist."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    prompt_logprob_row_bytes: int
    prompt_logprob_rows: int
    bytes: dict[str, int]

    @classmethod
    def for_model(cls, config: EngineConfig, m: LoadedModel) -> "MemoryPlan":
        num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
            config.kv_cache_memory_mb * 2**20,
            num_layers=m.num_layers,
            block_size=config.block_size,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
        )
        vocab_size = int(m.model.config.get_text_config().vocab_size)
        # Logits rows at prompt positions (echo): float32 logits and their log-softmax, vocab-wide each.
        row_bytes = vocab_size * 2 * torch.float32.itemsize
        rows = min(
            config.max_num_batched_tokens,
            config.max_prompt_logprob_rows or max(1, config.prompt_logprobs_memory_mb * 2**20 // row_bytes),
        )
        max_model_len = min(m.max_model_len, num_blocks * config.block_size)
        return cls(num_blocks, max_model_len, vocab_size, row_bytes, rows, {})


@dataclass(slots=True)
class EngineParts:
    loaded: LoadedModel
    memory: MemoryPlan
    kv_cache: KVCache
    blocks: BlockManager
    adapters: AdapterManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    logits: LogitsProcessor
    sequences: SequenceBuilder
    outputs: OutputAssembler
    grammars: Grammars


def build_engine_parts(
    config: EngineConfig, m: LoadedModel, *, replica_name: str, adapter_digests: DigestSource | None
) -> EngineParts:
    """Every collaborator of an engine over the loaded model `m`, sized by its memory plan (logged)."""
    plan = MemoryPlan.for_model(config, m)
    kv_cache = KVCache(
        num_layers=m.num_layers,
        num_blocks=plan.num_blocks,
        block_size=config.block_size,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
        device=m.device,
    )
    blocks = BlockManager(
        plan.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
    )
    adapters = _adapter_manager(config, m, adapter_digests)
    scheduler = Scheduler(
        blocks,
        adapters,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_prompt_logprob_rows=plan.prompt_logprob_rows,
        lora_pages=m.lora_pages,
        adapter_wait_bound_s=config.adapter_wait_bound_s,
        adapter_min_residency_s=config.adapter_min_residency_s,
        scheduling=config.scheduling,
        fair_wait_bound_s=config.fair_wait_bound_s,
        batch_step_tokens=config.batch_step_tokens,
        batch_step_slack=config.batch_step_slack,
        batch_interactive_window_s=config.batch_interactive_window_s,
    )
    runner = _model_runner(config, m, kv_cache, plan.max_model_len)
    sampler = Sampler(plan.vocab_size, m.device, seed=config.seed)
    parts = EngineParts(
        loaded=m,
        memory=plan,
        kv_cache=kv_cache,
        blocks=blocks,
        adapters=adapters,
        scheduler=scheduler,
        runner=runner,
        sampler=sampler,
        logits=LogitsProcessor(sampler, plan.vocab_size, m.eos_token_ids),
        sequences=SequenceBuilder(
            vocab_size=plan.vocab_size,
            max_model_len=plan.max_model_len,
            max_waiting=config.max_waiting,
            device=m.device,
        ),
        outputs=OutputAssembler(
            scheduler,
            m.tokenizer,
            eos_token_ids=m.eos_token_ids,
            max_model_len=plan.max_model_len,
            replica_name=replica_name,
        ),
        grammars=Grammars(m.tokenizer, plan.vocab_size, m.eos_token_ids, config),
    )
    plan.bytes.update(
        weights=m.weights_bytes,
        kv_cache=kv_cache.nbytes,
        lora_slots=m.lora_slot_bytes,
        prompt_logprob_rows=plan.prompt_logprob_rows * plan.prompt_logprob_row_bytes,
        step_buffers=runner.step_buffer_bytes,
        decode_graphs=runner.graph_pool_bytes,
    )
    log.info(
        "engine ready: %d KV blocks x %d tokens, prompt logprobs %d rows a step, max_model_len %d, "
        "LoRA kernel %s; memory (MiB): %s",
        plan.num_blocks,
        config.block_size,
        plan.prompt_logprob_rows,
        plan.max_model_len,
        m.lora_context.kernel_name,
        ", ".join(f"{k} {v / 2**20:.1f}" for k, v in plan.bytes.items()),
    )
    return parts


def _adapter_manager(config: EngineConfig, m: LoadedModel, digests: DigestSource | None) -> AdapterManager:
    store = AdapterStore(
        config.adapter_store,
        cache_dir=config.adapter_cache_dir,
        cache_max_bytes=config.adapter_cache_mb * 2**20,
        digests=digests,
    )
    return AdapterManager(
        store,
        m.lora_modules,
        lora_pages=m.lora_pages,
        max_cpu_loras=config.max_cpu_loras,
        max_rank=config.max_lora_rank,
        page_rank=m.lora_page_rank,
        dtype=m.dtype,
        device=m.device,
        retry_s=config.adapter_retry_s,
        retry_max_s=config.adapter_retry_max_s,
        min_residency_s=config.adapter_min_residency_s,
        read_wait_s=config.adapter_read_wait_s,
    )


def _model_runner(config: EngineConfig, m: LoadedModel, kv_cache: KVCache, max_model_len: int) -> ModelRunner:
    """The runner, once the LoRA kernel for this model's shapes is chosen (it captures graphs with it)."""
    dims = {m.lora_page_rank} | {
        d for mod in m.lora_modules.values() for d in (mod.in_features, mod.out_features)
    }
    m.lora_context.kernel_name, m.lora_context.kernel = select_kernel(m.dtype, m.device, dims)
    return ModelRunner(
        m,
        kv_cache,
        lora_pages=m.lora_pages,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
        cuda_graphs=config.cuda_graphs,
    )
