"""AdapterAwareRouter's policy on replicas described by their routing stats (no cluster needed): holders
first, then the adapter's rendezvous home; spill when overloaded; base requests by load; follow-ups stick."""

from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import RequestMetadata
from ray.serve.request_router import PendingRequest

from adapters.ref import AdapterRef
from deployments.engine.request import EngineRequest
from deployments.engine.sampling_params import SamplingParams
from deployments.rendezvous import rendezvous_order
from deployments.router import HOLD_TRIES, PREFIX_TOKENS, AdapterAwareRouter


@dataclass(frozen=True)
class FakeId:
    unique_id: str


@dataclass(eq=False)
class FakeReplica:
    """The two things the policy reads of Serve's RunningReplica."""

    name: str
    routing_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def replica_id(self) -> FakeId:
        return FakeId(self.name)


def make_router(spill_factor: float = 1.5, max_num_seqs: int | None = None) -> AdapterAwareRouter:
    router = AdapterAwareRouter.__new__(AdapterAwareRouter)  # Serve's constructor needs a live controller
    router.initialize_state(spill_factor=spill_factor, max_num_seqs=max_num_seqs)
    return router


@pytest.fixture(autouse=True)
def no_queue_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        AdapterAwareRouter, "replica_queue_len_cache", property(lambda self: {}), raising=False
    )


def stats(
    *, slot: tuple[str, ...] = (), cpu: tuple[str, ...] = (), running: int = 0, free: int = 2
) -> dict[str, Any]:
    return {"device_adapters": list(slot), "cpu_adapters": list(cpu), "free_slots": free, "running": running,
            "waiting": 0, "kv_usage": 0.0, "max_num_seqs": 16}  # fmt: skip


def request(adapter: str | None, prompt: list[int] | None = None, tenant: str = "t") -> EngineRequest:
    ref = AdapterRef(adapter, 1) if adapter else None
    return EngineRequest(
        "r", prompt or [1, 2, 3], SamplingParams(max_tokens=4), adapter=ref, cache_salt=tenant
    )


def first(router: AdapterAwareRouter, replicas: list[FakeReplica], req: EngineRequest) -> str:
    ranks = router._rank(replicas, req)  # type: ignore[arg-type]
    return ranks[0][0].name  # type: ignore[attr-defined,no-any-return]


def test_a_replica_holding_the_adapter_wins_slot_before_cpu() -> None:
    replicas = [FakeReplica("a", stats()), FakeReplica("b", stats(cpu=("x@v1",))), FakeReplica("c", stats())]
    assert first(make_router(), replicas, request("x")) == "b"
    replicas[2].routing_stats = stats(slot=("x@v1",))
    assert first(make_router(), replicas, request("x")) == "c"


def test_a_new_adapter_goes_to_its_rendezvous_home_on_every_router() -> None:
    replicas = [FakeReplica(n, stats()) for n in ("a", "b", "c")]
    homes = {}
    for adapter in (f"adapter-{i}" for i in range(24)):
        choices = {first(make_router(), replicas, request(adapter)) for _ in range(3)}  # independent routers
        assert choices == {rendezvous_order(adapter, ["a", "b", "c"])[0]}
        homes[adapter] = choices.pop()
    assert set(homes.values()) == {"a", "b", "c"}  # and adapters spread over the replicas


def test_the_routers_own_recent_choice_covers_the_time_before_stats_refresh() -> None:
    replicas = [FakeReplica(n, stats()) for n in ("a", "b", "c")]
    router = make_router()
    home = rendezvous_order("x", ["a", "b", "c"])[0]
    other = next(r for r in replicas if r.name != home)
    router._adapter_home.put("x", other.replica_id)  # type: ignore[arg-type]  # e.g. an earlier spill
    assert first(router, replicas, request("x")) == other.name


