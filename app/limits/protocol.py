"""Rate limits as the ingress sees them: a tenant's Limits, the backend's Decision, and the backend protocol.

Admission checks three things atomically, cluster-wide, per tenant: requests in the last minute (sliding
window), tokens in the last minute (prompt + max_tokens reserved at admission, reconciled to what was
really used when the request ends), and concurrent requests (leases that expire on their own, so a crashed
ingress cannot leak them).
"""

from dataclasses import dataclass
from typing import Literal, Protocol

WINDOW_MS = 60_000
Reason = Literal["requests", "tokens", "concurrency", "queued", "too_large"]


@dataclass(frozen=True)
class Limits:
    """None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
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
    in_flight: int  # live concurrency leases
    queued: int  # waiters still polling
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
    """Shared state for every ingress replica. Each call is atomic; failures raise LimiterUnavailable."""

    async def admit(
        self, tenant: str, request_id: str, limits: Limits, reserve_tokens: int, *, queued: bool
    ) -> Decision:
        """Admit now or say why not. `queued`: the request waits in the tenant's FIFO queue, and is only
        admitted when it is the oldest waiter."""
        ...

    async def release(self, tenant: str, request_id: str, used_tokens: int) -> None:
        """The request ended: free its lease and replace its token reservation by what it used."""
        ...

    async def renew(self, tenant: str, request_id: str, limits: Limits) -> None:
        """Push the lease's expiry back (long streams)."""
        ...

    async def leave_queue(self, tenant: str, request_id: str) -> None:
        """A queued request gave up (timeout or disconnect)."""
        ...

    async def peek(self, tenant: str) -> WindowState:
        """The tenant's current window, read-only: nothing is admitted, reserved, queued or renewed."""
        ...


class LimiterUnavailable(Exception):
    """The shared limiter state cannot be reached; the ingress answers 503 unless configured fail-open."""
