"""RefusalCache: a tenant refused for its requests per minute stays refused for a moment, in this process.

A tenant over its RPM on a reject tier gets its 429 from the limiter; without this, each request of a
refused flood would still have its body parsed and validated (a 2 MB body takes half a second on the
event loop) and cost a round trip to the one shared limiter before being refused again. After a
requests-per-minute refusal the ingress keeps the decision for `min(retry_after, MAX_HOLD_S)`: a request
from that tenant arriving in that time is answered the same 429 (its retry hints aged by the time since)
before its body is read and without asking the limiter.

What is kept, and why:
- Only `requests` refusals of reject tiers. A queue tier's request waits for room instead (its waiting
  is the limiter's, in arrival order); a token refusal depends on the body's size, and a concurrency
  refusal ends when any of the tenant's requests does.
- At most a second: the limiter is shared by every ingress replica and the window's own end is its
  retry_after, but the window can also free early (an operator raises the tier or clears the limiter).
  A second bounds how stale a refusal can be, and still turns a flood into one limiter call a second per
  tenant per ingress process. The entry is ignored if the tenant's limits have changed since.
- A refused request is not counted in the limiter's window (only admitted ones are), so answering from
  here changes no count.
- Bounded: at most `max_tenants` entries, the oldest dropped first.
"""

import dataclasses
import time
from collections import OrderedDict
from dataclasses import dataclass

from app.limits.protocol import Decision, Limits

MAX_HOLD_S = 1.0
DEFAULT_MAX_TENANTS = 10_000


@dataclass(frozen=True)
class _Refusal:
    at: float  # time.monotonic() when the limiter refused
    until: float  # answered from here before this
    decision: Decision
    limits: Limits


class RefusalCache:
    def __init__(self, *, hold_s: float = MAX_HOLD_S, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self._hold = hold_s
        self._max = max_tenants
        self._entries: OrderedDict[str, _Refusal] = OrderedDict()

    def remember(self, tenant: str, decision: Decision, limits: Limits) -> None:
        """Keep a limiter's refusal if it is one for requests per minute on a reject tier."""
        if decision.admitted or decision.reason != "requests" or limits.on_limit != "reject":
            return
        if decision.retry_after_ms <= 0:
            return
        now = time.monotonic()
        until = now + min(decision.retry_after_ms / 1000, self._hold)
        self._entries[tenant] = _Refusal(now, until, decision, limits)
        self._entries.move_to_end(tenant)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    def refusal(self, tenant: str, limits: Limits) -> Decision | None:
        """The kept refusal of `tenant` (its times aged to now), or None: ask the limiter."""
        entry = self._entries.get(tenant)
        if entry is None:
            return None
        now = time.monotonic()
        if now >= entry.until or entry.limits != limits:
            del self._entries[tenant]
            return None
        elapsed_ms = int((now - entry.at) * 1000)
        decision = entry.decision
        return dataclasses.replace(
            decision,
            retry_after_ms=max(1, decision.retry_after_ms - elapsed_ms),
            reset_requests_ms=max(0, decision.reset_requests_ms - elapsed_ms),
            reset_tokens_ms=max(0, decision.reset_tokens_ms - elapsed_ms),
        )

    def __len__(self) -> int:
        return len(self._entries)
