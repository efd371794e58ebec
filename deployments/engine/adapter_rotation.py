"""AdapterRotation: the waiting sequences of each adapter, and the order in which adapters without a usable
slot get one.

Each adapter's waiting sequences form a queue of their own (arrival order, preempted ones in front). An
adapter joins the rotation when it has waiting sequences and no usable slot (never loaded, evicted, or
draining), and the rotation is round robin: the adapter that joined first goes first, where an adapter
joins at its oldest waiting sequence's queueing time or at the last time it held a slot, whichever is later.
So an adapter that just gave up its slot goes behind every adapter that was waiting meanwhile, however many
requests it still has queued and however old they are: one hot adapter cannot take every slot that frees.
Before the rotation come the class (an adapter with an interactive sequence waiting before one with only
batch ones) and, with fair scheduling, the tenant (the least served tenant among its waiting sequences),
so slots follow the same precedence as rows: class, then least-served tenant, then adapter rotation, then
first in first out within the adapter.
"""

import time
from collections import deque
from collections.abc import Callable, Iterable

from adapters.ref import AdapterRef
from deployments.engine.sequence import Sequence


class AdapterRotation:
    def __init__(self) -> None:
        self._queues: dict[AdapterRef, deque[Sequence]] = {}  # no empty deques
        self._held_at: dict[AdapterRef, float] = {}  # monotonic time it last held a slot (waiting or held)

    def append(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self._queues.setdefault(seq.adapter, deque()).append(seq)

    def appendleft(self, seq: Sequence) -> None:
        if seq.adapter is not None:
            self._queues.setdefault(seq.adapter, deque()).appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        if seq.adapter is None:
            return
        queue = self._queues[seq.adapter]
        queue.remove(seq)
        if not queue:
            del self._queues[seq.adapter]

    def order(
        self,
        held: Iterable[AdapterRef],
        usable: Callable[[AdapterRef], bool],
        served: Callable[[str | None], float] | None,
    ) -> list[AdapterRef]:
        """The adapters with waiting sequences and no usable slot, in the order they get one. `held`: the
        adapters in a slot now (their held time becomes now), `usable(ref)`: whether its slot takes new
        sequences, `served`: a tenant's fair counter (None: FIFO across tenants)."""
        now = time.monotonic()
        for ref in held:
            self._held_at[ref] = now
        # An adapter neither waiting nor held keeps no entry: its next request queues after its last hold.
        for ref in [r for r, at in self._held_at.items() if at < now and r not in self._queues]:
            del self._held_at[ref]

        def key(ref: AdapterRef) -> tuple[bool, float, float]:
            queue = self._queues[ref]
            only_batch = all(s.batch for s in queue)
            tenant = 0.0 if served is None else min(served(s.tenant) for s in queue)
            oldest = min(s.metrics.waiting_since() for s in queue)
            return only_batch, tenant, max(oldest, self._held_at.get(ref, 0.0))

        return sorted((ref for ref in self._queues if not usable(ref)), key=key)
