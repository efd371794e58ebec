"""LLMEngine: the synchronous core, a loop of steps: add requests, schedule, run, process outputs.

`step()` = the scheduler's plan -> the model runner's forward -> the logits processor's tokens -> the output
assembler's outputs. Not thread-safe by itself: one thread drives `step()` (see AsyncEngine).
`make_sequences` only validates and may run on any thread, and so may `adapters.check` (which reads the
store), so callers get named errors before anything is queued. A failure while serving one request (its
step, its sampling, its adapter) ends that request with a named error (RequestError); the cause goes to the
log with the request id.
"""

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import torch

from adapters.registered_digest import DigestSource
from adapters.store import AdapterStore
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.config import EngineConfig
from deployments.engine.errors import (
    BudgetTooSmall,
    DuplicateRequestId,
    EngineOverloaded,
    QueueShareExceeded,
    RequestFailed,
)
from deployments.engine.logits_processor import LogitsProcessor, Token
from deployments.engine.logprobs import prompt_positions
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.lora_kernels import select_kernel
from deployments.engine.model.model_loader import LoadedModel, load_model
from deployments.engine.model.model_runner import ModelRunner
from deployments.engine.output_assembler import OutputAssembler
from deployments.engine.outputs import EngineStats, RequestOutput, RequestUsage, TokenLogprob
from deployments.engine.request import EngineRequest
from deployments.engine.sampler import Sampler
from deployments.engine.scheduler import Scheduler
from deployments.engine.sequence import ScheduledSequence, Sequence
from deployments.engine.sequence_builder import SequenceBuilder

