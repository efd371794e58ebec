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
import time
from collections import Counter
from typing import Any

import torch

from adapters.registered_digest import DigestSource
from deployments.engine.config import EngineConfig
from deployments.engine.engine_parts import EngineCounters, build_engine_parts
from deployments.engine.errors import (
    DuplicateRequestId,
    EngineOverloaded,
    QueueShareExceeded,
    RequestFailed,
)
from deployments.engine.logits_processor import Token
from deployments.engine.logprobs import prompt_positions
from deployments.engine.model.model_loader import LoadedModel, load_model
from deployments.engine.outputs import EngineStats, RequestOutput, RequestUsage, TokenLogprob
from deployments.engine.request import EngineRequest
from deployments.engine.sequence import ScheduledSequence, Sequence, attach_grammar

log = logging.getLogger(__name__)
QUEUE_STATS_S = 0.5  # how stale stats()'s queue figures may be


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
        # Usage rows name the replica that served them; a Serve replica passes its own id.
        self.replica_name = replica_name or f"{socket.gethostname()}:{os.getpid()}"
        parts = build_engine_parts(
            config,
            loaded or load_model(config),
            replica_name=self.replica_name,
            adapter_digests=adapter_digests,
        )
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.device = parts.loaded.device
        self.kv_cache = parts.kv_cache
        self.blocks = parts.blocks
        self.adapters = parts.adapters
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.sampler = parts.sampler
        self.logits = parts.logits
        self.sequences = parts.sequences
        self.outputs = parts.outputs
        self.grammars = parts.grammars  # structured output: compile, its threads, bounds and refusals
        self.max_model_len = parts.memory.max_model_len
        self.vocab_size = parts.memory.vocab_size
        self.prompt_logprob_rows = parts.memory.prompt_logprob_rows
        self.prompt_logprob_row_bytes = parts.memory.prompt_logprob_row_bytes
        self.memory_plan = parts.memory.bytes
        self.counters = EngineCounters()
        self._started = time.monotonic()
        self._queue_stats: tuple[float, dict[str, Any]] | None = None  # (when, figures): see _queues

    # -- requests -------------------------------------------------------------------------------------

    def make_sequences(self, request: EngineRequest) -> list[Sequence]:
        """Validate a request's own input and build its sequences (any thread: see SequenceBuilder). A
        structured-output grammar is attached by the caller (`attach_grammar`)."""
        return self.sequences.build(request)

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
        if adapter is not None:  # routing quality: did the request find its adapter already here?
            self.counters.adapter_requests += 1
            self.counters.adapter_arrival_hits += adapter in self.adapters.held()
        self.outputs.register(seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue a request on this thread (compiling its grammar and reading its adapter's
        config here, if it has them)."""
        seqs = self.make_sequences(request)
        if request.params.structured is not None:
            attach_grammar(seqs, self.grammars.compile(request.params.structured))
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
        self.counters.aborts += 1
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.adapters.load_pinned()
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        self.counters.last_step_tokens = plan.num_tokens
        outputs: list[RequestOutput] = []
        for seq in plan.failed:
            outputs += self.outputs.fail_group(seq, seq.error or RequestFailed())
        if not plan.scheduled:
            return outputs
        sampling: list[ScheduledSequence] = []
        prompt_only: list[Sequence] = []  # echo with max_tokens 0: its prompt ran, it samples nothing
        for s in plan.scheduled:
            if s.samples:
                if s.seq.max_tokens > 0:
                    sampling.append(s)
                else:
                    prompt_only.append(s.seq)
        try:
            tokens, logprobs = self._run(plan.scheduled, sampling)
        except Exception:  # keep serving: fail this step's requests, not the engine
            ids = sorted({s.seq.group_id for s in plan.scheduled})
            log.exception("engine step failed; failing its requests %s", ", ".join(ids))
            return outputs + self.outputs.fail(plan.scheduled, RequestFailed("the engine step failed"))
        self._commit(plan.scheduled, sampling, tokens)
        outputs += self.outputs.step_outputs(sampling, tokens, logprobs, prompt_only)
        outputs += self.outputs.stop_spent(plan.scheduled)  # requests that reached their GPU bound
        # The whole step, plan to outputs, is what a neighbour's next token waits for: the batch class's
        # share of a step is bounded by this fit (Scheduler._batch_allowance).
        elapsed = time.perf_counter() - started
        self.scheduler.step_cost.observe(plan.num_tokens, len(sampling), elapsed)
        self.counters.step_seconds += elapsed
        return outputs

    def _run(
        self, scheduled: list[ScheduledSequence], sampling: list[ScheduledSequence]
    ) -> tuple[list[Token], list[TokenLogprob | None]]:
        """The forward and the tokens, timed: the step's device time is split across its sequences."""
        prompt_rows: list[range] = []
        if any(s.seq.prompt_logprobs is not None for s in scheduled):  # else none has any: skip the walk
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
            if not broken or id(item) not in broken:
                seq, m = item.seq, item.seq.metrics
                seq.num_computed += item.num_tokens
                self.blocks.commit(seq)
                if m.prompt_processed < len(seq.prompt_ids):  # past the prompt it can only stay
                    m.prompt_processed = max(m.prompt_processed, min(seq.num_computed, len(seq.prompt_ids)))

    def _account(self, scheduled: list[ScheduledSequence], elapsed: float) -> None:
        """Charge the step's time to its sequences (the charges sum to elapsed): the host work one sequence
        caused alone (its grammar's mask and closing, its prompt logprobs) to that sequence, the shared rest
        (the forward, the sampling call) split by tokens processed. And count the prompt positions run."""
        total = sum(s.num_tokens for s in scheduled)
        own = [s.seq.metrics.step_host_time for s in scheduled]
        own_sum = sum(own)
        shared = max(0.0, elapsed - own_sum)
        scale = elapsed / own_sum if shared == 0.0 and own_sum > 0 else 1.0  # clock jitter: keep the sum
        prefill = 0
        for s, host in zip(scheduled, own, strict=True):
            seq, m = s.seq, s.seq.metrics
            m.gpu_time += shared * s.num_tokens / total + host * scale
            m.step_host_time = 0.0
            if seq.num_computed < len(seq.prompt_ids):  # num_computed has not moved yet
                prefill += min(seq.num_computed + s.num_tokens, len(seq.prompt_ids)) - seq.num_computed
        self.counters.prefill_tokens += prefill
        self.counters.busy_seconds += elapsed
        self.counters.steps += 1

    def usage_of(self, seqs: "Sequence | list[Sequence]") -> RequestUsage:
        return self.outputs.usage_of(seqs)

    @property
    def generated_tokens(self) -> int:
        return self.outputs.generated_tokens

    # -- adapters and stats ---------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        slots = self.adapters.slots
        queues = self._queues()
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage,
            free_slots=slots.num_free,
            device_adapters=[str(r) for r in slots.resident()],
            cpu_adapters=[str(r) for r in self.adapters.cpu.resident()],
            busy_seconds=self.counters.busy_seconds,
            step_seconds=self.counters.step_seconds,
            wall_seconds=time.monotonic() - self._started,
            steps=self.counters.steps,
            preemptions=self.scheduler.num_preemptions,
            prefix_hit_rate=self.blocks.prefix_hits / max(1, self.blocks.prefix_queries),
            adapter_loads=slots.loads,
            adapter_evictions=slots.evictions,
            adapter_requests=self.counters.adapter_requests,
            adapter_arrival_hits=self.counters.adapter_arrival_hits,
            aborts=self.counters.aborts,
            generated_tokens=self.generated_tokens,
            prefill_tokens=self.counters.prefill_tokens,
            adapter_disk_loads=dict(self.adapters.disk_loads),
            adapter_read_waits=self.adapters.read_waits,
            grammar_refusals=self.grammars.refusals(),
            adapter_load_failures=dict(self.adapters.cpu.load_failures),
            adapter_load_retries=dict(self.adapters.cpu.load_retries),
            tenant_service={t or "": v for t, v in self.scheduler.served_service().items()},
            preemptions_by_reason=self.scheduler.preemptions_by_reason(),
            resident_ranks=self._resident_ranks(),
            adapter_pages={
                "total": slots.num_slots,
                "in_use": slots.num_slots - slots.free_pages,
                "page_rank": self.adapters.page_rank,
            },
            **queues,
        )

    def _resident_ranks(self) -> dict[str, int]:
        specs = {ref: self.adapters.specs.cached(ref) for ref in self.adapters.slots.resident()}
        return {str(ref): spec.max_rank for ref, spec in specs.items() if spec is not None}

    def _queues(self) -> dict[str, Any]:
        """The queue figures of stats() (per-tenant waits, per-adapter queues). They cost a
        walk of the waiting queue, and stats() runs every step: recomputed at most every QUEUE_STATS_S,
        and whenever nothing waits (no walk then; the loop's last stats before it idles must not keep
        showing a queue that has drained)."""
        now = time.monotonic()
        cached = self._queue_stats
        if cached is not None and now - cached[0] < QUEUE_STATS_S and self.scheduler.waiting:
            return cached[1]
        waiting = self.scheduler.waiting_by_tenant()
        queued = Counter(str(s.adapter) for s in self.scheduler.waiting if s.adapter is not None)
        top_n = self.config.stats_top_adapters
        # Deepest first, ties by name: the same adapters stay named while depths hold (stable metric labels).
        top = dict(sorted(queued.items(), key=lambda item: (-item[1], item[0]))[:top_n])
        figures: dict[str, Any] = {
            "tenant_waiting": {t or "": n for t, (n, _) in waiting.items()},
            "tenant_oldest_wait_s": {t or "": now - since for t, (_, since) in waiting.items()},
            "adapter_queue": top,
            "adapter_queue_other": sum(queued.values()) - sum(top.values()),
            "adapters_queued": len(queued),
            # As the last scheduling pass left it, less adapters with nothing waiting now (the pass runs only
            # while sequences wait, so its order outlives an emptied queue).
            "adapter_rotation": [r for r in map(str, self.scheduler.rotation_order) if r in queued][:top_n],
        }
        self._queue_stats = (now, figures)
        return figures

    def close(self) -> None:
        self.grammars.shutdown()
        self.adapters.close()
