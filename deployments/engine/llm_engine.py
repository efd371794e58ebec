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
        plan = self.scheduler.schedule()
        self.counters.last_step_tokens = plan.num_tokens
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
            # num_computed has not moved yet
            self.counters.prefill_tokens += max(0, prompt_end - s.seq.num_computed)
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
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.blocks.usage,
            free_slots=slots.num_free,
            device_adapters=[str(r) for r in slots.resident()],
            cpu_adapters=[str(r) for r in self.adapters.cpu.resident()],
            busy_seconds=self.counters.busy_seconds,
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
            grammar_refusals=self.grammars.refusals(),
            adapter_load_failures=dict(self.adapters.cpu.load_failures),
            adapter_load_retries=dict(self.adapters.cpu.load_retries),
        )

    def close(self) -> None:
        self.grammars.shutdown()
        self.adapters.close()