def test_an_overloaded_holder_spills_to_its_next_home_or_the_least_loaded_with_a_free_slot() -> None:
    home = rendezvous_order("x", ["a", "b", "c"])[0]
    replicas = {n: FakeReplica(n, stats(running=3)) for n in ("a", "b", "c")}
    replicas[home].routing_stats = stats(slot=("x@v1",), running=24)  # 24 >= 1.5 * 16
    others = [n for n in ("a", "b", "c") if n != home]
    replicas[others[0]].routing_stats = stats(running=1, free=0)
    replicas[others[1]].routing_stats = stats(running=5, free=1)
    ranks = make_router()._rank(list(replicas.values()), request("x"))  # type: ignore[arg-type]
    # No fit replica holds it: its next rendezvous choice (so one hot adapter spills to one place), then
    # the least loaded replica with a free slot.
    assert [r.name for r in ranks[0]] == [rendezvous_order("x", others)[0]]  # type: ignore[attr-defined]
    assert [r.name for r in ranks[1]] == [others[1]]  # type: ignore[attr-defined]
    assert first(make_router(spill_factor=2.0), list(replicas.values()), request("x")) == home


def test_base_requests_go_to_the_least_loaded_and_follow_ups_stick() -> None:
    replicas = [
        FakeReplica("a", stats(running=4)),
        FakeReplica("b", stats(running=1)),
        FakeReplica("c", stats(running=2)),
    ]
    router = make_router()
    assert router._rank(replicas, request(None))[0] == []  # type: ignore[arg-type]
    ranks = router._rank(replicas, request(None))  # type: ignore[arg-type]
    assert [[r.name for r in rank] for rank in ranks[1:3]] == [["b"], ["b", "c", "a"]]  # type: ignore[attr-defined]

    long_prompt = list(range(PREFIX_TOKENS + 10))
    router._prefix_home.put(_prefix(long_prompt, "t"), replicas[2].replica_id)  # type: ignore[arg-type]
    follow_up = request(None, [*long_prompt, 99, 98])
    assert first(router, replicas, follow_up) == "c"
    other_tenant = request(None, [*long_prompt, 99, 98], tenant="u")  # another tenant's cache is not shared
    assert router._rank(replicas, other_tenant)[0] == []  # type: ignore[arg-type]


def _prefix(prompt: list[int], tenant: str) -> str:
    from deployments.router import prefix_key

    key = prefix_key(request(None, prompt, tenant))
    assert key is not None
    return key


def test_a_burst_over_equally_idle_replicas_spreads() -> None:
    """Decisions made before any of the burst reaches a replica see the same load everywhere: ties are
    broken at random, so the burst does not all go to the first replica in some fixed order."""
    replicas = [FakeReplica(name, stats()) for name in "abc"]
    router = make_router()
    leaders = {router._rank(replicas, request(None))[1][0].name for _ in range(60)}  # type: ignore[arg-type,attr-defined]
    assert leaders == {"a", "b", "c"}
    busy = [FakeReplica("a", stats(running=1)), *replicas[1:]]
    assert all(router._rank(busy, request(None))[2][-1].name == "a" for _ in range(20))  # type: ignore[arg-type,attr-defined]


def serve_pick(rank: list[FakeReplica], cache: dict[FakeId, int]) -> FakeReplica:
    """Serve's choice within one rank (RequestRouter._select_from_candidate_replicas): the shortest queue
    among replicas with a cached queue length; the others are probed (here: idle) only when none is cached."""
    cached = [r for r in rank if cache.get(r.replica_id) is not None]
    if cached:
        return min(cached, key=lambda r: cache[r.replica_id])
    for r in rank:
        cache[r.replica_id] = 0  # the probe's answer
    return min(rank, key=lambda r: cache[r.replica_id])


