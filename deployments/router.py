"""AdapterAwareRouter: Ray Serve request routing for engine deployments, by adapter residency and load.

Serve's default router spreads requests by queue length, so every replica ends up loading every adapter;
its multiplexing routes by periodically reported stats, so a burst for a new adapter loads it on several
replicas before the stats catch up. This router:

- sends an adapter request to a replica that already holds that adapter (device slot first, then CPU
  tier), per the replicas' reported stats and this router's own recent choices (which cover the seconds
  before the next stats refresh);
- otherwise to the adapter's home replica, chosen by rendezvous hashing of (adapter, replica): every
  router instance, on every ingress replica, agrees on it without talking to the others;
- spills to the least loaded replica with a free slot when the preferred one is overloaded
  (running + waiting >= spill_factor * max_num_seqs), so one hot adapter cannot pin a replica;
- sends base-model requests to the least loaded replica, except that a follow-up turn (its prompt starts
  like a recent request's, same tenant and adapter) prefers the replica that served the earlier turn, so
  its prefix-cache blocks are reused.

Serve moves on to the next rank when the replicas of one do not answer its queue-length probe within
0.1 s, which a busy replica on a loaded machine misses: an adapter request would then spill, and load
its adapter on a second replica, for want of a timely answer rather than for load. So while the
policy's pick is not overloaded, an adapter request is offered that replica alone for its first
HOLD_TRIES rounds (Serve backs off and doubles the probe deadline up to 1 s between them); after those,
or once Serve drops a dead replica from the candidates, the spill ranks follow.

Each rank returned is a list from which Serve takes the replica with the shortest queue. Within a rank,
Serve only compares replicas whose queue length it has cached (fresh for 10 s) and probes the others only
when none is cached: a rank that mixes a replica with recent traffic and freshly started ones sends a
whole burst to the known one. So every choice this router makes is a rank of one replica (Serve probes it
if it must): the policy's pick, then the least loaded by this router's view, then the wider lists as
fallbacks for when those are full or do not answer.

Serve counts a request in its queue-length cache only once it is sent, and one of its routing tasks can
fulfil every request queued behind a busy ingress's event loop before any of them is sent: a burst would
then see its first member's load and all stay home. So this router also counts its own picks until the
cached length for that replica moves (`_UnsentPicks`).
"""

import hashlib
import logging
import random
import time
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.abort_request import AbortRequest
from deployments.engine.interface import EngineRequest
from deployments.rendezvous import rendezvous_order

log = logging.getLogger(__name__)
PREFIX_TOKENS = 32  # a follow-up turn repeats at least this much of the earlier prompt
MEMORY = 4096  # recent choices remembered (adapter -> replica, prompt prefix -> replica)
MEMORY_TTL_S = 600.0
HOLD_TRIES = 5  # rounds an adapter request waits for its pick (~3 s of probes) before it may spill
TRIES_ATTRIBUTE = "loraplex_router_tries"  # kept on the request's routing context: it lives as long


