"""LLMEngine: the synchronous core. `step()` = schedule -> run -> sample -> postprocess.

Not thread-safe by itself: one thread drives `step()` (see AsyncEngine). `make_sequence` only validates
and may run on any thread, and so may `adapters.check` (which reads the store), so callers get named errors
before anything is queued. A failure while serving one request (its step, its sampling, its adapter) ends
that request with a named error (RequestError); the cause goes to the log with the request id.
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
from deployments.engine.detokenizer import IncrementalDetokenizer
from deployments.engine.errors import (
    DuplicateRequestId,
    EmptyPrompt,
    EngineOverloaded,
    InvalidRequest,
    PromptTooLong,
    QueueShareExceeded,
    RequestError,
    RequestFailed,
)
from deployments.engine.kv_cache import KVCache
from deployments.engine.logprobs import logprob_table, prompt_positions, read_logprobs, token_logprobs
from deployments.engine.lora_kernels import select_kernel
from deployments.engine.model_loader import LoadedModel, load_model
from deployments.engine.model_runner import ModelRunner
from deployments.engine.outputs import EngineStats, FinishReason, RequestOutput, RequestUsage, TokenLogprob
from deployments.engine.request import EngineRequest
from deployments.engine.sampler import Sampler, SamplingRow
from deployments.engine.scheduler import ScheduledSequence, Scheduler
from deployments.engine.sequence import Sequence

if TYPE_CHECKING:
    from deployments.engine.grammar import CompiledGrammar, GrammarCompiler

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
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its choices
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
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
        """Validate a request's own input and build its sequences, one per (prompt, choice); raises a named
        error for bad input. Reads only the engine's fixed configuration, so any thread may call it; what
        depends on the engine's state (queue length, the adapter) is checked by `add_sequences` on the loop
        thread. A structured-output grammar is attached by the caller (`attach_grammar`)."""
        params = request.params
        for token, _ in params.logit_bias:
            if token >= self.vocab_size:
                raise InvalidRequest(
                    f"logit_bias names token {token}; the vocabulary has {self.vocab_size}",
                    param="logit_bias",
                )
        seqs: list[Sequence] = []
        for p, prompt_ids in enumerate(request.prompts):
            if not prompt_ids:
                raise EmptyPrompt()
            if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
                raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
            n = len(prompt_ids)
            room = self.max_model_len - n
            if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
                raise PromptTooLong(n, params.max_tokens or 1, self.max_model_len)
            leader: Sequence | None = None
            for j in range(params.n):
                index = p * params.n + j
                generator = None
                if params.seed is not None:  # each choice its own stream: seed, seed + 1, ...
                    seed = (params.seed + j) % 2**63
                    generator = torch.Generator(device=self.device).manual_seed(seed)
                seq = Sequence(
                    request_id=request.request_id if index == 0 else f"{request.request_id}#{index}",
                    group_id=request.request_id,
                    index=index,
                    leader=leader,
                    prompt_ids=list(prompt_ids),
                    params=params,
                    adapter=request.adapter,
                    max_tokens=room if params.max_tokens is None else params.max_tokens,
                    generator=generator,
                    cache_salt=request.cache_salt,
                    tenant=request.tenant,
                    # The leader computes the prompt's logprobs; its other choices report them and
                    # prefill from its cached blocks instead of recomputing every position.
                    prompt_logprobs=None if params.prompt_logprobs is None or leader else [None],
                )
                leader = leader or seq
                seqs.append(seq)
        if len(seqs) > self.config.max_waiting:
            raise InvalidRequest(
                f"{len(seqs)} choices exceed the engine's queue of {self.config.max_waiting}", param="n"
            )
        return seqs

    @property
    def grammars(self) -> "GrammarCompiler":
        """Compiles structured-output grammars for this model's tokenizer (thread-safe; made on first use,
        cheaply: it converts the tokenizer on its first compile)."""
        with self._grammars_lock:  # callers on several threads must all get the one cache
            if self._grammars is None:
                from deployments.engine.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer, self.vocab_size, sorted(self.loaded.eos_token_ids)
                )
            return self._grammars

    @staticmethod
    def attach_grammar(seqs: list[Sequence], grammar: "CompiledGrammar") -> None:
        for seq in seqs:
            seq.matcher = grammar.matcher()

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Queue one request's sequences; raises a named error if the engine cannot take it now. The
        caller has checked their adapter (`adapters.check`, off the loop thread: it reads the store)."""
        group_id = seqs[0].group_id
        if group_id in self._requests:
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
        self._requests[group_id] = seqs
        for seq in seqs:
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_ids,
                stop=seq.params.stop,
                skip_special_tokens=seq.params.skip_special_tokens,
            )
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
        return self._requests[request_id]

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now, freeing its KV blocks and slot; returns the final outputs of its choices that
        were still running (empty if the request is unknown or already finished)."""
        group = self._requests.get(request_id)
        if group is None:
            return []
        self.aborts += 1
        outputs = []
        for seq in group:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                outputs.append(self._final(seq, ""))
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.adapters.load_pinned()
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_tokens
        outputs: list[RequestOutput] = []
        for seq in plan.failed:
            outputs += self._fail_group(seq, seq.error or RequestFailed())
        if not plan.scheduled:
            return outputs
        sampling = [s for s in plan.scheduled if s.draws]
        prompt_only = [s.seq for s in plan.scheduled if s.samples and not s.draws]  # echo, max_tokens 0
        prompt_rows = [prompt_positions(s.seq, s.seq.num_computed, s.num_tokens) for s in plan.scheduled]
        start = time.perf_counter()
        try:
            logits = self.runner.run(plan.scheduled)
            if any(prompt_rows):
                logits = self._take_prompt_logprobs(logits, plan.scheduled, prompt_rows)
            tokens, logprobs = self._sample(logits, sampling)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # keep serving: fail this step's requests, not the engine
            ids = sorted({s.seq.group_id for s in plan.scheduled})
            log.exception("engine step failed; failing its requests %s", ", ".join(ids))
            return outputs + self._fail(plan.scheduled, RequestFailed("the engine step failed"))
        elapsed = time.perf_counter() - start
        self._account(plan.scheduled, elapsed)
        broken = {id(item) for item, token in zip(sampling, tokens, strict=True) if isinstance(token, str)}
        for item in plan.scheduled:
            if id(item) not in broken:
                item.seq.num_computed += item.num_tokens
                self.blocks.commit(item.seq)
                seq, m = item.seq, item.seq.metrics
                m.prompt_processed = max(m.prompt_processed, min(seq.num_computed, seq.num_prompt_tokens))
        for item, token, logprob in zip(sampling, tokens, logprobs, strict=True):
            if item.seq.is_finished:  # a choice failed earlier in this loop took its group with it
                continue
            if isinstance(token, str):  # only the request whose row could not be sampled fails
                log.warning("request %s: sampling failed: %s", item.seq.group_id, token)
                outputs += self._fail([item], RequestFailed("sampling failed"))
                continue
            try:
                outputs.append(self._append_token(item.seq, token, logprob))
            except Exception:  # its detokenizer or stop check broke: fail this request, not the batch
                log.exception("request %s: taking its sampled token failed", item.seq.group_id)
                outputs += self._fail([item], RequestFailed())
        for seq in prompt_only:  # they end with their prompt
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                outputs.append(self._final(seq, ""))
        return outputs

    def _take_prompt_logprobs(
        self, logits: torch.Tensor, scheduled: list[ScheduledSequence], prompt_rows: list[range]
    ) -> torch.Tensor:
        """Record the prompt logprobs in `logits` (ModelRunner.run's row order); return the sampling rows."""
        row = 0
        sampling_rows: list[int] = []
        for item, positions in zip(scheduled, prompt_rows, strict=True):
            if positions:
                seq = item.seq
                assert seq.prompt_logprobs is not None and seq.params.prompt_logprobs is not None
                chosen = [seq.token_ids[q + 1] for q in positions]
                top = [seq.params.prompt_logprobs] * len(positions)
                seq.prompt_logprobs += token_logprobs(logits[row : row + len(positions)], chosen, top)
                row += len(positions)
            if item.draws:
                sampling_rows.append(row)
                row += 1
        return logits[sampling_rows]

    def _sample(
        self, logits: torch.Tensor, sampling: list[ScheduledSequence]
    ) -> tuple[list[int | str], list[TokenLogprob | None]]:
        """A token per row, or for a row that cannot be sampled the error, so that one request's bad
        parameters never fail its batch neighbours; and each token's logprob where its request asked.
        Logprobs read the raw logits; logit biases and grammar masks then change them in place, and
        only the rows that use them. Tokens and logprobs come back to the host in one read, the step's one
        device->host sync. The per-row retry only runs after a failure (a seeded row may then draw from a
        generator the failed batch call already advanced)."""
        asked = [i for i, s in enumerate(sampling) if s.seq.params.logprobs is not None]
        raw = logits[asked] if asked else None  # [A, V]: a copy (list indexing), before biases and masks
        self._constrain(logits, sampling)
        rows = [self._sampling_row(s.seq) for s in sampling]
        tokens: list[int | str]
        table: list[list[float]] = []
        try:
            chosen = self.sampler.sample_on_device(logits, rows)  # [N] on the device
            fetch = [chosen.double()]
            if raw is not None:
                k = max(sampling[i].seq.params.logprobs or 0 for i in asked)
                fetch.append(logprob_table(raw, chosen[asked], k).flatten())
            flat: list[float] = torch.cat(fetch).tolist()  # the one read back
            tokens = [int(t) for t in flat[: len(rows)]]
            if raw is not None:
                width = (len(flat) - len(rows)) // len(asked)
                table = [flat[len(rows) + r * width : len(rows) + (r + 1) * width] for r in range(len(asked))]
        except Exception:
            log.exception("sampling the step failed; sampling its rows one by one")
            tokens = []
            for i, row in enumerate(rows):
                try:
                    tokens.append(self.sampler.sample(logits[i : i + 1], [row])[0])
                except Exception as error:
                    tokens.append(str(error) or type(error).__name__)
            table = []
        for i, s in enumerate(sampling):  # advance the grammars; a refused token fails only its request
            token = tokens[i]
            if s.seq.matcher is not None and not isinstance(token, str) and not s.seq.matcher.accept(token):
                tokens[i] = f"token {token} is outside the request's grammar"
        logprobs: list[TokenLogprob | None] = [None] * len(sampling)
        if raw is not None:
            good = [i for i in asked if not isinstance(tokens[i], str)]
            if good and not table:  # the batch call failed: the rows that sampled get theirs now
                keep = [asked.index(i) for i in good]
                chosen_ids = [int(tokens[i]) for i in good]
                top = [sampling[i].seq.params.logprobs or 0 for i in good]
                for i, lp in zip(good, token_logprobs(raw[keep], chosen_ids, top), strict=True):
                    logprobs[i] = lp
            elif good:
                rows_of = [table[asked.index(i)] for i in good]
                chosen_ids = [int(tokens[i]) for i in good]
                top = [sampling[i].seq.params.logprobs or 0 for i in good]
                for i, lp in zip(good, read_logprobs(rows_of, chosen_ids, top), strict=True):
                    logprobs[i] = lp
        return tokens, logprobs

    @torch.inference_mode()
    def _constrain(self, logits: torch.Tensor, sampling: list[ScheduledSequence]) -> None:
        """Apply logit biases and grammar masks, in place, to the rows whose requests have them."""
        for i, s in enumerate(sampling):
            bias = s.seq.params.logit_bias
            if bias:
                ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
                values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids, values)
        masked = [i for i, s in enumerate(sampling) if s.seq.matcher is not None]
        if not masked:
            return
        from deployments.engine.grammar import new_bitmask, unpack_bitmask

        bitmask = new_bitmask(len(masked), self.vocab_size)  # [M, ceil(V / 32)] int32, built on the host
        for r, i in enumerate(masked):
            matcher = sampling[i].seq.matcher
            assert matcher is not None
            matcher.fill_mask(bitmask, r)
        index = torch.tensor(masked, dtype=torch.long, device=logits.device)
        allowed = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # [M, V]
        rows = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, index, rows)  # masks applied on the logits' device: nothing read back

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        penalised = seq.params.uses_penalties
        return SamplingRow(
            params=seq.params,
            generator=seq.generator,
            prompt_ids=seq.prompt_ids if penalised else (),
            output_ids=seq.output_ids if penalised else (),
        )

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

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
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
            usage = self.usage_of(self._requests[seq.group_id])
            out = RequestOutput(seq.group_id, text, [token], usage=usage, index=seq.index)
            return self._annotated(self._with_prompt_logprobs(out, seq), seq, logprob)
        if delta_stop is None:  # flush held-back text; it may complete a stop string itself
            text += detok.finish()
            if detok.stop_reason is not None:
                reason, seq.stop_reason = FinishReason.STOP, detok.stop_reason
        self.scheduler.finish(seq, reason)
        out = self._final(seq, text)
        out.token_ids = [token]
        return self._annotated(out, seq, logprob)

    @staticmethod
    def _annotated(out: RequestOutput, seq: Sequence, logprob: TokenLogprob | None) -> RequestOutput:
        if logprob is not None:
            out.logprobs = [logprob]
        return out

    def _final(self, seq: Sequence, text: str) -> RequestOutput:
        """The last output of one choice; the last choice's also ends the request (`finished`)."""
        self._detokenizers.pop(seq.request_id, None)
        group = self._requests.get(seq.group_id, [seq])
        done = all(s.is_finished for s in group)
        if done:
            self._requests.pop(seq.group_id, None)
        out = RequestOutput(
            request_id=seq.group_id,
            text=text,
            finished=done,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            usage=self.usage_of(group),
            error=seq.error,
            index=seq.index,
        )
        return self._with_prompt_logprobs(out, seq)

    @staticmethod
    def _with_prompt_logprobs(out: RequestOutput, seq: Sequence) -> RequestOutput:
        """A choice's first output carries its prompt's logprobs (the leader's, shared by every choice)."""
        shared = seq.shared_prompt_logprobs
        if shared is not None and not seq.prompt_logprobs_sent:
            out.prompt_logprobs, seq.prompt_logprobs_sent = list(shared), True
        return out

    def usage_of(self, seqs: "Sequence | list[Sequence]") -> RequestUsage:
        """What a request (all its choices) has used so far; final once it finished. Each prompt counts
        once, however many choices share it; completions and device time add up over the choices."""
        group = [seqs] if isinstance(seqs, Sequence) else seqs
        now = time.monotonic()
        prompt = cached = completion = preemptions = 0
        gpu = 0.0
        first_token: float | None = None
        for seq in group:
            m = seq.metrics
            completion += seq.num_output_tokens
            gpu += m.gpu_time
            preemptions += m.num_preemptions
            if m.first_token is not None:
                first_token = m.first_token if first_token is None else min(first_token, m.first_token)
            if seq.leader is None:
                # Until its first token a request has used only the prompt it processed (cached blocks
                # included): one aborted in the queue costs nothing, one aborted mid-prefill the chunks that
                # ran.
                processed = max(m.prompt_processed, m.cached_prompt_tokens)
                prompt += seq.num_prompt_tokens if seq.num_output_tokens else processed
                cached += m.cached_prompt_tokens
        first = group[0].metrics
        ends = [s.metrics.finished for s in group]
        end = max(e for e in ends if e is not None) if all(e is not None for e in ends) else now
        return RequestUsage(
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            queue_ms=((first.first_scheduled or end) - first.arrival) * 1e3,
            ttft_ms=None if first_token is None else (first_token - first.arrival) * 1e3,
            total_ms=(end - first.arrival) * 1e3,
            gpu_ms=gpu * 1e3,
            preemptions=preemptions,
            replica=self.replica_name,
        )

    def _fail(self, scheduled: list[ScheduledSequence], error: RequestError) -> list[RequestOutput]:
        outputs = []
        for item in scheduled:
            if not item.seq.is_finished:
                outputs += self._fail_group(item.seq, error)
        return outputs

    def _fail_group(self, failed: Sequence, error: RequestError) -> list[RequestOutput]:
        """A choice that fails fails its whole request: every choice still running ends with the error."""
        outputs = []
        for seq in self._requests.get(failed.group_id, [failed]):
            if seq is failed or not seq.is_finished:
                seq.error = error
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ERROR)
                outputs.append(self._final(seq, ""))
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
            prefill_tokens=self.prefill_tokens,
            adapter_disk_loads=dict(self.adapters.disk_loads),
            grammar_refusals=self._grammars.refusals() if self._grammars is not None else {},
            adapter_load_failures=dict(self.adapters.cpu.load_failures),
            adapter_load_retries=dict(self.adapters.cpu.load_retries),
        )

    def close(self) -> None:
        self.adapters.close()
