"""Scheduler: which sequences run in the next step, and how many of their tokens.

Every step: running decodes first (one token each, so a long prompt never freezes them), then running
prefills in chunks, then waiting requests under the per-step token budget: with scheduling "fair" (the
default) the next sequence of the backlogged tenant with the least weighted service so far (the virtual
token counter of Sheng et al., OSDI 2024), first in first out within a tenant; with "fifo" in arrival
order across tenants. A waiting
request whose adapter is not resident is skipped (it waits only for its own adapter: requests of resident
adapters batch first, while the adapter manager loads the queue's adapters ahead of need and frees slots
by queued demand; the oldest waiter of a cold adapter gets the first slot that frees), and so is a
further choice of a prompt whose first choice has not finished its prefill (it then reuses those blocks).
A prompt that asks for its logprobs (echo) is prefilled in chunks that keep the step's logits rows at
prompt positions within `max_prompt_logprob_rows`, the engine's memory plan for them.
When KV blocks run out, the newest running sequences are preempted (their blocks freed, recomputed later
from the prefix cache), and they go back to the front of the queue (and of their tenant's) so nobody starves.
"""

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from adapters.errors import AdapterError
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.errors import RequestFailed
from deployments.engine.logprobs import prompt_positions
from deployments.engine.outputs import FinishReason
from deployments.engine.sequence import ScheduledSequence, Sequence, SequenceStatus

log = logging.getLogger(__name__)

Scheduling = Literal["fair", "fifo"]