def rendezvous(key: str, replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Replicas in the order this key prefers them: the same on every router and replica."""
    by_id = {r.replica_id.unique_id: r for r in replicas}
    return [by_id[i] for i in rendezvous_order(key, list(by_id))]


def prefix_key(request: EngineRequest) -> str | None:
    if len(request.prompt_ids) < PREFIX_TOKENS:
        return None
    head = ",".join(map(str, request.prompt_ids[:PREFIX_TOKENS]))
    scope = f"{request.cache_salt}|{request.adapter}"
    return hashlib.blake2b(f"{scope}|{head}".encode(), digest_size=12).hexdigest()


class _Memory:
    """A bounded, expiring map of recent routing choices."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, tuple[float, ReplicaID]] = OrderedDict()

    def get(self, key: str) -> ReplicaID | None:
        hit = self._items.get(key)
        if hit is None or hit[0] < time.monotonic():
            return None
        return hit[1]

    def put(self, key: str, replica: ReplicaID) -> None:
        self._items[key] = (time.monotonic() + MEMORY_TTL_S, replica)
        self._items.move_to_end(key)
        while len(self._items) > MEMORY:
            self._items.popitem(last=False)


class _UnsentPicks:
    """Picks made since a replica's cached queue length last changed: a send, a completion or a probe
    moves it, and from then on the cache counts what had been sent."""

    def __init__(self) -> None:
        self._by_replica: dict[ReplicaID, tuple[int, int]] = {}

    def count(self, replica: ReplicaID, cached: int | None) -> int:
        seen = self._by_replica.get(replica)
        return seen[1] if seen is not None and seen[0] == cached else 0

    def add(self, replica: ReplicaID, cached: int, live: list[RunningReplica]) -> None:
        self._by_replica[replica] = (cached, self.count(replica, cached) + 1)
        if len(self._by_replica) > 2 * len(live):  # forget replicas that are gone
            keep = {r.replica_id for r in live}
            self._by_replica = {k: v for k, v in self._by_replica.items() if k in keep}


class AdapterAwareRouter(RequestRouter):
    def initialize_state(
        self, spill_factor: float = 1.5, max_num_seqs: int | None = None, **kwargs: Any
    ) -> None:
        self.spill_factor = spill_factor
        self.max_num_seqs = max_num_seqs  # a replica's capacity until its routing stats say
        self._adapter_home = _Memory()  # adapter -> where this router last sent it
        self._prefix_home = _Memory()  # prompt prefix -> where its earlier turn went
        self._unsent = _UnsentPicks()
        self.decisions = 0
        self.held_decisions = 0  # the first choice already held the adapter (per stats or memory)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        request = _engine_request(pending_request)
        if not candidate_replicas:
            return []
        abort = _abort_request(pending_request)
        if abort is not None:  # only the replica running the request can stop it
            return [[r for r in candidate_replicas if r.replica_id.unique_id == abort.replica]]
        if request is None:  # stats and other control calls: anyone not overloaded
            return [self._by_load(candidate_replicas)]
        pick, *fallbacks = self._rank(candidate_replicas, request)
        adapter_pick = pick if request.adapter is not None else []
        if adapter_pick and pending_request is not None and self._hold(pending_request):
            ranks = [adapter_pick]
        else:
            ranks = [rank for rank in [pick, *fallbacks] if rank]
        # Serve takes a lone, cached replica whose queue has room without waiting (it probes the others).
        if ranks and len(ranks[0]) == 1:
            chosen = ranks[0][0].replica_id
            if (cached := self.replica_queue_len_cache.get(chosen)) is not None:
                self._unsent.add(chosen, cached, candidate_replicas)
        return ranks

    def _hold(self, pending: PendingRequest) -> bool:
        """Whether this round still offers the pick alone; Serve then sleeps between rounds."""
        context = pending.routing_context
        tries = int(getattr(context, TRIES_ATTRIBUTE, 0)) + 1
        setattr(context, TRIES_ATTRIBUTE, tries)
        context.should_backoff = tries <= HOLD_TRIES
        return tries <= HOLD_TRIES

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _engine_request(pending_request)
        if request is None:
            return
        if request.adapter is not None:
            self._adapter_home.put(request.adapter.adapter_id, replica_id)
        key = prefix_key(request)
        if key is not None:
            self._prefix_home.put(key, replica_id)

    # -- policy -----------------------------------------------------------------------------------------

    def _rank(self, replicas: list[RunningReplica], request: EngineRequest) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in replicas}
        fit = [r for r in replicas if not self._overloaded(r)]
        previous = self._prefix_home.get(key) if (key := prefix_key(request)) else None
        follow_up = by_id.get(previous) if previous is not None else None
        if request.adapter is None:
            first = [follow_up] if follow_up is not None and follow_up in fit else []
            by_load = self._by_load(fit)
            return [first, by_load[:1], by_load, self._by_load(replicas)]

        ref, adapter_id = str(request.adapter), request.adapter.adapter_id
        in_slot = [r for r in fit if ref in _stats(r).get("device_adapters", ())]
        in_cpu = [r for r in fit if ref in _stats(r).get("cpu_adapters", ())]
        remembered = by_id.get(self._adapter_home.get(adapter_id))  # type: ignore[arg-type]
        home = next(iter(rendezvous(adapter_id, fit)), None)
        ordered: list[RunningReplica] = []
        for r in [follow_up, *in_slot, *in_cpu, remembered, home]:
            if r is not None and r in fit and r not in ordered:
                ordered.append(r)
        self.decisions += 1
        if ordered and (ordered[0] in in_slot or ordered[0] in in_cpu or ordered[0] is remembered):
            self.held_decisions += 1
        with_slot = [r for r in fit if _stats(r).get("free_slots", 1) > 0]
        # One replica first (deterministic: the adapter stays in one place), then spill options.
        spill = self._by_load(with_slot or fit)
        return [ordered[:1], spill[:1], spill, self._by_load(replicas)]

    def _overloaded(self, replica: RunningReplica) -> bool:
        stats = _stats(replica)
        capacity = stats.get("max_num_seqs") or self.max_num_seqs
        if not capacity:
            return False
        return self._load(replica) >= self.spill_factor * float(capacity)

    def _load(self, replica: RunningReplica) -> float:
        stats = _stats(replica)
        reported = float(stats.get("running", 0) + stats.get("waiting", 0))
        cached = self.replica_queue_len_cache.get(replica.replica_id)  # fresher: counts our own sends
        queued = (cached or 0) + self._unsent.count(replica.replica_id, cached)
        return max(reported, float(queued))

    def _by_load(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        # Ties in random order: a burst decided before any of it reaches a replica sees every replica
        # equally idle, and a stable order would send the whole burst to the first one.
        return sorted(replicas, key=lambda r: (self._load(r), random.random()))


def _stats(replica: RunningReplica) -> dict[str, Any]:
    return replica.routing_stats or {}


def _abort_request(pending: PendingRequest | None) -> AbortRequest | None:
    first = pending.args[0] if pending is not None and pending.args else None
    return first if isinstance(first, AbortRequest) else None


def _engine_request(pending: PendingRequest | None) -> EngineRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, EngineRequest) else None
