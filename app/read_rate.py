"""ReadRate: a token bucket per tenant for the read routes (/v1/models, /v1/usage, /v1/limits).

Reads admit nothing through the rate limiter (a tier's rpm is for inference), yet /v1/usage over 93 days
is one of the most expensive queries there is; a loop of them must not take the database from everyone.
Kept per ingress replica, in memory: a rate, not a bill, and no round trip on the read path.
"""

MAX_TENANTS = 100_000


class ReadRate:
    def __init__(self, *, per_minute: int, burst: int) -> None:
        self.per_minute = per_minute
        self._rate = per_minute / 60.0  # tokens per second
        self._burst = float(burst)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when counted)

    def take(self, tenant: str, now: float) -> float | None:
        """Spend one read; None if allowed, else the seconds until one is available."""
        tokens, then = self._buckets.get(tenant, (self._burst, now))
        tokens = min(self._burst, tokens + (now - then) * self._rate)
        if tokens < 1.0:
            self._buckets[tenant] = (tokens, now)
            return (1.0 - tokens) / self._rate
        if len(self._buckets) >= MAX_TENANTS and tenant not in self._buckets:
            self._buckets.clear()  # bounded: a full bucket for everyone is the forgiving reset
        self._buckets[tenant] = (tokens - 1.0, now)
        return None
