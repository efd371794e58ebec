"""LLMEngine: the synchronous core. `step()` = schedule -> run -> sample -> postprocess.

Not thread-safe by itself: one thread drives `step()` (see AsyncEngine). `make_sequence` only validates
and may run on any thread, so callers get named errors before anything is queued.
"""

import logging
import os
import socket
import time

import torch

from adapters.store import AdapterStore
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.config import EngineConfig
from deployments.engine.detokenizer import IncrementalDetokenizer
from deployments.engine.errors import (
    DuplicateRequestId,
    EmptyPrompt,
    EngineOverloaded,
    InvalidRequest,
    PromptTooLong,
)
from deployments.engine.kv_cache import KVCache
from deployments.engine.lora_kernels import select_kernel
from deployments.engine.model_loader import LoadedModel, load_model
from deployments.engine.model_runner import ModelRunner
from deployments.engine.outputs import EngineStats, FinishReason, RequestOutput, RequestUsage
from deployments.engine.request import EngineRequest
from deployments.engine.sampler import Sampler, SamplingRow
from deployments.engine.scheduler import ScheduledSequence, Scheduler
from deployments.engine.sequence import Sequence

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, loaded: LoadedModel | None = None, replica_name: str | None = None
    ) -> None:
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
            AdapterStore(config.adapter_store),
            m.lora_modules,
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_rank=config.max_lora_rank,
            dtype=m.dtype,
            device=m.device,
        )
        self.scheduler = Scheduler(
            self.blocks,
            self.adapters,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_loras=config.max_loras,
        )
        self.runner = ModelRunner(m, self.kv_cache, max_loras=config.max_loras)
        dims = {config.max_lora_rank} | {
            d for mod in m.lora_modules.values() for d in (mod.in_features, mod.out_features)
        }
        m.lora_context.kernel_name, m.lora_context.kernel = select_kernel(m.dtype, m.device, dims)
        self.sampler = Sampler(self.vocab_size, m.device, seed=config.seed)
        self._requests: dict[str, Sequence] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._started = time.monotonic()
        self.busy_seconds = 0.0
        self.steps = 0
        # Usage rows name the replica that served them; a Serve replica passes its own id.
        self.replica_name = replica_name or f"{socket.gethostname()}:{os.getpid()}"
        self.last_step_tokens = 0
        self.adapter_requests = 0
        self.adapter_arrival_hits = 0
        self.aborts = 0  # requests stopped by abort() while still running or waiting
        self.generated_tokens = 0  # every output token sampled, aborted requests' included
        log.info(
            "engine ready: %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, LoRA kernel %s",
            num_blocks,
            config.block_size,
            self.kv_cache.nbytes / 2**20,
            self.max_model_len,
            m.lora_context.kernel_name,
        )

    # -- requests -------------------------------------------------------------------------------------

    def make_sequence(self, request: EngineRequest) -> Sequence:
        """Validate a request's own input and build its Sequence; raises a named error for bad input.
        Reads only the engine's fixed configuration, so any thread may call it; what depends on the
        engine's state (queue length, the adapter) is checked by `add_sequence` on the loop thread."""
        prompt_ids, params = request.prompt_ids, request.params
        if not prompt_ids:
            raise EmptyPrompt()
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        n = len(prompt_ids)
        room = self.max_model_len - n
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            raise PromptTooLong(n, params.max_tokens or 1, self.max_model_len)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return Sequence(
            request_id=request.request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            adapter=request.adapter,
            max_tokens=params.max_tokens or room,
            generator=generator,
            cache_salt=request.cache_salt,
        )

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence; raises a named error if the engine cannot take it now."""
        if seq.request_id in self._requests:
            raise DuplicateRequestId(seq.request_id)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests are already waiting")
        if seq.adapter is not None:
            self.adapters.check(seq.adapter)
        self._requests[seq.request_id] = seq
        if seq.adapter is not None:  # routing quality: did the request find its adapter already here?
            self.adapter_requests += 1
            self.adapter_arrival_hits += seq.adapter in self.adapters.held()
        self._detokenizers[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            seq.prompt_ids,
            stop=seq.params.stop,
            skip_special_tokens=seq.params.skip_special_tokens,
        )
        self.scheduler.add(seq)

    def add_request(self, request: EngineRequest) -> None:
        self.add_sequence(self.make_sequence(request))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, freeing its KV blocks and slot; returns its final output (None if unknown)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self.aborts += 1
        self.scheduler.finish(seq, FinishReason.ABORT)
        return self._final(seq, "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.adapters.load_pinned()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_tokens
        outputs = [self._final(seq, "") for seq in plan.failed]
        if not plan.scheduled:
            return outputs
        sampling = [s for s in plan.scheduled if s.samples]
        start = time.perf_counter()
        try:
            logits = self.runner.run(plan.scheduled)
            tokens = self._sample(logits, sampling)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as error:  # keep serving: fail this step's requests, not the engine
            log.exception("engine step failed")
            return outputs + self._fail(plan.scheduled, f"engine step failed: {error}")
        elapsed = time.perf_counter() - start
        self._account(plan.scheduled, elapsed)
        broken = {id(item) for item, token in zip(sampling, tokens, strict=True) if isinstance(token, str)}
        for item in plan.scheduled:
            if id(item) not in broken:
                item.seq.num_computed += item.num_tokens
                self.blocks.commit(item.seq)
                seq, m = item.seq, item.seq.metrics
                m.prompt_processed = max(m.prompt_processed, min(seq.num_computed, seq.num_prompt_tokens))
        for item, token in zip(sampling, tokens, strict=True):
            if isinstance(token, str):  # only the row that could not be sampled fails
                outputs += self._fail([item], f"sampling failed: {token}")
            else:
                outputs.append(self._append_token(item.seq, token))
        return outputs

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledSequence]) -> list[int | str]:
        """A token per row, or for a row that cannot be sampled the error, so that one request's bad
        parameters never fail its batch neighbours. The per-row retry only runs after a failure (a seeded
        row may then draw from a generator the failed batch call already advanced)."""
        rows = [self._sampling_row(s.seq) for s in sampling]
        try:
            return list(self.sampler.sample(logits, rows))
        except Exception:
            log.exception("sampling the step failed; sampling its rows one by one")
        tokens: list[int | str] = []
        for i, row in enumerate(rows):
            try:
                tokens.append(self.sampler.sample(logits[i : i + 1], [row])[0])
            except Exception as error:
                tokens.append(str(error) or type(error).__name__)
        return tokens

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        penalised = seq.params.uses_penalties
        return SamplingRow(
            params=seq.params,
            generator=seq.generator,
            prompt_ids=seq.prompt_ids if penalised else (),
            output_ids=seq.output_ids if penalised else (),
        )

    def _account(self, scheduled: list[ScheduledSequence], elapsed: float) -> None:
        """Split the step's device time across its sequences by tokens processed; shares sum to elapsed."""
        total = sum(s.num_tokens for s in scheduled)
        for s in scheduled:
            s.seq.metrics.gpu_time += elapsed * s.num_tokens / total
        self.busy_seconds += elapsed
        self.steps += 1

    def _append_token(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        self.generated_tokens += 1
        if seq.metrics.first_token is None:
            seq.metrics.first_token = time.monotonic()
        detok = self._detokenizers[seq.request_id]
        params = seq.params
        reason: FinishReason | None = None
        delta_stop: str | int | None = None
        text = ""
        if token in self.loaded.eos_token_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            reason, seq.stop_reason = FinishReason.STOP, token
        else:
            delta = detok.add_token(token)
            text, delta_stop = delta.text, delta.stop_reason
            if delta_stop is not None:
                reason, seq.stop_reason = FinishReason.STOP, delta_stop
        if reason is None and (
            seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None:
            # Every output carries the usage so far: if the client goes away mid-stream, the ingress
            # bills what the engine had processed up to the last output it received.
            return RequestOutput(seq.request_id, text, [token], usage=self.usage_of(seq))
        if delta_stop is None:  # flush held-back text; it may complete a stop string itself
            text += detok.finish()
            if detok.stop_reason is not None:
                reason, seq.stop_reason = FinishReason.STOP, detok.stop_reason
        self.scheduler.finish(seq, reason)
        out = self._final(seq, text)
        out.token_ids = [token]
        return out

    def _final(self, seq: Sequence, text: str) -> RequestOutput:
        self._requests.pop(seq.request_id, None)
        self._detokenizers.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            finished=True,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            usage=self.usage_of(seq),
            error=seq.error,
        )

    def usage_of(self, seq: Sequence) -> RequestUsage:
        """What the request has used so far (final once it finished)."""
        m = seq.metrics
        end = m.finished or time.monotonic()
        # Until its first token a request has used only the prompt it processed (cached blocks included):
        # one aborted in the queue costs nothing, one aborted mid-prefill the chunks that ran.
        processed = max(m.prompt_processed, m.cached_prompt_tokens)
        prompt = seq.num_prompt_tokens if seq.num_output_tokens else processed
        return RequestUsage(
            prompt_tokens=prompt,
            cached_prompt_tokens=m.cached_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            queue_ms=((m.first_scheduled or end) - m.arrival) * 1e3,
            ttft_ms=None if m.first_token is None else (m.first_token - m.arrival) * 1e3,
            total_ms=(end - m.arrival) * 1e3,
            gpu_ms=m.gpu_time * 1e3,
            preemptions=m.num_preemptions,
            replica=self.replica_name,
        )

    def _fail(self, scheduled: list[ScheduledSequence], message: str) -> list[RequestOutput]:
        outputs = []
        for item in scheduled:
            item.seq.error = message
            self.scheduler.finish(item.seq, FinishReason.ERROR)
            outputs.append(self._final(item.seq, ""))
        return outputs

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
            adapter_disk_loads=dict(self.adapters.disk_loads),
        )

    def close(self) -> None:
        self.adapters.close()
