"""Scheduler: which sequences run in the next step, and how many of their tokens.

Every step: running decodes first (one token each, so a long prompt never freezes them), then running
prefills in chunks, then waiting requests under the per-step token budget: with scheduling "fair" (the
default) the next sequence of the backlogged tenant with the least weighted service so far (the virtual
token counter of Sheng et al., OSDI 2024), first in first out within a tenant; with "fifo" in arrival
order across tenants. A waiting
request whose adapter is not resident is skipped (it waits only for its own adapter: requests of resident
adapters batch first). Adapters without a usable slot wait in a rotation (adapter_rotation.py: class, then
least-served tenant, then round robin among adapters, an adapter that just gave up its slot joining at the
back): only the next ones in the rotation may claim slots that free, the adapter manager loads them into
CPU memory ahead of need and drains slots for them, and a slot keeps its adapter for
`adapter_min_residency_s` while it has requests queued. A further choice of a prompt whose
first choice has not finished its prefill is skipped too (it then reuses those blocks).
A prompt that asks for its logprobs (echo) is prefilled in chunks that keep the step's logits rows at
prompt positions within `max_prompt_logprob_rows`, the engine's memory plan for them.
When KV blocks run out, the newest running sequences are preempted (their blocks freed, recomputed later
from the prefix cache), and they go back to the front of the queue (and of their tenant's) so nobody starves.
"""

