"""AdapterSpecs: one store read per version however many ask at once, cached after, a failure not
remembered, and a read cancelled before it ran never blocks the next one."""

import threading
from collections import Counter

import pytest

from adapters.errors import AdapterStoreUnavailable
from adapters.ref import AdapterRef
from adapters.spec import AdapterSpec
from deployments.engine.adapter_tiers.spec_cache import AdapterSpecs

A, B = AdapterRef("a", 1), AdapterRef("b", 1)
SPEC = AdapterSpec.from_config_dict(
    {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
)
WAIT_S = 5.0  # only reached if something hangs


class Store:
    """Reads that count, can be held at a gate, or fail."""

    def __init__(self) -> None:
        self.reads: Counter[AdapterRef] = Counter()
        self.gate = threading.Event()
        self.started = threading.Event()
        self.down = False

    def read(self, ref: AdapterRef) -> AdapterSpec:
        self.reads[ref] += 1
        self.started.set()
        assert self.gate.wait(WAIT_S), "never released"
        if self.down:
            raise AdapterStoreUnavailable("s3://bucket", "connection refused")
        return SPEC


def test_concurrent_fetches_share_one_read_and_the_spec_is_cached() -> None:
    store = Store()
    specs = AdapterSpecs(store.read)
    first, second = specs.fetch(A), specs.fetch(A)
    assert first is second and specs.cached(A) is None
    store.gate.set()
    assert first.result(WAIT_S) is SPEC and specs.cached(A) is SPEC
    assert specs.read(A) is SPEC and store.reads[A] == 1
    specs.forget("a")
    assert specs.cached(A) is None and specs.known() == set()
    specs.close()


def test_a_failed_read_is_not_remembered() -> None:
    store = Store()
    store.gate.set()
    store.down = True
    specs = AdapterSpecs(store.read)
    with pytest.raises(AdapterStoreUnavailable):
        specs.read(A)
    store.down = False  # the store is back: the next request reads again
    assert specs.read(A) is SPEC and store.reads[A] == 2
    specs.close()


def test_a_read_cancelled_before_it_ran_does_not_block_the_next() -> None:
    store = Store()
    specs = AdapterSpecs(store.read, max_workers=1)
    busy = specs.fetch(A)  # holds the only worker
    assert store.started.wait(WAIT_S)
    queued = specs.fetch(B)
    assert queued.cancel()  # what a caller's cancellation does to a read still queued
    again = specs.fetch(B)
    assert again is not queued
    store.gate.set()
    assert busy.result(WAIT_S) is SPEC and again.result(WAIT_S) is SPEC
    specs.close()
