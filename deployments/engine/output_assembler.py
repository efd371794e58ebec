"""OutputAssembler: sampled tokens in, RequestOutputs out — appending, detokenizing, finishing, usage.

It holds each request's choices (a request is the group of its sequences) and each choice's detokenizer from
admission to its last output. A choice ends on EOS, a stop token or string, its max_tokens or the context,
or when its request's GPU time reaches the request's bound (max_gpu_ms); the last choice of a request marks
the request finished. Every output carries the request's usage so far, so a client that leaves mid-stream
is billed what the engine had done. A choice that fails fails its group.
"""

import logging
import time

from transformers import PreTrainedTokenizerBase

from deployments.engine.detokenizer import IncrementalDetokenizer
from deployments.engine.errors import RequestError, RequestFailed
from deployments.engine.outputs import FinishReason, RequestOutput, RequestUsage, TokenLogprob
from deployments.engine.scheduler import Scheduler
from deployments.engine.sequence import ScheduledSequence, Sequence, SequenceStatus

log = logging.getLogger(__name__)


class OutputAssembler:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: PreTrainedTokenizerBase,
        *,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        replica_name: str,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.replica_name = replica_name
        self.groups: dict[str, list[Sequence]] = {}  # request id -> its choices
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.generated_tokens = 0  # every output token sampled, aborted requests' included

    def register(self, seqs: list[Sequence]) -> None:
        self.groups[seqs[0].group_id] = seqs
        for seq in seqs:
            self._detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_ids,
                # A structured output ends where its grammar completes: a stop string never cuts it (none
                # could match after it either, as only the stop token may follow the completed match).
                # A triggered one's free text stops as any text does, until its first block begins.
                stop=seq.params.stop if _free(seq) else (),
                skip_special_tokens=seq.params.skip_special_tokens,
                min_tokens=seq.params.min_tokens,
            )

    def step_outputs(
        self,
        sampling: list[ScheduledSequence],
        tokens: list[int | str],
        logprobs: list[TokenLogprob | None],
        prompt_only: list[Sequence],
    ) -> list[RequestOutput]:
        """What one step produced: a token (or the error of a row that could not be sampled) per sampling
        row, and the end of every prompt-only choice (echo with max_tokens 0) whose prompt just ran."""
        outputs: list[RequestOutput] = []
        for item, token, logprob in zip(sampling, tokens, logprobs, strict=True):
            seq = item.seq
            if seq.status is SequenceStatus.FINISHED:  # a choice failed earlier in this loop took its group
                continue
            if isinstance(token, str):  # only the request whose row could not be sampled fails
                log.warning("request %s: sampling failed: %s", seq.group_id, token)
                outputs += self.fail_group(seq, RequestFailed("sampling failed"))
                continue
            try:
                outputs.append(self.append_token(seq, token, logprob))
            except Exception:  # its detokenizer or stop check broke: this request, not the batch
                log.exception("request %s: taking its sampled token failed", seq.group_id)
                outputs += self.fail_group(seq, RequestFailed())
        for seq in prompt_only:  # they end with their prompt
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.LENGTH)
                outputs.append(self.final(seq, ""))
        return outputs

    def append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        seq.token_ids.append(token)
        self.generated_tokens += 1
        if seq.metrics.first_token is None:
            seq.metrics.first_token = time.monotonic()
        detok = self._detokenizers[seq.request_id]
        params = seq.params
        reason: FinishReason | None = None
        delta_stop: str | int | None = None
        text = ""
        free = params.structured is None or _free(seq)
        if not free and detok.has_stops:  # a triggered grammar's block began with this token
            detok.drop_stops()
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = FinishReason.STOP
        elif token in params.stop_token_ids and free:  # as stop strings, above
            reason, seq.stop_reason = FinishReason.STOP, token
        else:
            delta = detok.add_token(token)
            text, delta_stop = delta.text, delta.stop_reason
            if delta_stop is not None:
                reason, seq.stop_reason = FinishReason.STOP, delta_stop
        length = len(seq.token_ids)
        if reason is None and (
            length - len(seq.prompt_ids) >= seq.max_tokens or length >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        if reason is None:
            # Every output carries the usage so far: if the client goes away mid-stream, the ingress
            # bills what the engine had processed up to the last output it received.
            usage = self.usage_of(self.groups[seq.group_id])
            out = RequestOutput(seq.group_id, text, [token], usage=usage, index=seq.index)
            if not seq.prompt_logprobs_sent:
                _with_prompt_logprobs(out, seq)
            if logprob is not None:
                out.logprobs = [logprob]
            return out
        if delta_stop is None:  # flush held-back text; it may complete a stop string itself
            text += detok.finish()
            if detok.stop_reason is not None:
                reason, seq.stop_reason = FinishReason.STOP, detok.stop_reason
        self.scheduler.finish(seq, reason)
        out = self.final(seq, text)
        out.token_ids = [token]
        return _annotated(out, logprob)

    def stop_spent(self, scheduled: list[ScheduledSequence]) -> list[RequestOutput]:
        """End each request of this step whose GPU time reached its bound: every choice still running or
        waiting finishes as LENGTH (gpu_limited), its held-back text flushed. The step that crosses the
        bound has run already; usage_of charges only up to the bound, so the excess is the platform's."""
        outputs: list[RequestOutput] = []
        bounded = [item.seq.group_id for item in scheduled if item.seq.max_gpu_ms is not None]
        for group_id in dict.fromkeys(bounded):
            group = self.groups.get(group_id)
            bound = None if not group else group[0].max_gpu_ms
            if group is None or bound is None or sum(s.metrics.gpu_time for s in group) * 1e3 < bound:
                continue
            for seq in group:
                if not seq.is_finished:
                    outputs.append(self._stop_at_bound(seq))
        return outputs

    def _stop_at_bound(self, seq: Sequence) -> RequestOutput:
        detok = self._detokenizers.get(seq.request_id)
        text = "" if detok is None else detok.finish()
        reason = FinishReason.LENGTH
        if detok is not None and detok.stop_reason is not None:  # the flushed text completed a stop string
            reason, seq.stop_reason = FinishReason.STOP, detok.stop_reason
        self.scheduler.finish(seq, reason)
        return self.final(seq, text, gpu_limited=reason is FinishReason.LENGTH)

    def final(self, seq: Sequence, text: str, *, gpu_limited: bool = False) -> RequestOutput:
        """The last output of one choice; the last choice's also ends the request (`finished`)."""
        self._detokenizers.pop(seq.request_id, None)
        group = self.groups.get(seq.group_id, [seq])
        done = all(s.is_finished for s in group)
        if done:
            self.groups.pop(seq.group_id, None)
        out = RequestOutput(
            request_id=seq.group_id,
            text=text,
            finished=done,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            usage=self.usage_of(group),
            error=seq.error,
            index=seq.index,
            closing_forced=seq.matcher is not None and seq.matcher.steered,
            gpu_limited=gpu_limited,
        )
        return _with_prompt_logprobs(out, seq)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """The final outputs of a request's choices still running, each ended as ABORT."""
        outputs = []
        for seq in self.groups.get(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
                outputs.append(self.final(seq, ""))
        return outputs

    def fail(self, scheduled: list[ScheduledSequence], error: RequestError) -> list[RequestOutput]:
        outputs = []
        for item in scheduled:
            if not item.seq.is_finished:
                outputs += self.fail_group(item.seq, error)
        return outputs

    def fail_group(self, failed: Sequence, error: RequestError) -> list[RequestOutput]:
        """A choice that fails fails its whole request: every choice still running ends with the error (what
        the tenant sees; the cause is logged where it happened)."""
        outputs = []
        for seq in self.groups.get(failed.group_id, [failed]):
            if seq is failed or not seq.is_finished:
                seq.error = error
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ERROR)
                outputs.append(self.final(seq, ""))
        return outputs

    def usage_of(self, seqs: "Sequence | list[Sequence]") -> RequestUsage:
        """What a request (all its choices) has used so far; final once it finished. Each prompt counts
        once, however many choices share it; completions and device time add up over the choices."""
        group = [seqs] if isinstance(seqs, Sequence) else seqs
        prompt = cached = completion = preemptions = 0
        gpu = 0.0
        first_token: float | None = None
        end: float | None = None  # the last choice's finish; None while one runs (one pass: every output)
        running = False
        for seq in group:
            m = seq.metrics
            completion += len(seq.token_ids) - len(seq.prompt_ids)
            gpu += m.gpu_time
            preemptions += m.num_preemptions
            if m.first_token is not None and (first_token is None or m.first_token < first_token):
                first_token = m.first_token
            if m.finished is None:
                running = True
            elif end is None or m.finished > end:
                end = m.finished
            if seq.leader is None:
                # Until its first token a request has used only the prompt it processed (cached blocks
                # included): one aborted in the queue costs nothing, one aborted mid-prefill the chunks that
                # ran.
                processed = max(m.prompt_processed, m.cached_prompt_tokens)
                prompt += seq.num_prompt_tokens if len(seq.token_ids) > len(seq.prompt_ids) else processed
                cached += m.cached_prompt_tokens
        if running or end is None:
            end = time.monotonic()
        first = group[0].metrics
        bound = group[0].max_gpu_ms  # charged at most: the step that crossed it ran past it (stop_spent)
        gpu_ms = gpu * 1e3 if bound is None else min(gpu * 1e3, bound)
        return RequestUsage(
            prompt_tokens=prompt,
            cached_prompt_tokens=cached,
            completion_tokens=completion,
            queue_ms=((first.first_scheduled or end) - first.arrival) * 1e3,
            ttft_ms=None if first_token is None else (first_token - first.arrival) * 1e3,
            total_ms=(end - first.arrival) * 1e3,
            gpu_ms=gpu_ms,
            preemptions=preemptions,
            replica=self.replica_name,
        )


def _free(seq: Sequence) -> bool:
    """Whether stop strings and ids may end the output now: it is not structured, or is in the free text
    before a triggered grammar's first block (tool_choice "auto" before a call)."""
    structured = seq.params.structured
    if structured is None:
        return True
    return structured.triggered and (seq.matcher is None or seq.matcher.free)


def _annotated(out: RequestOutput, logprob: TokenLogprob | None) -> RequestOutput:
    if logprob is not None:
        out.logprobs = [logprob]
    return out


def _with_prompt_logprobs(out: RequestOutput, seq: Sequence) -> RequestOutput:
    """A choice's first output carries its prompt's logprobs (the leader's, shared by every choice)."""
    shared = seq.shared_prompt_logprobs
    if shared is not None and not seq.prompt_logprobs_sent:
        out.prompt_logprobs, seq.prompt_logprobs_sent = list(shared), True
    return out
