"""Rate limits as the ingress sees them: a tenant's Limits, the backend's Decision, and the backend protocol.

Admission checks three things atomically, cluster-wide, per tenant: requests in the last minute (sliding
window), tokens in the last minute (prompt + max_tokens reserved at admission, reconciled to what was
really used when the request ends), and concurrent sequences (leases that expire on their own, so a crashed
ingress cannot leak them; a request's lease weighs the sequences it runs, n x prompts, as the engine does).
"""

import math
from dataclasses import dataclass
from typing import Literal, Protocol

WINDOW_MS = 60_000
# "queued": still behind earlier waiters when the wait ran out; "queue_full": the tenant already has as many
# waiters as the limiter allows, so this one was refused without waiting; "too_large": more tokens than a
# minute's, "too_many_sequences": more sequences than max_concurrent (neither can ever fit: never queued).
# "delivering": over max_concurrent only because of streams whose output is all written, waiting for the
# proxy to deliver it (see `deliver`): they end within milliseconds once their client has read them.
Reason = Literal[
    "requests",
    "tokens",
    "concurrency",
    "delivering",
    "queued",
    "queue_full",
    "too_large",
    "too_many_sequences",
]
FINAL_REASONS: frozenset[Reason] = frozenset({"queue_full", "too_large", "too_many_sequences"})  # no waiting
MAX_TOKENS = 10**12  # far above any real request or minute, far below where Lua's doubles lose integers
MAX_WAIT_MS = 3_600_000  # an hour: longer than any queue tier waits
DEFAULT_MAX_WAITERS = 64  # waiters per tenant; past them a queued request is refused at once
MAX_SEQUENCES = 10**6  # a lease's weight: far above any request's n x prompts
# How long a request refused only for streams still being delivered waits for them, even on a tier that
# rejects at its limit: a client that read a stream to its end and sends the next request at once must not
# race the proxy's acknowledgement of that stream (a client that stops reading costs the next one this).
DELIVERY_GRACE_MS = 2_000


@dataclass(frozen=True)
class Limits:
    """None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None  # sequences in flight at once (a request holds n x prompts of them)
    max_tokens_cap: int | None = None  # largest max_tokens a request may ask for; the reservation if absent
    on_limit: Literal["reject", "queue"] = "reject"
    max_queue_ms: int = 0
    lease_ttl_ms: int = 120_000  # a lease nobody renews (every 30 s) or releases expires after this

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrent is None


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: Reason | None  # why not, when not admitted
    retry_after_ms: int  # when trying again can succeed (0 when admitted)
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_ms: int  # until the request window is empty again
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_ms: int

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers (only for the limits that are set)."""
        out: dict[str, str] = {}
        if self.limit_requests is not None:
            out["x-ratelimit-limit-requests"] = str(self.limit_requests)
            out["x-ratelimit-remaining-requests"] = str(max(0, self.remaining_requests or 0))
            out["x-ratelimit-reset-requests"] = format_duration(self.reset_requests_ms)
        if self.limit_tokens is not None:
            out["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.remaining_tokens or 0))
            out["x-ratelimit-reset-tokens"] = format_duration(self.reset_tokens_ms)
        return out


@dataclass(frozen=True)
class WindowState:
    """A tenant's limiter state at one instant, as `peek` reads it: what the current window holds, whatever
    the limits (so the caller applies the tenant's own)."""

    requests: int  # admitted in the last minute
    tokens: int  # reserved or used in the last minute
    in_flight: int  # sequences held by live concurrency leases
    queued: int  # waiters in the queue
    reset_requests_ms: int  # until the request window is empty again
    reset_tokens_ms: int

    def remaining_requests(self, limits: Limits) -> int | None:
        return None if limits.rpm is None else max(0, limits.rpm - self.requests)

    def remaining_tokens(self, limits: Limits) -> int | None:
        return None if limits.tpm is None else max(0, limits.tpm - self.tokens)


def format_duration(ms: int) -> str:
    """OpenAI's reset format: `12ms`, `1s`, `6m0s`, `1m30.5s`."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:g}s"


class LimiterBackend(Protocol):
    """Shared state for every ingress replica. Each call is atomic; failures raise LimiterUnavailable, bad
    arguments (a token count that is not a bounded integer) InvalidTokenCount, before anything is written."""

    async def admit(
        self,
        tenant: str,
        request_id: str,
        limits: Limits,
        reserve_tokens: int,
        *,
        wait_ms: int = 0,
        sequences: int = 1,
    ) -> Decision:
        """Admit now or say why not. `wait_ms` > 0: join the tenant's FIFO queue and wait there, up to that
        long, until this request is the oldest waiter and fits; the backend does the waiting (woken when a
        lease or place is given back, or when the window makes room) and leaves the queue itself when it
        answers. A tenant with the backend's maximum of waiters already gets `queue_full` at once.
        `sequences`: the lease's weight against max_concurrent; more than max_concurrent gets
        `too_many_sequences` at once, never a place in the queue."""
        ...

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        """The request ended: free its lease and replace its token reservation by what it used."""
        ...

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        """Push the lease's expiry back (long streams)."""
        ...

    async def deliver(self, tenant: str, request_id: str) -> None:
        """The request's output is all written and only waits to be delivered: its lease still counts,
        but a request it alone keeps out is refused as `delivering` (worth a short wait) rather than
        `concurrency`. A no-op for a lease that is gone."""
        ...

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        """A waiting request gave up (its caller was cancelled or the call failed): drop its place."""
        ...

    async def peek(self, tenant: str) -> WindowState:
        """The tenant's current window, read-only: nothing is admitted, reserved, queued or renewed."""
        ...


class LimiterUnavailable(Exception):
    """The shared limiter state cannot be reached; the ingress answers 503 unless configured fail-open."""


class InvalidTokenCount(ValueError):
    """A token count the limiter refuses to store: not an integer, negative, or absurdly large."""


def check_tokens(name: str, value: object) -> int:
    """`value` as a token count, or InvalidTokenCount: the limiter never stores what it cannot add up."""
    if isinstance(value, bool) or not isinstance(value, int):
        if not (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
            raise InvalidTokenCount(f"{name} must be an integer token count, got {value!r}")
        value = int(value)
    if not 0 <= value <= MAX_TOKENS:
        raise InvalidTokenCount(f"{name} must be between 0 and {MAX_TOKENS} tokens, got {value}")
    return value


def check_sequences(value: object) -> int:
    """`value` as a lease weight (1 to MAX_SEQUENCES), or ValueError before anything is written."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SEQUENCES:
        raise ValueError(f"sequences must be an integer from 1 to {MAX_SEQUENCES}, got {value!r}")
    return value


def check_wait(wait_ms: int) -> int:
    """How long a request may wait, in whole ms, clamped to [0, MAX_WAIT_MS]."""
    return min(max(0, int(wait_ms)), MAX_WAIT_MS)