def test_a_burst_spreads_over_new_replicas_beside_one_with_recent_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Right after a scale-up Serve has a fresh queue length only for the old replica: a rank that lists the
    new ones beside it would send the whole burst there (the old router did)."""
    cache: dict[FakeId, int] = {FakeId("a"): 0}  # traffic a few seconds ago; b and c just started
    monkeypatch.setattr(AdapterAwareRouter, "replica_queue_len_cache", property(lambda self: cache))
    replicas = [FakeReplica(name, stats()) for name in "abc"]
    router = make_router()
    chosen = []
    for _ in range(6):  # decided before any of them reaches a replica's reported stats
        rank = next(rank for rank in router._rank(replicas, request(None)) if rank)  # type: ignore[arg-type]
        pick = serve_pick(rank, cache)  # type: ignore[arg-type]
        cache[pick.replica_id] = cache.get(pick.replica_id, 0) + 1  # Serve's on_send_request
        chosen.append(pick.name)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"], chosen


def test_a_replica_without_routing_stats_yet_is_overloaded_by_the_configured_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home = rendezvous_order("x", ["a", "b"])[0]
    cache = {FakeId(home): 2}  # two sends counted; its first routing stats have not arrived
    monkeypatch.setattr(AdapterAwareRouter, "replica_queue_len_cache", property(lambda self: cache))
    replicas = [FakeReplica(n) for n in ("a", "b")]
    router = make_router(spill_factor=0.5, max_num_seqs=4)  # overloaded at 2
    assert first(router, replicas, request("x")) != home


async def test_an_adapter_request_waits_for_a_slow_home_instead_of_loading_its_adapter_elsewhere() -> None:
    """Serve moves on to the next rank when a replica misses its 0.1 s queue-length probe, which a busy
    replica on a loaded machine does: the adapter then loaded on a second replica (routing e2e failures on
    slow CPUs). Its pick alone is offered for HOLD_TRIES rounds, with backoff; then the spill ranks."""
    replicas = [FakeReplica(n, stats()) for n in ("a", "b", "c")]
    home = rendezvous_order("x", ["a", "b", "c"])[0]
    router = make_router()
    pending = PendingRequest(args=[request("x")], kwargs={}, metadata=RequestMetadata("r", "t"))
    for _ in range(HOLD_TRIES):  # the home did not answer in time: Serve asks again
        ranks = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
        assert [[r.name for r in rank] for rank in ranks] == [[home]]  # type: ignore[attr-defined]
        assert pending.routing_context.should_backoff  # Serve sleeps before the next round
    ranks = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
    assert len(ranks) > 1 and ranks[0][0].name == home  # type: ignore[attr-defined]  # then it may spill
    base = PendingRequest(args=[request(None)], kwargs={}, metadata=RequestMetadata("r2", "t"))
    assert len(await router.choose_replicas(replicas, base)) > 1  # type: ignore[arg-type]  # base: never held


async def test_a_burst_fulfilled_before_any_send_still_spills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's routing task can fulfil every request queued behind a busy ingress before any is sent (a
    send is what moves its queue-length cache): the router counts its own picks until the cache moves,
    so the home takes its share and the rest spill (CI once saw a whole burst stay home)."""
    home = rendezvous_order("x", ["a", "b"])[0]
    cache = {FakeId("a"): 0, FakeId("b"): 0}  # fresh from earlier traffic, as after a warm-up request
    monkeypatch.setattr(AdapterAwareRouter, "replica_queue_len_cache", property(lambda self: cache))
    replicas = [FakeReplica(n) for n in ("a", "b")]  # no routing stats yet: capacity as configured
    router = make_router(spill_factor=0.5, max_num_seqs=4)  # overloaded at 2
    chosen = []
    for i in range(4):  # all decided before Serve's on_send_request runs for any of them
        pending = PendingRequest(args=[request("x")], kwargs={}, metadata=RequestMetadata(f"r{i}", "t"))
        ranks = await router.choose_replicas(replicas, pending)  # type: ignore[arg-type]
        chosen.append(serve_pick(ranks[0], cache).name)  # type: ignore[arg-type]
    assert chosen[:2] == [home, home] and chosen.count(home) == 2, chosen  # then both are full
    cache[FakeId(home)] = 2  # the sends arrive: the cache counts them and the router stops its own count
    assert router._load(replicas[0 if home == "a" else 1]) == 2  # type: ignore[arg-type]