import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from adapters.errors import AdapterError
from adapters.ref import AdapterRef
from deployments.engine.adapter_rotation import AdapterRotation
from deployments.engine.adapter_tiers.manager import AdapterManager
from deployments.engine.block_manager import BlockManager
from deployments.engine.errors import RequestFailed
from deployments.engine.logprobs import prompt_positions
from deployments.engine.outputs import FinishReason
from deployments.engine.sequence import ScheduledSequence, Sequence, SequenceStatus
from deployments.engine.step_cost import StepCost, StepFit

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
# Beside interactive work the batch class gets a token at least this often even when its share of the
# steps' time is spent (a zero batch_step_slack), so a batch always progresses.
BATCH_FLOOR_STEPS = 16
FAIR_MIN_RUN_TOKENS = 8  # tokens a sequence decodes after taking a row before a fair preemption may take it


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
        lora_pages: int,
        adapter_wait_bound_s: float = 0.0,
        adapter_min_residency_s: float = 0.0,
        max_prompt_logprob_rows: int | None = None,
        scheduling: Scheduling = "fair",
        fair_wait_bound_s: float = 0.0,
        batch_step_tokens: int | None = None,
        batch_step_slack: float | None = None,
        batch_interactive_window_s: float = 0.0,
    ) -> None:
        self.blocks = blocks
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prompt_logprob_rows = max_prompt_logprob_rows or max_num_batched_tokens
        self._base_order = lora_pages  # sort key putting base-model tokens after every slot
        self.adapter_wait_bound_s = adapter_wait_bound_s
        self.adapter_min_residency_s = adapter_min_residency_s
        self.slot_preemptions = 0  # sequences preempted to hand their slot to an overdue adapter
        self.scheduling: Scheduling = scheduling
        self.fair_wait_bound_s = fair_wait_bound_s
        self.fair_preemptions = 0  # sequences preempted for a tenant past fair_wait_bound_s
        self.batch_preemptions = 0  # batch sequences preempted for a waiting interactive one
        # Batch-class tokens a step may compute beside interactive work (None: no cap), and this step's left.
        self.batch_step_tokens = batch_step_tokens
        # And within that, what keeps the step within 1 + slack of its interactive work's own time, by this
        # replica's measure of its steps (None: the count alone). The engine feeds `step_cost`.
        self.batch_step_slack = batch_step_slack
        self.step_cost = StepCost()
        # For this long after interactive work was last in a step's queue, batch-only steps stay as small as
        # beside it: an interactive arrival waits for the step under way, and a whole step of batch prefill
        # would be its TTFT's tail.
        self.batch_interactive_window_s = batch_interactive_window_s
        self._interactive_seen = float("-inf")
        self._interactive_adapters: dict[AdapterRef, float] = {}  # adapter -> last seen in interactive work
        self._batch_budget = max_num_batched_tokens
        # The fit pricing the batch class's time in this step (None: no bound from time; read once a step,
        # as the fit moves only after it), and the time the class may still add.
        self._batch_cost: StepFit | None = None
        self._batch_seconds = 0.0
        self._batch_share = 0.0  # this step's own share, without what earlier steps carried
        self._batch_credit = 0.0  # the share carried to the next step (< 0: owed for a floor's token)
        self._batch_scheduled = False  # a batch-class token is in this step
        self._batch_starved = 0  # steps in a row beside interactive work without a batch-class token
        self._batch_waiting = 0  # waiting sequences of the batch class (kept in step with `waiting`)
        self.waiting: deque[Sequence] = deque()  # arrival order, preempted sequences in front
        # The same sequences per tenant, in the same order (kept in step with `waiting`; no empty deques).
        self._queues: dict[str | None, deque[Sequence]] = {}
        self.rotation = AdapterRotation()  # the same sequences per adapter, and who gets the next slot
        self.rotation_order: list[AdapterRef] = []  # the rotation at the last pass, next first (stats)
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
        self.rotation.append(seq)
        self._batch_waiting += seq.batch
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

    def waiting_by_tenant(self) -> dict[str | None, tuple[int, float]]:
        """Per tenant with sequences waiting: how many, and when its oldest entered the queue (monotonic)."""
        return {
            tenant: (len(queue), min(s.metrics.waiting_since() for s in queue))
            for tenant, queue in self._queues.items()
        }

    def preemptions_by_reason(self) -> dict[str, int]:
        """Sequences preempted since start: for KV blocks, for an overdue adapter's slot, for a tenant
        past the fair wait bound."""
        taken = self.slot_preemptions + self.fair_preemptions + self.batch_preemptions
        return {
            "kv": self.num_preemptions - taken,
            "adapter_slot": self.slot_preemptions,
            "fair": self.fair_preemptions,
            "batch": self.batch_preemptions,
        }

    def _unqueue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.rotation.remove(seq)
        self._batch_waiting -= seq.batch
        queue = self._queues[seq.tenant]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.tenant]

    def _requeue_front(self, seq: Sequence) -> None:
        self.waiting.appendleft(seq)
        self.rotation.appendleft(seq)
        self._batch_waiting += seq.batch
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
        later: list[Sequence] = []  # batch prefills, while interactive sequences wait: after admission
        interactive_waits = len(self.waiting) > self._batch_waiting
        beside_interactive = interactive_waits or any(not s.batch for s in self.running)
        now = time.monotonic()
        if beside_interactive:
            self._interactive_seen = now
        recent = now - self._interactive_seen < self.batch_interactive_window_s
        self._batch_budget, self._batch_cost, self._batch_scheduled = budget, None, False
        if (beside_interactive or recent) and self.batch_step_tokens is not None:
            self._batch_budget = self.batch_step_tokens
            allowance = self._batch_allowance(budget, decodes, prefills)
            if allowance is not None:
                self._batch_cost, self._batch_share = allowance
                self._batch_seconds = self._batch_share + self._batch_credit
        if interactive_waits and any(s.batch for s in prefills):
            later = [s for s in prefills if s.batch]
            prefills = [s for s in prefills if not s.batch]
        for seq in decodes + prefills:
            budget, rows = self._continue(seq, budget, rows, out)
        budget, rows = self._admit(budget, rows, out)
        for seq in later:
            budget, rows = self._continue(seq, budget, rows, out)
        self._carry_batch_share()
        out.scheduled.sort(key=lambda s: s.seq.slot if s.seq.slot >= 0 else self._base_order)
        return out

    def _batch_allowance(
        self, budget: int, decodes: list[Sequence], prefills: list[Sequence]
    ) -> tuple[StepFit, float] | None:
        """The replica's fit of its steps and the time the batch class may add to a step beside interactive
        work (or soon after it): what keeps the step within `1 + batch_step_slack` of the time of the
        interactive tokens and sampled rows it may hold (running and waiting, within the step's budget; none
        soon after); None (the token cap alone) without a slack, before the fit is known, or when work
        costs nothing measurable."""
        fitted = self.step_cost.fit() if self.batch_step_slack is not None else None
        if fitted is None or self.batch_step_slack is None:
            return None
        tokens = rows = 0
        for seq in decodes:
            if not seq.batch:
                tokens, rows = tokens + 1, rows + 1
        for seq in [s for s in prefills if not s.batch] + [s for s in self.waiting if not s.batch]:
            if tokens >= budget:
                break
            n = min(seq.num_uncomputed, budget - tokens)
            tokens, rows = tokens + n, rows + (n == seq.num_uncomputed)
        seconds = fitted.allowance(tokens, rows, self.batch_step_slack)
        return None if seconds is None else (fitted, seconds)

    def _continue(self, seq: Sequence, budget: int, rows: int, out: SchedulerOutput) -> tuple[int, int]:
        """Schedule a running sequence's next tokens (within the budget and rows left); both as left after."""
        if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
            return budget, rows
        n = self._chunk(seq, budget, rows)
        if n == 0 or not self._make_room(seq, n, out):
            return budget, rows
        self._schedule(seq, n, out)
        self._charge(seq, self._service(seq, n))
        return budget - n, rows - len(prompt_positions(seq, seq.num_computed, n))

    def _chunk(self, seq: Sequence, budget: int, rows: int) -> int:
        """Tokens of `seq` to compute now: within the step's budget, for a batch-class sequence within that
        class's share of the step left (`batch_step_tokens`, and the time `_batch_allowance` left), and for
        a prompt whose logprobs it gathers, within the logits rows left (each of its positions takes one)."""
        n = min(seq.num_uncomputed, budget)
        if seq.batch:
            n = self._batch_fit(seq, min(n, self._batch_budget))
        return min(n, rows) if seq.collects_prompt_logprobs else n

    def _carry_batch_share(self) -> None:
        """Carry what the batch class left of its share to the next step: a token that cost more than the
        share (a CPU's decode row can cost twice a step's 10%) is owed and repaid by the next steps, so the
        class adds its slack of the steps' time on average, not a row to every step; unspent time carries
        up to one step's share (no burst after quiet steps)."""
        if self._batch_cost is None:
            self._batch_credit, self._batch_starved = 0.0, 0
            return
        self._batch_credit = min(self._batch_seconds, self._batch_share)
        self._batch_starved = 0 if self._batch_scheduled else self._batch_starved + 1

    def _batch_fit(self, seq: Sequence, n: int) -> int:
        """At most `n` of a batch-class sequence's tokens, within the time its class may still add to this
        step: a chunk that would end the prompt also costs its sampled row, so it stops a token short when
        only the tokens fit. While the class's share is not overdrawn, its first token of a step goes even
        if it costs more (the excess is owed: `_carry_batch_share`); at least every BATCH_FLOOR_STEPS steps
        one goes regardless: a batch always progresses."""
        cost = self._batch_cost
        if cost is None or n <= 0:
            return n
        left = self._batch_seconds
        if n == seq.num_uncomputed and cost.added(n, 1) <= left:
            fits = n
        else:
            fits = min(n, int(left / cost.per_token)) if cost.per_token > 0 else n
            if fits == seq.num_uncomputed:
                fits -= 1  # the tokens fit, not the row they end in
        floor = not self._batch_scheduled and (left > 0 or self._batch_starved >= BATCH_FLOOR_STEPS)
        return max(fits, 1 if floor else 0)

    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        """Put `n` of `seq`'s tokens in this step, out of the batch class's share when it is a batch's."""
        out.scheduled.append(ScheduledSequence(seq, n))
        if seq.batch:
            self._batch_budget -= n
            self._batch_scheduled = True
            if self._batch_cost is not None:
                self._batch_seconds -= self._batch_cost.added(n, n == seq.num_uncomputed)

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
        """Allocate blocks for n more tokens of a running sequence, preempting if needed: the newest
        sequence (fifo), or the newest of the most served tenant running (fair)."""
        while not self.blocks.allocate(seq, seq.num_computed + n):
            victim = self._newest_batch()
            if victim is None and self.scheduling == "fair":
                victim = self._victim()
            victim = victim if victim is not None else self.running[-1]
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

    def _plan_adapters(self) -> list[AdapterRef]:
        """Tell the adapter manager what the queue needs (the rotation first) and how many tokens each busy
        slot still owes. Returns the adapters whose sequences may claim a slot in this pass: the first of
        the rotation not in a slot, as many as slots could be claimed now (at least one, which drains one)."""
        slots = self.adapters.slots
        order = self.rotation.order(
            slots.resident(),
            lambda ref: slots.lookup(ref) is not None,
            (lambda tenant: self.served.get(tenant, 0.0)) if self.scheduling == "fair" else None,
        )
        self.rotation_order = order
        queued = [s.adapter for s in self.waiting if s.adapter is not None]
        remaining: dict[int, int] = {}
        for seq in self.running:
            if seq.slot >= 0:
                left = seq.max_tokens - seq.num_output_tokens
                remaining[seq.slot] = max(remaining.get(seq.slot, 0), left)
        waited_for = frozenset(s.adapter for s in self.waiting if not s.batch and s.adapter is not None)
        wanted = waited_for | {s.adapter for s in self.running if not s.batch and s.adapter is not None}
        self.adapters.plan(queued, remaining, order, self._interactive_refs(wanted), waited_for, wanted)
        cold = [ref for ref in order if not slots.holds(ref)]  # a draining one waits for its slot to free
        return cold[: max(1, self.adapters.claimable_count(cold))]

    def _interactive_refs(self, current: frozenset[AdapterRef]) -> frozenset[AdapterRef]:
        """The adapters interactive sequences run or wait for (`current`), or did within
        batch_interactive_window_s: the batch class never takes their slots."""
        now = time.monotonic()
        seen = self._interactive_adapters
        for ref in [r for r, at in seen.items() if now - at >= self.batch_interactive_window_s]:
            del seen[ref]
        seen.update(dict.fromkeys(current, now))
        return frozenset(seen)

    def _newest_batch(self) -> Sequence | None:
        return next((s for s in reversed(self.running) if s.batch), None)

    def _victim(
        self,
        other_than: str | None = None,
        below: float | None = None,
        batch: bool = False,
        admitted_before: float | None = None,
    ) -> Sequence | None:
        """The newest running sequence of the running tenant served most (other than `other_than`, served
        more than `below`, of the batch class if `batch`, holding its row since before `admitted_before`),
        or None."""
        served = self.served
        victim: Sequence | None = None
        for seq in reversed(self.running):  # newest first: a tenant's newest is met first
            tenant = seq.tenant
            if tenant == other_than or (below is not None and served[tenant] <= below):
                continue
            if batch and not seq.batch:
                continue
            if admitted_before is not None and not self._held_its_row(seq, admitted_before):
                continue
            if victim is None or served[tenant] > served[victim.tenant]:
                victim = seq
        return victim

    @staticmethod
    def _held_its_row(seq: Sequence, since: float) -> bool:
        """Admitted before `since` and FAIR_MIN_RUN_TOKENS decoded since: only then a fair victim."""
        metrics = seq.metrics
        return (metrics.admitted or 0.0) <= since and (
            seq.num_output_tokens - metrics.admitted_outputs >= FAIR_MIN_RUN_TOKENS
        )

    def _make_row(self, out: SchedulerOutput) -> None:
        """All rows are taken. The next waiting sequence is interactive and batch ones run: preempt the
        newest batch sequences, one for each interactive sequence waiting, at once (one a step made the
        fourth of four arrivals wait four steps). Or (fair) the next waited past fair_wait_bound_s: preempt
        the newest sequence of the most served other tenant (served more than the waiter's tenant; of the
        batch class for a batch waiter) for it."""
        head = next(self._candidates(), None)
        if head is None:
            return
        if not head.batch:
            preempted = 0
            while preempted < len(self.waiting) - self._batch_waiting:
                victim = self._newest_batch()
                if victim is None:
                    break
                self._preempt(victim, out)
                self.batch_preemptions += 1
                preempted += 1
            if preempted:
                return
        bound, now = self.fair_wait_bound_s, time.monotonic()
        if bound <= 0 or self.scheduling != "fair" or now - head.metrics.waiting_since() < bound:
            return
        # A row taken is kept for the bound and a few tokens: the preempted tenant, waiting past the bound
        # when steps are slow, would otherwise take it straight back (lifted to the least counter, a newly
        # active tenant passes the others by its prompt), and so on at every step.
        below, since = self.served[head.tenant], now - bound
        victim = self._victim(other_than=head.tenant, below=below, batch=head.batch, admitted_before=since)
        if victim is not None:
            self._preempt(victim, out)
            self.fair_preemptions += 1

    def _admit(self, budget: int, rows: int, out: SchedulerOutput) -> tuple[int, int]:
        """Admit waiting sequences, in `_candidates` order, while rows, budget and KV blocks last; the budget
        and rows left after."""
        if self.waiting and len(self.running) >= self.max_num_seqs:
            self._make_row(out)  # at most one a step: bounds the churn
        turn = self._plan_adapters() if self.waiting else []
        self.adapters.wait_for_reads(turn)  # a quick read just started for the turn: its request goes now
        overdue_served = False  # at most one slot taken by force per step: bounds the churn
        batch_slot_taken = False  # and at most one from the batch class
        for seq in self._candidates():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                return budget, rows
            if seq.leader is not None and not seq.leader.prompt_done:
                continue  # another choice of the same prompt: its prefill will be the leader's cached blocks
            if seq.collects_prompt_logprobs and rows <= 0:
                continue  # this step's logits rows for prompt logprobs are taken; others may still go
            if seq.batch and self._chunk(seq, budget, rows) == 0:
                continue  # the batch class's share of this step (tokens, or past its floor, time) is spent
            if seq.adapter is not None:
                # Not its adapter's turn for a slot (nor resident): it waits in the rotation. An interactive
                # one whose adapter's slot drains for the batch class takes it back (AdapterManager.acquire).
                slots = self.adapters.slots
                waits = (
                    seq.adapter not in turn
                    and slots.lookup(seq.adapter) is None
                    and (seq.batch or not slots.holds(seq.adapter))
                )
                try:
                    if waits:
                        self.adapters.raise_if_failed(seq.adapter)
                        continue
                    slot = self.adapters.acquire(seq.adapter, batch=seq.batch)
                except AdapterError as error:  # the adapter failed to load: this request cannot be served
                    log.warning("request %s: adapter %s: %s", seq.group_id, seq.adapter, error)
                    self._refuse(seq, error, out)
                    continue
                except Exception:  # a bug in the adapter tiers: fail this request, never the loop
                    log.exception("request %s: acquiring adapter %s failed", seq.group_id, seq.adapter)
                    self._refuse(seq, RequestFailed(), out)
                    continue
                if slot is None and not seq.batch and not batch_slot_taken:
                    slot = self._take_batch_slot(seq, out)
                    batch_slot_taken = slot is not None
                overdue = turn and seq.adapter == turn[0] and self._overdue(seq)
                if slot is None and not overdue_served and overdue:
                    slot = self._take_slot(seq, out)
                    overdue_served = slot is not None
                if slot is None:
                    continue
                seq.slot, seq.lora_pages = slot, self.adapters.slots.pages_at(slot)
            first = seq.metrics.first_scheduled is None
            cached = 0 if seq.collects_prompt_logprobs else self.blocks.match_prefix(seq)
            n = self._chunk(seq, budget, rows)
            if n == 0:  # its cached prefix left it one sampled row, more than the batch class's time left
                self._release(seq)
                continue
            needed = self.blocks.blocks_needed(seq, seq.num_computed + n)
            if needed + self._watermark > self.blocks.num_free_blocks or not self.blocks.allocate(
                seq, seq.num_computed + n
            ):
                self._release(seq)  # out of KV memory: stop admitting, keep arrival order
                return budget, rows
            seq.metrics.admitted, seq.metrics.admitted_outputs = time.monotonic(), seq.num_output_tokens
            if first:
                seq.metrics.first_scheduled = seq.metrics.admitted
                seq.metrics.cached_prompt_tokens = cached
            self._unqueue(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, n, out)
            self._charge(seq, cached * CACHED_TOKEN_SERVICE + self._service(seq, n))
            budget -= n
            rows -= len(prompt_positions(seq, seq.num_computed, n))
        return budget, rows

    def _candidates(self) -> Iterator[Sequence]:
        """The waiting sequences in the order admission tries them. "fifo": arrival order. "fair": the next
        untried sequence of the tenant with the least served counter (re-read at every pick, so each
        admission's charge counts for the next), first in first out within a tenant; a sequence skipped
        (its adapter not resident, its leader not done) leaves its tenant first in line, so the tenant's
        next sequence is tried. A scan over the waiting tenants per pick: cheap for the tens of tenants a
        replica serves at once; one waiting tenant costs what FIFO does."""
        if not self._batch_waiting:
            yield from self._in_order(None)
            return
        yield from self._in_order(False)  # every interactive sequence first, then the batch class
        yield from self._in_order(True)

    def _in_order(self, batch: bool | None) -> Iterator[Sequence]:
        """`_candidates` for one class (None: both)."""

        def of_class(seqs: Iterable[Sequence]) -> list[Sequence]:
            return list(seqs) if batch is None else [s for s in seqs if s.batch == batch]

        if self.scheduling == "fifo" or len(self._queues) <= 1:
            yield from of_class(self.waiting)
            return
        pending = {tenant: iter(of_class(queue)) for tenant, queue in self._queues.items()}
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
        """Free the least wanted busy slot for an overdue request by preempting its running users, then give
        it the slot."""
        assert seq.adapter is not None
        victims = self.adapters.slots_to_free(
            seq.adapter, min_age_s=self.adapter_min_residency_s, batch=seq.batch
        )
        if not victims:
            return None
        self.slot_preemptions += self._vacate(victims, out)
        return self.adapters.acquire(seq.adapter)

    def _take_batch_slot(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """An interactive request never waits for a slot that only batch sequences use: they give it up at
        once, whatever its residency."""
        assert seq.adapter is not None
        interactive = {s.slot for s in self.running if not s.batch}
        batch_only = {s.slot for s in self.running if s.slot >= 0 and s.slot not in interactive}
        victims = (
            self.adapters.slots_to_free(seq.adapter, min_age_s=0.0, among=batch_only) if batch_only else []
        )
        if not victims:
            return None
        self.batch_preemptions += self._vacate(victims, out)
        return self.adapters.acquire(seq.adapter)

    def _vacate(self, slots: list[int], out: SchedulerOutput) -> int:
        """Preempt the running users of `slots` (they requeue at the front and resume from the prefix
        cache); how many there were."""
        users = [s for s in self.running if s.slot in slots]
        for user in users:
            self._preempt(user, out)
        return len(users)

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq)
        if seq.slot >= 0:
            self.adapters.release(seq.slot)
            seq.slot, seq.lora_pages = -1, 0
