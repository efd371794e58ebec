"""Sequence: one request's state inside the engine, from arrival to finish; ScheduledSequence: its part of
one step (the scheduler's plan, the model side's input)."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from adapters.ref import AdapterRef
from deployments.engine.errors import BudgetTooSmall, RequestError
from deployments.engine.outputs import FinishReason, TokenLogprob
from deployments.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deployments.engine.grammar.compiler import CompiledGrammar, GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and an adapter slot
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceMetrics:
    """What metering needs. Times are time.monotonic() seconds; gpu_time is seconds of device busy time."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    gpu_time: float = 0.0
    cached_prompt_tokens: int = 0
    prompt_processed: int = 0  # most prompt tokens ever in the KV cache (preemption resets num_computed)
    num_preemptions: int = 0
    queued: float | None = None  # when it last entered the waiting queue (arrival, or its preemption)
    admitted: float | None = None  # when it last took a row (first admission, or resuming after preemption)
    admitted_outputs: int = 0  # its output tokens then
    # Host work done for this sequence alone in the current step's timed part (its grammar mask and
    # closing, its prompt logprobs): charged to it whole, not split with its neighbours (LLMEngine._account).
    step_host_time: float = 0.0

    def waiting_since(self) -> float:
        return self.arrival if self.queued is None else self.queued


@dataclass(slots=True, eq=False)
class Sequence:
    """One choice of one prompt. A request with n choices or several prompts is a group of sequences
    sharing `group_id` (the request's id); `request_id` is unique per sequence."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None
    max_tokens: int  # params.max_tokens, clamped to the context left after the prompt
    generator: torch.Generator | None = None
    cache_salt: str | None = None  # prefix-cache scope, e.g. the tenant: no sharing across salts
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of the leading full, computed blocks
    slot: int = -1  # device adapter slot while running; -1: base model
    lora_pages: int = 0  # pages of adapter memory from `slot` on (lora_layers.py)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: RequestError | None = None  # why it finished with FinishReason.ERROR
    metrics: SequenceMetrics = field(default_factory=lambda: SequenceMetrics(arrival=time.monotonic()))
    group_id: str = ""  # the EngineRequest's id; defaults to request_id
    index: int = 0  # the choice number within the group (prompt number * n + choice)
    # The first choice of the same prompt: this one waits until the leader's prompt is in the KV cache, so
    # its prefill is a prefix-cache hit (n choices, one prefill).
    leader: Optional["Sequence"] = None
    matcher: Optional["GrammarMatcher"] = None  # structured output: the grammar state
    # Prompt logprobs gathered so far (entry 0 is None: the first token has no context); None: not asked,
    # or not this sequence's to gather: a prompt's leader computes them once for all its choices.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    tenant: str | None = None  # whom it is for (EngineRequest.tenant): the waiting queue's fair share
    max_gpu_ms: float | None = None  # its request's GPU-time bound (EngineRequest.max_gpu_ms), the group's
    tenant_weight: float = 1.0  # its tenant's share in the fair order (EngineRequest.tenant_weight)
    batch: bool = False  # its request's priority is "batch": rows only when no interactive one wants them

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def prompt_done(self) -> bool:
        """The whole prompt has been in the KV cache (and its blocks registered), or the sequence ended."""
        return self.is_finished or self.metrics.prompt_processed >= self.num_prompt_tokens

    @property
    def shared_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt logprobs this choice reports: its leader's (its own, if it leads); None: not asked."""
        return (self.leader or self).prompt_logprobs

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Still needs logits at prompt positions: it asked for prompt logprobs and has not all of them. Such
        a sequence skips the prefix cache, whose blocks have no logits."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True)
class ScheduledSequence:
    """A sequence the scheduler chose for the next step, and how many of its tokens run in it."""

    seq: Sequence
    num_tokens: int  # new tokens this step: 1 for a decode, a chunk for a prefill

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token, so the step yields its next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)

    @property
    def draws(self) -> bool:
        """True when the step samples a token for it (a prompt-only request, max_tokens 0, never does)."""
        return self.samples and self.seq.max_tokens > 0


def attach_grammar(seqs: list[Sequence], grammar: "CompiledGrammar") -> None:
    """Give each sequence its grammar state; raises BudgetTooSmall (nothing attached) when the output
    could not complete within the sequences' max_tokens (every choice has the same)."""
    minimum = grammar.min_tokens
    if minimum is not None and seqs and seqs[0].max_tokens < minimum:
        raise BudgetTooSmall(seqs[0].max_tokens, minimum)
    for seq in seqs:
        seq.matcher = grammar.matcher()
