"""LimiterState: the rate-limit algorithm on in-memory state. The in-cluster Ray actor holds one of these;
the Redis backend runs the same steps in a Lua script (redis_backend.py), and one test suite
holds both to the same behaviour.

Per tenant: a sliding-window log of admitted requests, a sliding window of token reservations (reconciled
at release), concurrency leases with expiry, each weighing the sequences its request runs (n x prompts),
and a bounded FIFO queue of waiters that refresh their place by checking again (a waiter that stops
checking drops out; the waiting backends check at least every HEARTBEAT_MS).
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from app.limits.protocol import (
    WINDOW_MS,
    Decision,
    Limits,
    Reason,
    WindowState,
    check_sequences,
    check_tokens,
)

QUEUE_STALE_MS = 2_000  # a waiter that has not checked for this long has given up
HEARTBEAT_MS = QUEUE_STALE_MS // 4  # a waiting backend re-checks at least this often, keeping its place
CONCURRENCY_RETRY_MS = 250  # nobody knows when a running request ends: poll again soon
DELIVERING_RETRY_MS = 20  # a delivered stream's lease goes as soon as its client has read it
QUEUED_RETRY_MS = 50  # a waiter that is not at the head of the queue


@dataclass
class _Tenant:
    requests: OrderedDict[str, int] = field(default_factory=OrderedDict)  # id -> admission (ms), oldest first
    tokens: OrderedDict[str, tuple[int, int]] = field(default_factory=OrderedDict)  # id -> (time, tokens)
    token_total: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # id -> expiry (ms)
    sequences: dict[str, int] = field(default_factory=dict)  # id -> its lease's weight, while it has one
    queue: OrderedDict[str, int] = field(default_factory=OrderedDict)  # id -> last poll (ms), arrival order
    delivering: set[str] = field(default_factory=set)  # leases whose output only waits to be delivered


class LimiterState:
    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}

    @staticmethod
    def now_ms() -> int:
        return time.monotonic_ns() // 1_000_000

    def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve: int,
        *,
        queued: bool,
        max_waiters: int | None = None,
        now: int | None = None,
        sequences: int = 1,
    ) -> Decision:
        """`max_waiters`: a queued request that would be the tenant's waiter number max_waiters + 1 is
        refused with `queue_full` (and the retry_after of the limit in its way) instead of joining.
        `sequences`: what the lease weighs against max_concurrent."""
        reserve = check_tokens("reserve_tokens", reserve)  # before anything changes
        sequences = check_sequences(sequences)
        now = self.now_ms() if now is None else now
        t = self._tenants.setdefault(tenant, _Tenant())
        self._expire(t, now)
        if limits.tpm is not None and reserve > limits.tpm:
            return self._decision(t, limits, now, admitted=False, reason="too_large", retry_after=0)
        if limits.max_concurrent is not None and sequences > limits.max_concurrent:
            return self._decision(t, limits, now, admitted=False, reason="too_many_sequences", retry_after=0)
        if queued:
            if request_id not in t.queue and max_waiters is not None and len(t.queue) >= max_waiters:
                _, wait = self._blocked(t, limits, reserve, sequences, now) or ("queued", QUEUED_RETRY_MS)
                return self._decision(t, limits, now, admitted=False, reason="queue_full", retry_after=wait)
            t.queue.setdefault(request_id, now)
            t.queue[request_id] = now
            if next(iter(t.queue)) != request_id:  # FIFO: only the oldest waiter may go
                return self._decision(
                    t, limits, now, admitted=False, reason="queued", retry_after=QUEUED_RETRY_MS
                )
        blocked = self._blocked(t, limits, reserve, sequences, now)
        if blocked is not None:
            reason, wait = blocked
            return self._decision(t, limits, now, admitted=False, reason=reason, retry_after=wait)
        t.queue.pop(request_id, None)
        t.requests.pop(request_id, None)  # an id admitted again (a retried call) counts once, at its new time
        t.requests[request_id] = now
        previous = t.tokens.pop(request_id, None)
        if previous is not None:
            t.token_total -= previous[1]
        t.tokens[request_id] = (now, reserve)
        t.token_total += reserve
        t.leases[request_id] = now + limits.lease_ttl_ms
        t.sequences[request_id] = sequences
        return self._decision(t, limits, now, admitted=True, reason=None, retry_after=0)

    @staticmethod
    def _held(t: _Tenant) -> int:
        """Sequences the tenant's leases hold."""
        return sum(t.sequences.get(lease, 1) for lease in t.leases)

    def _blocked(
        self, t: _Tenant, limits: Limits, reserve: int, sequences: int, now: int
    ) -> tuple[Reason, int] | None:
        """The first limit this reservation would break, with when trying again can succeed; None: fits."""
        if limits.rpm is not None and len(t.requests) >= limits.rpm:
            return "requests", next(iter(t.requests.values())) + WINDOW_MS - now if t.requests else WINDOW_MS
        if limits.tpm is not None and t.token_total + reserve > limits.tpm:
            return "tokens", self._token_wait(t, limits.tpm - reserve, now)
        if limits.max_concurrent is not None and self._held(t) + sequences > limits.max_concurrent:
            delivering = sum(t.sequences.get(lease, 1) for lease in t.delivering if lease in t.leases)
            if self._held(t) - delivering + sequences <= limits.max_concurrent:
                return "delivering", DELIVERING_RETRY_MS
            return "concurrency", CONCURRENCY_RETRY_MS
        return None

    def queue_order(self, tenant: str) -> list[str]:
        """The tenant's waiters, oldest first (the head is the one that may go next)."""
        t = self._tenants.get(tenant)
        return [] if t is None else list(t.queue)

    def release(self, tenant: str, request_id: str, used: int) -> None:
        used = check_tokens("used_tokens", used)
        t = self._tenants.get(tenant)
        if t is None:
            return
        t.leases.pop(request_id, None)
        t.sequences.pop(request_id, None)
        t.delivering.discard(request_id)
        entry = t.tokens.get(request_id)
        if entry is not None:  # still in the window: the minute's total reflects what was really used
            t.tokens[request_id] = (entry[0], used)
            t.token_total += used - entry[1]

    def renew(self, tenant: str, request_id: str, ttl_ms: int, now: int | None = None) -> None:
        t = self._tenants.get(tenant)
        if t is not None and request_id in t.leases:
            t.leases[request_id] = (self.now_ms() if now is None else now) + ttl_ms

    def deliver(self, tenant: str, request_id: str) -> None:
        t = self._tenants.get(tenant)
        if t is not None and request_id in t.leases:
            t.delivering.add(request_id)

    def leave_queue(self, tenant: str, request_id: str) -> None:
        t = self._tenants.get(tenant)
        if t is not None:
            t.queue.pop(request_id, None)

    def peek(self, tenant: str, now: int | None = None) -> WindowState:
        """What _expire would keep, counted without expiring anything: a read never changes state."""
        now = self.now_ms() if now is None else now
        t = self._tenants.get(tenant)  # not setdefault: reading an unknown tenant leaves no trace
        if t is None:
            return WindowState(requests=0, tokens=0, in_flight=0, queued=0, reset_requests_ms=0,
                               reset_tokens_ms=0)  # fmt: skip
        horizon = now - WINDOW_MS
        requests = [when for when in t.requests.values() if when > horizon]  # oldest first
        tokens = [(when, n) for when, n in t.tokens.values() if when > horizon]
        return WindowState(
            requests=len(requests),
            tokens=sum(n for _, n in tokens),
            in_flight=sum(t.sequences.get(i, 1) for i, expiry in t.leases.items() if expiry > now),
            queued=sum(1 for seen in t.queue.values() if seen > now - QUEUE_STALE_MS),
            reset_requests_ms=requests[-1] + WINDOW_MS - now if requests else 0,
            reset_tokens_ms=tokens[-1][0] + WINDOW_MS - now if tokens else 0,
        )

    def _expire(self, t: _Tenant, now: int) -> None:
        horizon = now - WINDOW_MS
        while t.requests and next(iter(t.requests.values())) <= horizon:
            t.requests.popitem(last=False)
        while t.tokens:
            first_id, (when, tokens) = next(iter(t.tokens.items()))
            if when > horizon:
                break
            del t.tokens[first_id]
            t.token_total -= tokens
        for lease_id in [i for i, expiry in t.leases.items() if expiry <= now]:
            del t.leases[lease_id]
            t.sequences.pop(lease_id, None)
            t.delivering.discard(lease_id)
        for waiter in [i for i, seen in t.queue.items() if seen <= now - QUEUE_STALE_MS]:
            del t.queue[waiter]

    @staticmethod
    def _token_wait(t: _Tenant, allowed_total: int, now: int) -> int:
        """Time until enough reservations leave the window for the total to drop to allowed_total."""
        total = t.token_total
        for when, tokens in t.tokens.values():  # oldest first: they leave the window first
            total -= tokens
            if total <= allowed_total:
                return max(1, when + WINDOW_MS - now)
        return WINDOW_MS

    @staticmethod
    def _decision(
        t: _Tenant, limits: Limits, now: int, *, admitted: bool, reason: Reason | None, retry_after: int
    ) -> Decision:
        reset_requests = next(reversed(t.requests.values())) + WINDOW_MS - now if t.requests else 0
        reset_tokens = next(reversed(t.tokens.values()))[0] + WINDOW_MS - now if t.tokens else 0
        return Decision(
            admitted=admitted,
            reason=reason,
            retry_after_ms=max(0, retry_after),
            limit_requests=limits.rpm,
            remaining_requests=None if limits.rpm is None else limits.rpm - len(t.requests),
            reset_requests_ms=max(0, reset_requests),
            limit_tokens=limits.tpm,
            remaining_tokens=None if limits.tpm is None else limits.tpm - t.token_total,
            reset_tokens_ms=max(0, reset_tokens),
        )
