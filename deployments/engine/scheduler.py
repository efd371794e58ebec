"""Scheduler: which sequences run in the next step, and how many of their tokens.

Every step: running decodes first (one token each, so a long prompt never freezes them), then running
prefills in chunks, then waiting requests in arrival order under the per-step token budget. A waiting
request whose adapter is not resident is skipped (it waits only for its own adapter: requests of resident
adapters batch first, while the adapter manager loads the queue's adapters ahead of need and frees slots
by queued demand; the oldest waiter of a cold adapter gets the first slot that frees), and so is a
further choice of a prompt whose first choice has not finished its prefill (it then reuses those blocks).
A prompt that asks for its logprobs (echo) is prefilled in chunks that keep the step's logits rows at
prompt positions within `max_prompt_logprob_rows`, the engine's memory plan for them.
When KV blocks run out, the newest running sequences are preempted (their blocks freed, recomputed later
from the prefix cache), and they go back to the front of the queue so nobody starves.
"""

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from adapters.errors import AdapterError
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.errors import RequestFailed
from deployments.engine.logprobs import prompt_positions
from deployments.engine.outputs import FinishReason
from deployments.engine.sequence import ScheduledSequence, Sequence, SequenceStatus

log = logging.getLogger(__name__)


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
    ) -> None:
        self.blocks = blocks
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prompt_logprob_rows = max_prompt_logprob_rows or max_num_batched_tokens
        self._base_order = max_loras  # sort key putting base-model tokens after every slot
        self.adapter_wait_bound_s = adapter_wait_bound_s
        self.slot_preemptions = 0  # sequences preempted to hand their slot to an overdue adapter
        self.waiting: deque[Sequence] = deque()
        self._waiting_by_tenant: Counter[str | None] = Counter()  # kept in step with `waiting`
        self.running: list[Sequence] = []  # oldest admission first
        self.num_preemptions = 0
        # Keep a few blocks free when admitting, so fresh admissions do not force immediate preemptions.
        self._watermark = max(1, blocks.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._waiting_by_tenant[seq.tenant] += 1

    def waiting_of(self, tenant: str | None) -> int:
        """Sequences of `tenant` in the waiting queue (queued, or preempted and waiting to resume)."""
        return self._waiting_by_tenant[tenant]

    def _unqueue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._waiting_by_tenant[seq.tenant] -= 1
        if not self._waiting_by_tenant[seq.tenant]:
            del self._waiting_by_tenant[seq.tenant]

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
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self._unqueue(seq)
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
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        seq.metrics.queued = time.monotonic()
        self.waiting.appendleft(seq)
        self._waiting_by_tenant[seq.tenant] += 1
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
        for seq in list(self.waiting):
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
            budget -= n
            rows -= len(prompt_positions(seq, seq.num_computed, n))

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
