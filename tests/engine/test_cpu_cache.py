"""CpuAdapterCache: background loads, failed loads retried after a backoff, LRU capacity with pins, removal,
counters."""

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import deployments.engine.adapter_tiers.cpu_cache as cpu_cache_module
from adapters.ref import AdapterRef
from adapters.spec import AdapterSpec
from adapters.weights import AdapterWeights, LoRAModuleWeights
from deployments.engine.adapter_tiers.cpu_cache import CpuAdapterCache

A, B, C, D, E = (AdapterRef(name, 1) for name in "abcde")
WAIT = 5.0  # seconds; only reached if something hangs
MakeCache = Callable[..., CpuAdapterCache]
SPEC = AdapterSpec.from_config_dict(
    {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
)


class FakeLoader:
    """Builds tiny weights per ref, counting calls. Refs can be held at a gate or made to fail."""

    def __init__(self) -> None:
        self.calls: Counter[AdapterRef] = Counter()
        self.made: dict[AdapterRef, list[AdapterWeights]] = {}
        self.errors: dict[AdapterRef, Exception] = {}
        self.on_call: Callable[[AdapterRef], None] = lambda ref: (
            None
        )  # a hook run inside the load (e.g. to advance a fake clock)
        self._gates: dict[AdapterRef, threading.Event] = {}
        self._started: dict[AdapterRef, threading.Event] = {}
        self._lock = threading.Lock()

    def hold(self, ref: AdapterRef) -> threading.Event:
        """Make loads of `ref` wait until the returned event is set."""
        with self._lock:
            return self._gates.setdefault(ref, threading.Event())

    def started(self, ref: AdapterRef) -> threading.Event:
        with self._lock:
            return self._started.setdefault(ref, threading.Event())

    def release_all(self) -> None:
        with self._lock:
            for gate in self._gates.values():
                gate.set()

    def __call__(self, ref: AdapterRef) -> AdapterWeights:
        with self._lock:
            self.calls[ref] += 1
            gate = self._gates.get(ref)
            started = self._started.setdefault(ref, threading.Event())
        started.set()
        if gate is not None:
            assert gate.wait(WAIT), f"load of {ref} was never released"
        self.on_call(ref)
        error = self.errors.get(ref)
        if error is not None:
            raise error
        weights = AdapterWeights(
            spec=SPEC,
            modules={
                "model.layers.0.self_attn.q_proj": LoRAModuleWeights(a=torch.zeros(2, 8), b=torch.zeros(8, 2))
            },
        )
        with self._lock:
            self.made.setdefault(ref, []).append(weights)
        return weights


@pytest.fixture
def loader() -> FakeLoader:
    return FakeLoader()


class FakeClock:
    """The cache's clock for backoffs: moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_cache(loader: FakeLoader, clock: FakeClock) -> Iterator[MakeCache]:
    caches: list[CpuAdapterCache] = []

    def make(capacity: int = 4, max_workers: int = 2, **backoff: float) -> CpuAdapterCache:
        cache = CpuAdapterCache(loader, capacity=capacity, max_workers=max_workers, clock=clock, **backoff)
        caches.append(cache)
        return cache

    yield make
    loader.release_all()  # never leave a worker thread blocked
    for cache in caches:
        cache.close()


def pending(cache: CpuAdapterCache, ref: AdapterRef) -> Future[AdapterWeights]:
    """Prefetch a ref that is not resident: there is always a load to wait for."""
    future = cache.prefetch(ref)
    assert future is not None
    return future


def load(cache: CpuAdapterCache, ref: AdapterRef) -> AdapterWeights:
    """Prefetch `ref` and wait for it; returns what is now resident."""
    future = cache.prefetch(ref)
    if future is not None:
        future.result(timeout=WAIT)
    weights = cache.get(ref)
    assert weights is not None
    return weights


def test_get_returns_none_until_the_prefetch_completes(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache()
    assert cache.get(A) is None  # never asked for
    gate = loader.hold(A)
    future = cache.prefetch(A)
    assert isinstance(future, Future)
    assert loader.started(A).wait(WAIT)
    assert cache.get(A) is None
    assert cache.loading() == [A]
    assert cache.resident() == []
    gate.set()
    weights = future.result(timeout=WAIT)
    assert weights is loader.made[A][0]
    assert cache.get(A) is weights
    assert cache.loading() == []
    assert cache.resident() == [A]


def test_prefetch_twice_loads_once(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache()
    gate = loader.hold(A)
    first = pending(cache, A)
    assert cache.prefetch(A) is first  # still loading: the same pending load
    gate.set()
    first.result(timeout=WAIT)
    assert cache.prefetch(A) is None  # resident: nothing to do
    assert loader.calls[A] == 1
    assert cache.loads == 1


def test_a_failed_load_is_raised_during_its_backoff_and_retried_after_it(
    make_cache: MakeCache, loader: FakeLoader, clock: FakeClock
) -> None:
    cache = make_cache(retry_s=2.0, retry_max_s=60.0)
    error = ValueError("corrupt adapter")
    loader.errors[A] = error
    future = pending(cache, A)
    with pytest.raises(ValueError, match="corrupt adapter"):
        future.result(timeout=WAIT)
    clock.now += 1.9  # within the backoff: remembered, raised at once, and no load is started
    for _ in range(2):
        with pytest.raises(ValueError, match="corrupt adapter") as raised:
            cache.get(A)
        assert raised.value is error
    assert cache.prefetch(A) is None and not cache.needs_load(A)
    assert cache.loading() == [] and cache.resident() == []
    assert loader.calls[A] == 1
    assert (cache.load_failures[str(A)], cache.load_retries[str(A)]) == (1, 0)

    clock.now += 0.1  # the backoff is over: the error no longer applies, the next prefetch loads again
    assert cache.get(A) is None and cache.needs_load(A)
    del loader.errors[A]
    gate = loader.hold(A)
    retry = cache.prefetch(A)
    assert retry is not None and retry is not future
    assert cache.get(A) is None  # the retry is pending
    gate.set()
    assert retry.result(timeout=WAIT) is cache.get(A)
    assert loader.calls[A] == 2
    assert (cache.load_failures[str(A)], cache.load_retries[str(A)]) == (1, 1)


def test_the_backoff_doubles_per_failure_up_to_its_bound_and_resets_on_success(
    make_cache: MakeCache, loader: FakeLoader, clock: FakeClock
) -> None:
    cache = make_cache(capacity=1, retry_s=1.0, retry_max_s=3.0)
    loader.errors[A] = OSError("store down")
    for backoff in (1.0, 2.0, 3.0, 3.0):  # 1, 2, 4 -> bounded at 3
        with pytest.raises(OSError, match="store down"):
            pending(cache, A).result(timeout=WAIT)
        clock.now += backoff - 0.01
        assert cache.prefetch(A) is None, f"retried before its backoff of {backoff} s"
        clock.now += 0.01
    assert (cache.load_failures[str(A)], cache.load_retries[str(A)]) == (4, 3)
    del loader.errors[A]
    load(cache, A)  # the store is back
    load(cache, B)  # A is evicted (capacity 1)
    loader.errors[A] = OSError("down again")
    with pytest.raises(OSError, match="down again"):
        pending(cache, A).result(timeout=WAIT)
    clock.now += 1.0  # the success reset the count: the first backoff again
    assert cache.prefetch(A) is not None


def test_a_failed_load_only_affects_its_own_ref(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache()
    loader.errors[A] = RuntimeError("boom")
    with pytest.raises(RuntimeError):
        pending(cache, A).result(timeout=WAIT)
    assert load(cache, B) is not None
    assert cache.get(AdapterRef("a", 2)) is None
    with pytest.raises(RuntimeError):
        cache.get(A)


def test_lru_eviction_over_capacity(make_cache: MakeCache) -> None:
    cache = make_cache(capacity=2)
    load(cache, A)
    load(cache, B)
    cache.get(A)  # A is now more recently used than B
    load(cache, C)
    assert cache.resident() == [A, C]
    assert cache.get(B) is None
    load(cache, D)
    assert cache.resident() == [C, D]


def test_capacity_eviction_skips_pinned_refs(make_cache: MakeCache) -> None:
    cache = make_cache(capacity=2)
    cache.pin(A)
    load(cache, A)
    load(cache, B)
    load(cache, C)  # A is the least recently used, but pinned: B goes
    assert cache.resident() == [A, C]
    load(cache, D)
    assert cache.resident() == [A, D]
    cache.unpin(A)
    load(cache, E)
    assert cache.resident() == [D, E]


def test_pinning_before_the_load_protects_it(make_cache: MakeCache) -> None:
    cache = make_cache(capacity=1)
    cache.pin(B)
    load(cache, A)
    load(cache, B)  # over capacity: A, not the pinned B, is dropped
    assert cache.resident() == [B]


def test_a_fresh_load_survives_when_pinned_refs_fill_the_capacity(
    make_cache: MakeCache, loader: FakeLoader
) -> None:
    cache = make_cache(capacity=1)
    cache.pin(A)
    load(cache, A)
    pending(cache, B).result(timeout=WAIT)
    assert cache.get(B) is not None


def test_remove_drops_every_version_and_its_pins(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache(capacity=4)
    a1, a2, a3 = (AdapterRef("a", v) for v in (1, 2, 3))
    cache.pin(a1)
    load(cache, a1)
    load(cache, a2)
    load(cache, B)
    loader.errors[a3] = OSError("gone")
    with pytest.raises(OSError, match="gone"):
        pending(cache, a3).result(timeout=WAIT)
    cache.remove("a")
    assert cache.resident() == [B]
    assert cache.get(a1) is None
    assert cache.get(a2) is None
    assert cache.get(a3) is None  # the remembered failure is gone too
    cache.remove("nope")
    assert cache.resident() == [B]
    # The pin went with it: a1 comes back as an ordinary, evictable ref.
    small = make_cache(capacity=1)
    small.pin(a1)
    small.remove("a")
    load(small, a1)
    load(small, B)
    assert small.resident() == [B]


def test_remove_leaves_other_adapters_alone(make_cache: MakeCache) -> None:
    cache = make_cache()
    load(cache, AdapterRef("ab", 1))
    load(cache, AdapterRef("a", 1))
    cache.remove("a")
    assert cache.resident() == [AdapterRef("ab", 1)]


def test_remove_during_a_load_keeps_the_version_out(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache()
    gate = loader.hold(A)
    future = pending(cache, A)
    assert loader.started(A).wait(WAIT)
    cache.remove("a")
    gate.set()
    future.result(timeout=WAIT)
    assert cache.resident() == []


def test_concurrent_prefetches_load_each_ref_once(make_cache: MakeCache, loader: FakeLoader) -> None:
    refs = [AdapterRef(f"r{i}", 1) for i in range(4)]
    gates = [loader.hold(ref) for ref in refs]
    cache = make_cache(capacity=8, max_workers=4)
    threads = 8
    barrier = threading.Barrier(threads)

    def prefetch_all(_: int) -> list[Future[AdapterWeights] | None]:
        barrier.wait(WAIT)
        return [cache.prefetch(ref) for ref in refs]

    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(prefetch_all, range(threads)))
    for i in range(len(refs)):  # every thread got the one pending load of each ref
        futures = {id(row[i]) for row in results}
        assert len(futures) == 1
        assert results[0][i] is not None
    assert sorted(cache.loading()) == refs
    for gate in gates:
        gate.set()
    for ref, future in zip(refs, results[0], strict=True):
        assert future is not None
        assert future.result(timeout=WAIT) is cache.get(ref)
    assert all(loader.calls[ref] == 1 for ref in refs)
    assert cache.loads == len(refs)
    assert sorted(cache.resident()) == refs


def test_concurrent_prefetch_and_get_of_one_ref(make_cache: MakeCache, loader: FakeLoader) -> None:
    cache = make_cache(max_workers=2)
    threads = 6
    barrier = threading.Barrier(threads)

    def worker(_: int) -> AdapterWeights:
        barrier.wait(WAIT)
        for _ in range(100):  # what AdapterManager does: get, else prefetch and wait
            weights = cache.get(A)
            if weights is not None:
                return weights
            future = cache.prefetch(A)
            if future is not None:
                future.result(timeout=WAIT)
        raise AssertionError("never became resident")

    with ThreadPoolExecutor(max_workers=threads) as pool:
        got = list(pool.map(worker, range(threads)))
    assert loader.calls[A] == 1
    assert all(w is got[0] for w in got)


def test_load_counters(make_cache: MakeCache, loader: FakeLoader, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(cpu_cache_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    durations = {A: 0.5, B: 0.25, C: 2.0}

    def advance(ref: AdapterRef) -> None:
        now[0] += durations[ref]

    loader.on_call = advance
    cache = make_cache()
    assert (cache.loads, cache.load_seconds) == (0, 0.0)
    load(cache, A)
    assert (cache.loads, cache.load_seconds) == (1, 0.5)
    load(cache, B)
    load(cache, A)  # resident: no load
    assert (cache.loads, cache.load_seconds) == (2, 0.75)
    loader.errors[C] = ValueError("bad")
    with pytest.raises(ValueError, match="bad"):
        pending(cache, C).result(timeout=WAIT)
    assert (cache.loads, cache.load_seconds) == (2, 0.75)  # counts completed loads only


def test_loaded_at_is_when_the_last_load_finished_on_the_cache_clock(
    make_cache: MakeCache, loader: FakeLoader, clock: FakeClock
) -> None:
    def advance(ref: AdapterRef) -> None:
        clock.now += 0.5

    loader.on_call = advance
    cache = make_cache(capacity=1)
    start = clock.now
    load(cache, A)
    assert cache.loaded_at == {A: start + 0.5}
    load(cache, B)  # evicts A, whose time stays: it answers when A last arrived
    load(cache, A)
    assert cache.loaded_at == {A: start + 1.5, B: start + 1.0}
    loader.errors[C] = ValueError("bad")
    with pytest.raises(ValueError, match="bad"):
        pending(cache, C).result(timeout=WAIT)
    assert C not in cache.loaded_at  # a failed load brought nothing
    cache.remove(A.adapter_id)
    assert A not in cache.loaded_at


def test_adapters_queued_requests_want_are_evicted_last(make_cache: MakeCache) -> None:
    cache = make_cache(capacity=2)
    load(cache, A)
    load(cache, B)
    cache.want(frozenset({A}))
    load(cache, C)  # A is the least recently used, but wanted by the queue: B goes
    assert cache.resident() == [A, C]
    cache.want(frozenset({A, C}))
    load(cache, D)  # everything left is wanted: plain LRU among them
    assert cache.resident() == [C, D]


def test_needs_load_is_false_while_resident_loading_or_failed(
    make_cache: MakeCache, loader: FakeLoader
) -> None:
    cache = make_cache()
    assert cache.needs_load(A)
    gate = loader.hold(A)
    future = pending(cache, A)
    assert not cache.needs_load(A)  # loading
    gate.set()
    future.result(timeout=WAIT)
    assert not cache.needs_load(A)  # resident
    loader.errors[B] = RuntimeError("corrupt")
    with pytest.raises(RuntimeError):
        pending(cache, B).result(timeout=WAIT)
    assert not cache.needs_load(B)  # failed: not before its backoff is over
