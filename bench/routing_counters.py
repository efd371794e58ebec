"""RoutingDelta: what the engine replicas' routing counters (rows of GET /admin/routing) say happened
between two snapshots. bench.routing and tests/e2e/test_routing_e2e.py read them this one way."""

from dataclasses import dataclass
from typing import Any

Snapshot = dict[str, dict[str, Any]]  # replica name -> its row of GET /admin/routing


@dataclass(frozen=True)
class RoutingDelta:
    requests: int  # adapter requests the replicas saw
    hits: int  # of them, served by a replica that held the adapter already
    replicas_per_adapter: dict[str, set[str]]  # adapter -> replicas that loaded it

    @property
    def loads(self) -> int:
        """(adapter, replica) loads."""
        return sum(len(where) for where in self.replicas_per_adapter.values())


def routing_delta(before: Snapshot, after: Snapshot) -> RoutingDelta:
    """Between two snapshots, over the replicas live in `after` (a replica new since `before` counts
    from zero)."""
    requests = hits = 0
    spread: dict[str, set[str]] = {}
    for name, now in after.items():
        then = before.get(name, {"adapter_requests": 0, "adapter_hits": 0, "adapter_loads": {}})
        requests += now["adapter_requests"] - then["adapter_requests"]
        hits += now["adapter_hits"] - then["adapter_hits"]
        for ref, count in now["adapter_loads"].items():
            if count > then["adapter_loads"].get(ref, 0):
                spread.setdefault(ref, set()).add(name)
    return RoutingDelta(requests, hits, spread)