if TYPE_CHECKING:
    from deployments.engine.grammar.compiler import CompiledGrammar, GrammarCompiler

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        loaded: LoadedModel | None = None,
        replica_name: str | None = None,
        adapter_digests: DigestSource | None = None,
    ) -> None:
        """`adapter_digests`: the registry's, to check adapters read from an object store against."""
        self.config = config
        self.loaded = loaded or load_model(config)
        m = self.loaded
        self.tokenizer = m.tokenizer
        self.device = m.device
        num_blocks = config.num_kv_blocks or KVCache.blocks_for_budget(
            config.kv_cache_memory_mb * 2**20,
            num_layers=m.num_layers,
            block_size=config.block_size,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
        )
        self.kv_cache = KVCache(
            num_layers=m.num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
            device=m.device,
        )
        self.max_model_len = min(m.max_model_len, num_blocks * config.block_size)
        self.vocab_size = int(m.model.config.get_text_config().vocab_size)
        self.blocks = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.adapters = AdapterManager(
            AdapterStore(
                config.adapter_store,
                cache_dir=config.adapter_cache_dir,
                cache_max_bytes=config.adapter_cache_mb * 2**20,
                digests=adapter_digests,
            ),
            m.lora_modules,
            max_loras=m.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_rank=config.max_lora_rank,
            dtype=m.dtype,
            device=m.device,
            retry_s=config.adapter_retry_s,
            retry_max_s=config.adapter_retry_max_s,
        )
        # Logits rows at prompt positions (echo): float32 logits and their log-softmax, vocab-wide each.
        self.prompt_logprob_row_bytes = self.vocab_size * 2 * torch.float32.itemsize
        self.prompt_logprob_rows = min(
            config.max_num_batched_tokens,
            config.max_prompt_logprob_rows
            or max(1, config.prompt_logprobs_memory_mb * 2**20 // self.prompt_logprob_row_bytes),
        )
        self.scheduler = Scheduler(
            self.blocks,
            self.adapters,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_prompt_logprob_rows=self.prompt_logprob_rows,
            max_loras=m.max_loras,
            adapter_wait_bound_s=config.adapter_wait_bound_s,
        )
        dims = {config.max_lora_rank} | {
            d for mod in m.lora_modules.values() for d in (mod.in_features, mod.out_features)
        }
        m.lora_context.kernel_name, m.lora_context.kernel = select_kernel(m.dtype, m.device, dims)
        self.runner = ModelRunner(
            m,
            self.kv_cache,
            max_loras=m.max_loras,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            cuda_graphs=config.cuda_graphs,
        )
        self.sampler = Sampler(self.vocab_size, m.device, seed=config.seed)
        self.logits = LogitsProcessor(self.sampler, self.vocab_size, m.eos_token_ids)
        self.sequences = SequenceBuilder(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_waiting=config.max_waiting,
            device=self.device,
        )
        # Usage rows name the replica that served them; a Serve replica passes its own id.
        self.replica_name = replica_name or f"{socket.gethostname()}:{os.getpid()}"
        self.outputs = OutputAssembler(
            self.scheduler,
            self.tokenizer,
            eos_token_ids=m.eos_token_ids,
            max_model_len=self.max_model_len,
            replica_name=self.replica_name,
        )
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._started = time.monotonic()
        self.busy_seconds = 0.0
        self.steps = 0
        self.last_step_tokens = 0
        self.adapter_requests = 0
        self.adapter_arrival_hits = 0
        self.aborts = 0  # requests stopped by abort() while still running or waiting
        self.prefill_tokens = 0  # prompt tokens run through the model (prefix-cache hits are not)
        # Where the memory goes: what the operator sizes with kv_cache_memory_mb, lora_memory_mb and
        # prompt_logprobs_memory_mb, plus what the engine adds itself (step buffers, captured decode graphs).
        self.memory_plan = {
            "weights": m.weights_bytes,
            "kv_cache": self.kv_cache.nbytes,
            "lora_slots": m.lora_slot_bytes,
            "prompt_logprob_rows": self.prompt_logprob_rows * self.prompt_logprob_row_bytes,
            "step_buffers": self.runner.step_buffer_bytes,
            "decode_graphs": self.runner.graph_pool_bytes,
        }
        log.info(
            "engine ready: %d KV blocks x %d tokens, prompt logprobs %d rows a step, max_model_len %d, "
            "LoRA kernel %s; memory (MiB): %s",
            num_blocks,
            config.block_size,
            self.prompt_logprob_rows,
            self.max_model_len,
            m.lora_context.kernel_name,
            ", ".join(f"{k} {v / 2**20:.1f}" for k, v in self.memory_plan.items()),
        )

    # -- requests -------------------------------------------------------------------------------------

    def make_sequences(self, request: EngineRequest) -> list[Sequence]:
        """Validate a request's own input and build its sequences (any thread: see SequenceBuilder). A
        structured-output grammar is attached by the caller (`attach_grammar`)."""
        return self.sequences.build(request)

    @property
    def grammars(self) -> "GrammarCompiler":
        """Compiles structured-output grammars for this model's tokenizer (thread-safe; made on first use,
        cheaply: it converts the tokenizer on its first compile)."""
        with self._grammars_lock:  # callers on several threads must all get the one cache
            if self._grammars is None:
                from deployments.engine.grammar.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer, self.vocab_size, sorted(self.loaded.eos_token_ids)
                )
            return self._grammars

    @staticmethod
    def attach_grammar(seqs: list[Sequence], grammar: "CompiledGrammar") -> None:
        """Give each sequence its grammar state; raises BudgetTooSmall (nothing attached) when the output
        could not complete within the sequences' max_tokens (every choice has the same)."""
        minimum = grammar.min_tokens
        if minimum is not None and seqs and seqs[0].max_tokens < minimum:
            raise BudgetTooSmall(seqs[0].max_tokens, minimum)
        for seq in seqs:
            seq.matcher = grammar.matcher()

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences; raises a named error if the engine cannot take it now. The
        caller has checked their adapter (`adapters.check`, off the loop thread: it reads the store)."""
        group_id = seqs[0].group_id
        if group_id in self.outputs.groups:
            raise DuplicateRequestId(group_id)
        waiting = len(self.scheduler.waiting)
        if waiting + len(seqs) > self.config.max_waiting:
            raise EngineOverloaded(f"{waiting} sequences are already waiting")
        # Fair share: while others wait, one party's sequences take at most half of the queue, so one
        # tenant's burst (n x prompts sequences a request) cannot fill it for everyone.
        tenant = seqs[0].tenant
        own = self.scheduler.waiting_of(tenant)
        share = max(1, self.config.max_waiting // 2)
        if waiting > own and own + len(seqs) > share:
            raise QueueShareExceeded(
                f"tenant {tenant!r} has {own} of {waiting} waiting sequences and asks for {len(seqs)} more; "
                f"its share while others wait is {share}"
            )
        adapter = seqs[0].adapter
        if adapter is not None:
            self.adapter_requests += 1  # routing quality: did the request find its adapter already here?
            self.adapter_arrival_hits += adapter in self.adapters.held()
        self.outputs.register(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request on this thread (compiling its grammar and reading its adapter's
        config here, if it has them)."""
        seqs = self.make_sequences(request)
        if request.params.structured is not None:
            self.attach_grammar(seqs, self.grammars.compile(request.params.structured))
        if request.adapter is not None:
            self.adapters.check(request.adapter)
        self.add_sequences(seqs)

    def group(self, request_id: str) -> list[Sequence]:
        return self.outputs.groups[request_id]

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now, freeing its KV blocks and slot; returns the final outputs of its choices that
        were still running (empty if the request is unknown or already finished)."""
        if request_id not in self.outputs.groups:
            return []
        self.aborts += 1
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.adapters.load_pinned()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_tokens
        outputs: list[RequestOutput] = []
        for seq in plan.failed:
            outputs += self.outputs.fail_group(seq, seq.error or RequestFailed())
        if not plan.scheduled:
            return outputs
        sampling = [s for s in plan.scheduled if s.draws]
        prompt_only = [s.seq for s in plan.scheduled if s.samples and not s.draws]  # echo, max_tokens 0
        try:
            tokens, logprobs = self._run(plan.scheduled, sampling)
        except Exception:  # keep serving: fail this step's requests, not the engine
            ids = sorted({s.seq.group_id for s in plan.scheduled})
            log.exception("engine step failed; failing its requests %s", ", ".join(ids))
            return outputs + self.outputs.fail(plan.scheduled, RequestFailed("the engine step failed"))
        self._commit(plan.scheduled, sampling, tokens)
        outputs += self.outputs.step_outputs(sampling, tokens, logprobs, prompt_only)
        return outputs + self.outputs.stop_spent(plan.scheduled)  # requests that reached their GPU bound

    def _run(
        self, scheduled: list[ScheduledSequence], sampling: list[ScheduledSequence]
    ) -> tuple[list[Token], list[TokenLogprob | None]]:
        """The forward and the tokens, timed: the step's device time is split across its sequences."""
        prompt_rows = [prompt_positions(s.seq, s.seq.num_computed, s.num_tokens) for s in scheduled]
        start = time.perf_counter()
        logits = self.runner.run(scheduled)
        if any(prompt_rows):
            logits = self.logits.take_prompt_logprobs(logits, scheduled, prompt_rows)
        tokens, logprobs = self.logits.sample(logits, sampling)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._account(scheduled, time.perf_counter() - start)
        return tokens, logprobs

    def _commit(
        self, scheduled: list[ScheduledSequence], sampling: list[ScheduledSequence], tokens: list[Token]
    ) -> None:
        """The step's tokens are in the KV cache now (but for rows that could not be sampled)."""
        broken = {id(item) for item, token in zip(sampling, tokens, strict=True) if isinstance(token, str)}
        for item in scheduled:
            if id(item) not in broken:
                item.seq.num_computed += item.num_tokens
                self.blocks.commit(item.seq)
                seq, m = item.seq, item.seq.metrics
                m.prompt_processed = max(m.prompt_processed, min(seq.num_computed, seq.num_prompt_tokens))

    def _account(self, scheduled: list[ScheduledSequence], elapsed: float) -> None:
        """Split the step's device time across its sequences by tokens processed (shares sum to elapsed), and
        count the prompt positions the step ran."""
        total = sum(s.num_tokens for s in scheduled)
        for s in scheduled:
            s.seq.metrics.gpu_time += elapsed * s.num_tokens / total
            prompt_end = min(s.seq.num_computed + s.num_tokens, s.seq.num_prompt_tokens)
            self.prefill_tokens += max(0, prompt_end - s.seq.num_computed)  # num_computed has not moved yet
        self.busy_seconds += elapsed
        self.steps += 1

    def usage_of(self, seqs: "Sequence | list[Sequence]") -> RequestUsage:
        return self.outputs.usage_of(seqs)

    @property
    def generated_tokens(self) -> int:
        return self.outputs.generated_tokens

    # -- adapters and stats ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        slots = self.adapters.slots
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage,
            free_slots=slots.num_free,
            device_adapters=[str(r) for r in slots.resident()],
            cpu_adapters=[str(r) for r in self.adapters.cpu.resident()],
            busy_seconds=self.busy_seconds,
            wall_seconds=time.monotonic() - self._started,
            steps=self.steps,
            preemptions=self.scheduler.num_preemptions,
            prefix_hit_rate=self.blocks.prefix_hits / max(1, self.blocks.prefix_queries),
            adapter_loads=slots.loads,
            adapter_evictions=slots.evictions,
            adapter_requests=self.adapter_requests,
            adapter_arrival_hits=self.adapter_arrival_hits,
            aborts=self.aborts,
            generated_tokens=self.generated_tokens,
            prefill_tokens=self.prefill_tokens,
            adapter_disk_loads=dict(self.adapters.disk_loads),
            grammar_refusals=self._grammars.refusals() if self._grammars is not None else {},
            adapter_load_failures=dict(self.adapters.cpu.load_failures),
            adapter_load_retries=dict(self.adapters.cpu.load_retries),
        )

    def close(self) -> None:
        self.adapters.close()