# Service weights per token, for the fair order (Sheng et al. weigh input and output tokens apart too). A
# prompt token computed is the unit. An output token costs about twice as much: it takes a whole decode step
# of its row (memory-bound, one token per weight read) and holds its KV blocks and its row meanwhile, where a
# prompt token shares a compute-bound prefill chunk. A prompt token served from the prefix cache costs no
# forward work, only its blocks: a quarter, so a tenant who reuses a prefix is charged less, but not nothing.
PROMPT_TOKEN_SERVICE = 1.0
CACHED_TOKEN_SERVICE = 0.25
OUTPUT_TOKEN_SERVICE = 2.0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence]  # sorted by adapter slot, base-model sequences last
    failed: list[Sequence] = field(default_factory=list)  # finished with an error while scheduling
    preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        adapters: AdapterManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int,
        adapter_wait_bound_s: float = 0.0,
        max_prompt_logprob_rows: int | None = None,
        scheduling: Scheduling = "fair",
    ) -> None:
        self.blocks = blocks
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prompt_logprob_rows = max_prompt_logprob_rows or max_num_batched_tokens
        self._base_order = max_loras  # sort key putting base-model tokens after every slot
        self.adapter_wait_bound_s = adapter_wait_bound_s
        self.slot_preemptions = 0  # sequences preempted to hand their slot to an overdue adapter
        self.scheduling: Scheduling = scheduling
        self.waiting: deque[Sequence] = deque()  # arrival order, preempted sequences in front
        # The same sequences per tenant, in the same order (kept in step with `waiting`; no empty deques).
        self._queues: dict[str | None, deque[Sequence]] = {}
        # Weighted service each tenant was served (see the *_SERVICE weights), divided by its weight. One
        # float per tenant ever seen: a returning tenant keeps what it was served (lifted, never lowered).
        self.served: dict[str | None, float] = {}
        self._weight: dict[str | None, float] = {}  # each tenant's weight, as its latest request gave it
        self._live: dict[str | None, int] = {}  # sequences per active tenant, waiting or running
        self.running: list[Sequence] = []  # oldest admission first
        self.num_preemptions = 0
        # Keep a few blocks free when admitting, so fresh admissions do not force immediate preemptions.
        self._watermark = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        tenant = seq.tenant
        if (
            tenant not in self._live
        ):  # it becomes active: lifted to the least active counter, no banked credit
            floor = min((self.served[t] for t in self._live), default=0.0)
            self.served[tenant] = max(self.served.get(tenant, 0.0), floor)
            self._live[tenant] = 0
        self._live[tenant] += 1
        self._weight[tenant] = seq.tenant_weight
        self.waiting.append(seq)
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        queue.append(seq)

    def waiting_of(self, tenant: str | None) -> int:
        """Sequences of `tenant` in the waiting queue (queued, or preempted and waiting to resume)."""
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def served_service(self) -> dict[str | None, float]:
        """Weighted service served per tenant so far (prompt, cached-prompt and output tokens at their
        weights, divided by the tenant's weight): the fair order's counters, for metrics."""
        return dict(self.served)

    def _unqueue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        queue = self._queues[seq.tenant]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant]

    def _requeue_front(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)
        queue = self._queues.get(seq.tenant)
        if queue is None:
            queue = self._queues[seq.tenant] = deque()
        queue.appendleft(seq)

    def _leave(self, tenant: str | None) -> None:
        left = self._live[tenant] - 1
        if left:
            self._live[tenant] = left
        else:
            del self._live[tenant]

    @staticmethod
    def _service(seq: Sequence, n: int) -> float:
        """Weighted service of computing the next n tokens of `seq`: prompt positions (and output positions
        recomputed after a preemption) at the prompt weight, the token it then samples at the output
        weight. A decode's one input token was charged as output when it was sampled."""
        start, end = seq.num_computed, seq.num_computed + n
        last = len(seq.token_ids) - 1  # the input of the next decode, already charged if it is an output
        inputs = n
        if end > last >= seq.num_prompt_tokens and start <= last:
            inputs -= 1
        service = inputs * PROMPT_TOKEN_SERVICE
        if end == len(seq.token_ids) and seq.max_tokens > 0:
            service += OUTPUT_TOKEN_SERVICE
        return service

    def _charge(self, seq: Sequence, service: float) -> None:
        tenant = seq.tenant
        self.served[tenant] = self.served.get(tenant, 0.0) + service / self._weight.get(tenant, 1.0)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[])
        budget = self.max_num_batched_tokens
        rows = self.max_prompt_logprob_rows  # logits rows at prompt positions left in this step
        decodes = [s for s in self.running if s.num_uncomputed == 1]
        prefills = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget, rows)
            if n == 0:
                continue
            if self._make_room(seq, n, out):
                out.scheduled.append(ScheduledSequence(seq, n))
                self._charge(seq, self._service(seq, n))
                budget -= n
                rows -= len(prompt_positions(seq, seq.num_computed, n))
        self._admit(budget, rows, out)
        out.scheduled.sort(key=lambda s: s.seq.slot if s.seq.slot >= 0 else self._base_order)
        return out

    @staticmethod
    def _chunk(seq: Sequence, budget: int, rows: int) -> int:
        """Tokens of `seq` to compute now: within the step's budget, and for a prompt whose logprobs it
        gathers, within the logits rows left (each of its positions takes one)."""
        n = min(seq.num_uncomputed, budget)
        return min(n, rows) if seq.collects_prompt_logprobs else n

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of the scheduler for good and free what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._leave(seq.tenant)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self._unqueue(seq)
            self._leave(seq.tenant)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished = time.monotonic()

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Allocate blocks for n more tokens of a running sequence, preempting the newest ones if needed."""
        while not self.blocks.allocate(seq, seq.num_computed + n):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        for planned in out.scheduled:
            if planned.seq is seq:  # it will not run this step after all: not served
                self._charge(seq, -self._service(seq, planned.num_tokens))
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        seq.metrics.queued = time.monotonic()
        self._requeue_front(seq)
        self.num_preemptions += 1
        out.preempted += 1

    def _plan_adapters(self) -> None:
        """Tell the adapter manager what the queue needs and how many tokens each busy slot still owes."""
        queued = [s.adapter for s in self.waiting if s.adapter is not None]
        remaining: dict[int, int] = {}
        for seq in self.running:
            if seq.slot >= 0:
                left = seq.max_tokens - seq.num_output_tokens
                remaining[seq.slot] = max(remaining.get(seq.slot, 0), left)
        self.adapters.plan(queued, remaining)

    def _admit(self, budget: int, rows: int, out: SchedulerOutput) -> None:
        if self.waiting:
            self._plan_adapters()
        overdue_served = False  # at most one slot taken by force per step: bounds the churn
        for seq in self._candidates():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            if seq.leader is not None and not seq.leader.prompt_done:
                continue  # another choice of the same prompt: its prefill will be the leader's cached blocks
            if seq.collects_prompt_logprobs and rows <= 0:
                continue  # this step's logits rows for prompt logprobs are taken; others may still go
            if seq.adapter is not None:
                try:
                    slot = self.adapters.acquire(seq.adapter)
                except AdapterError as error:  # the adapter failed to load: this request cannot be served
                    log.warning("request %s: adapter %s: %s", seq.group_id, seq.adapter, error)
                    self._refuse(seq, error, out)
                    continue
                except Exception:  # a bug in the adapter tiers: fail this request, never the loop
                    log.exception("request %s: acquiring adapter %s failed", seq.group_id, seq.adapter)
                    self._refuse(seq, RequestFailed(), out)
                    continue
                if slot is None and not overdue_served and self._overdue(seq):
                    slot = self._take_slot(seq, out)
                    overdue_served = slot is not None
                if slot is None:
                    continue
                seq.slot = slot
            first = seq.metrics.first_scheduled is None
            cached = 0 if seq.collects_prompt_logprobs else self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget, rows)
            needed = self.blocks.blocks_needed(seq, seq.num_computed + n)
            if needed + self._watermark > self.blocks.num_free_blocks or not self.blocks.allocate(
                seq, seq.num_computed + n
            ):
                self._release(seq)  # out of KV memory: stop admitting, keep arrival order
                return
            if first:
                seq.metrics.first_scheduled = time.monotonic()
                seq.metrics.cached_prompt_tokens = cached
            self._unqueue(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            self._charge(seq, cached * CACHED_TOKEN_SERVICE + self._service(seq, n))
            budget -= n
            rows -= len(prompt_positions(seq, seq.num_computed, n))

    def _candidates(self) -> Iterator[Sequence]:
        """The waiting sequences in the order admission tries them. "fifo": arrival order. "fair": the next
        untried sequence of the tenant with the least served counter (re-read at every pick, so each
        admission's charge counts for the next), first in first out within a tenant; a sequence skipped
        (its adapter not resident, its leader not done) leaves its tenant first in line, so the tenant's
        next sequence is tried. A scan over the waiting tenants per pick: cheap for the tens of tenants a
        replica serves at once; one waiting tenant costs what FIFO does."""
        if self.scheduling == "fifo" or len(self._queues) <= 1:
            yield from list(self.waiting)
            return
        pending = {tenant: iter(list(queue)) for tenant, queue in self._queues.items()}
        served = self.served
        while pending:
            tenant = min(pending, key=served.__getitem__)  # ties: the tenant first queued
            seq = next(pending[tenant], None)
            if seq is None:
                del pending[tenant]
            else:
                yield seq

    def _refuse(self, seq: Sequence, error: AdapterError | RequestFailed, out: SchedulerOutput) -> None:
        seq.error = error
        self.finish(seq, FinishReason.ERROR)
        out.failed.append(seq)

    def _overdue(self, seq: Sequence) -> bool:
        bound = self.adapter_wait_bound_s
        return bound > 0 and time.monotonic() - seq.metrics.waiting_since() >= bound

    def _take_slot(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Free the least wanted busy slot for an overdue request by preempting its running users (they
        requeue at the front and resume from the prefix cache), then give it the slot."""
        assert seq.adapter is not None
        victim = self.adapters.slot_to_free(seq.adapter, min_age_s=self.adapter_wait_bound_s)
        if victim is None:
            return None
        for user in [s for s in self.running if s.slot == victim]:
            self._preempt(user, out)
            self.slot_preemptions += 1
        return self.adapters.acquire(seq.adapter)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq)
        if seq.slot >= 0:
            self.adapters.release(seq.slot)
            seq.slot = -1
