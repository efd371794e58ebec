"""An adapter the engine cannot serve ends only its own request: on the real AsyncEngine with the tiny
model, each trigger (an adapter the store does not have, the store down before the node cached it, an
adapter deleted while it had traffic, its files vanished, a lowered max_lora_rank, a stored version without
its config, a bug while queueing) fails that request with a named error while a neighbour's stream runs to
its end and the loop lives on. The store is never read on the loop thread, and a failed load is tried
again after its backoff."""

import asyncio
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from moto.server import ThreadedMotoServer

from adapters.errors import (
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterRankTooLarge,
    AdapterStoreUnavailable,
)
from adapters.ref import AdapterRef
from adapters.store import AdapterStore
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import (
    EngineRequest,
    FinishReason,
    RequestFailed,
    RequestOutput,
    SamplingParams,
)
from tests.adapters.test_object_store import AWS_ENV
from tests.app.conftest import free_port
from tests.engine.helpers import running
from tests.model_fixtures import TinySetup

NEIGHBOUR = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)  # runs through every failure
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
WAIT_S = 30.0  # only reached if something hangs
RETRY_S = 2.0  # the engines' first backoff after a failed load


def engine_config(store: str | Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "model": "",
        "dtype": "float32",
        "adapter_store": store,
        "max_loras": 4,
        "max_lora_rank": 8,  # an operator lowered it: demo-poet (rank 16) no longer fits
        "block_size": 4,
        "num_kv_blocks": 256,
        "adapter_retry_s": RETRY_S,
        **overrides,
    }
    return EngineConfig(**settings)


@pytest.fixture(scope="module")
def engine(llama: TinySetup) -> Iterator[AsyncEngine]:
    with running(engine_config(llama.store_root, model=llama.model_dir)) as engine:
        yield engine


async def outputs(engine: AsyncEngine, request_id: str, params: SamplingParams, ref: AdapterRef | None = None
                  ) -> list[RequestOutput]:  # fmt: skip
    return [out async for out in engine.generate(EngineRequest(request_id, [1, 2, 3], params, ref))]


async def served(engine: AsyncEngine, request_id: str, ref: AdapterRef | None = None) -> bool:
    """A short request ran to its end (with `ref`, or on the base model)."""
    outs = await outputs(engine, request_id, SHORT, ref)
    return outs[-1].finish_reason is FinishReason.LENGTH and len([t for o in outs for t in o.token_ids]) == 4


async def reconcile(
    engine: AsyncEngine,
    *,
    live: set[str],
    pinned: set[AdapterRef] | None = None,
    prefetch: list[AdapterRef] | None = None,
) -> None:
    """A registry watcher's pass: adapters not `live` are dropped from every tier."""
    done = engine.reconcile_adapters(live=live, pinned=pinned or set(), prefetch=prefetch or [])
    await asyncio.wrap_future(done)


class Neighbour:
    """Another tenant's long stream, running while a request fails beside it."""

    def __init__(self, engine: AsyncEngine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.tokens = 0
        self.streaming = asyncio.Event()
        self.task: asyncio.Task[list[RequestOutput]] | None = None

    async def __aenter__(self) -> "Neighbour":
        self.task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.streaming.wait(), WAIT_S)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        if exc[0] is not None:
            self.task.cancel()
            return
        outs = await asyncio.wait_for(self.task, WAIT_S)
        assert outs[-1].finish_reason is FinishReason.LENGTH, outs[-1]
        assert self.tokens == NEIGHBOUR.max_tokens
        assert self.engine.running, f"the engine loop died: {self.engine.error}"
        assert await served(self.engine, f"{self.name}-after"), "the engine serves on"

    async def _run(self) -> list[RequestOutput]:
        outs = []
        async for out in self.engine.generate(EngineRequest(self.name, [4, 5, 6], NEIGHBOUR)):
            outs.append(out)
            self.tokens += len(out.token_ids)
            self.streaming.set()
        return outs

    def running(self) -> bool:
        return self.task is not None and not self.task.done()


@pytest.fixture
def stored(llama: TinySetup) -> Iterator[Callable[[str, str], AdapterRef]]:
    """stored(id, demo adapter) puts a copy of a demo adapter into the local store; removed afterwards."""
    store = AdapterStore(llama.store_root)
    made: list[str] = []

    def put(adapter_id: str, demo: str) -> AdapterRef:
        made.append(adapter_id)
        return store.put_dir(adapter_id, llama.adapter_dirs[demo])

    yield put
    for adapter_id in made:
        shutil.rmtree(llama.store_root / adapter_id, ignore_errors=True)


async def test_an_adapter_the_store_does_not_have(engine: AsyncEngine) -> None:
    """The reproduction: this request ended the loop, and its neighbour with EngineStopped."""
    async with Neighbour(engine, "n-missing") as neighbour:
        with pytest.raises(AdapterNotFound):
            await outputs(engine, "missing", SHORT, AdapterRef("never-uploaded", 1))
        assert neighbour.running()
    assert engine.stats().waiting == 0


async def test_a_lowered_max_lora_rank(engine: AsyncEngine, llama: TinySetup) -> None:
    async with Neighbour(engine, "n-rank") as neighbour:
        with pytest.raises(AdapterRankTooLarge, match="16"):
            await outputs(engine, "too-big", SHORT, llama.refs["demo-poet"])
        assert neighbour.running()


async def test_a_stored_version_without_its_config(
    engine: AsyncEngine, llama: TinySetup, stored: Callable[[str, str], AdapterRef]
) -> None:
    ref = stored("configless", "demo-sql")
    (llama.store_root / "configless" / "v1" / "adapter_config.json").unlink()
    async with Neighbour(engine, "n-configless") as neighbour:
        with pytest.raises(AdapterLoadFailed, match=r"adapter_config\.json"):  # the store's fault: a 503
            await outputs(engine, "configless", SHORT, ref)
        assert neighbour.running()


async def test_an_adapter_deleted_while_it_has_traffic(
    engine: AsyncEngine, llama: TinySetup, stored: Callable[[str, str], AdapterRef]
) -> None:
    ref = stored("deleted", "demo-sql")
    assert await served(engine, "before-delete", ref)
    async with Neighbour(engine, "n-deleted") as neighbour:
        # The admin deletes it: the store drops its files, the registry watcher drops it from the engine.
        # A request the ingress routed with its cached name -> version still arrives.
        shutil.rmtree(llama.store_root / "deleted")
        await reconcile(engine, live=set())
        with pytest.raises(AdapterNotFound):
            await outputs(engine, "after-delete", SHORT, ref)
        assert neighbour.running()


async def test_files_vanished_fail_their_requests_until_a_retry_after_the_backoff_finds_them(
    engine: AsyncEngine, llama: TinySetup, stored: Callable[[str, str], AdapterRef], tmp_path: Path
) -> None:
    """Its config was read (the version is known here) but its weights never loaded when the files went:
    the load fails, the requests waiting on it fail with the store's answer, and so does the next one at
    once; once the files are back, a request after the backoff loads it."""
    ref = stored("vanishing", "demo-pirate")
    version = llama.store_root / "vanishing" / "v1"
    await asyncio.to_thread(engine.adapters.check, ref)
    shutil.move(version, tmp_path / "v1")
    before = engine.stats()
    async with Neighbour(engine, "n-vanished") as neighbour:
        first = await outputs(engine, "vanished-1", SHORT, ref)
        second = await outputs(engine, "vanished-2", SHORT, ref)
        for outs in (first, second):
            [out] = outs
            assert out.finished and out.finish_reason is FinishReason.ERROR
            assert isinstance(out.error, AdapterNotFound)
        assert neighbour.running()
    failed = engine.stats()
    assert failed.adapter_load_failures[str(ref)] >= 1
    assert failed.adapter_disk_loads == before.adapter_disk_loads

    shutil.move(tmp_path / "v1", version)
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await served(engine, "vanished-back", ref):
        assert asyncio.get_running_loop().time() < deadline, "never loaded again"
        await asyncio.sleep(0.2)
    after = engine.stats()
    assert after.adapter_load_retries[str(ref)] >= 1
    assert after.adapter_disk_loads[str(ref)] == 1


async def test_a_bug_while_queueing_fails_only_that_request(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    add = engine._engine.add_sequences

    def fragile(seqs: list[Any]) -> None:
        add(seqs)
        if seqs[0].group_id == "unlucky":  # half queued when it broke: its leftovers must go too
            raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(engine._engine, "add_sequences", fragile)
    async with Neighbour(engine, "n-bug") as neighbour:
        with pytest.raises(RequestFailed) as failed:
            await outputs(engine, "unlucky", SHORT)
        assert "bookkeeping" not in str(failed.value)
        assert neighbour.running()
    assert engine.stats().waiting == 0 and engine.stats().running == 0


async def test_the_store_is_never_read_on_the_loop_thread(
    engine: AsyncEngine, llama: TinySetup, stored: Callable[[str, str], AdapterRef]
) -> None:
    """A request for a version not read yet waits on a slow store (a gate here) by itself: the neighbour
    keeps decoding meanwhile. Prefetches, pins and the registry watcher's passes read nothing there
    either."""
    store = engine.adapters.store
    readers: list[str] = []
    gate = threading.Event()
    real = {name: getattr(store, name) for name in ("exists", "config_dir", "path")}

    def spy(name: str) -> Callable[[AdapterRef], Any]:
        def read(ref: AdapterRef) -> Any:
            readers.append(threading.current_thread().name)
            if name == "exists" and ref.adapter_id == "slow":
                assert gate.wait(WAIT_S), "the gate was never opened"
            return real[name](ref)

        return read

    slow, pinned, prefetched = (
        stored("slow", "demo-sql"),
        stored("pinned", "demo-legal"),
        stored("pre", "demo-pirate"),
    )
    for name in real:
        setattr(store, name, spy(name))
    try:
        async with Neighbour(engine, "n-slow") as neighbour:
            waiting = asyncio.create_task(served(engine, "slow-store", slow))
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while not readers:  # its read is under way, and stuck
                assert asyncio.get_running_loop().time() < deadline, "the store was never read"
                await asyncio.sleep(0.01)
            seen = neighbour.tokens
            while neighbour.tokens < seen + 20:  # the loop decodes on while the store hangs
                assert asyncio.get_running_loop().time() < deadline, "the neighbour stalled with the store"
                assert neighbour.running() and not waiting.done()
                await asyncio.sleep(0.01)
            gate.set()
            assert await asyncio.wait_for(waiting, WAIT_S)
            engine.pin_adapter(pinned)
            engine.prefetch_adapter(prefetched)
            live = {"slow", "pinned", "pre", *(r.adapter_id for r in llama.refs.values())}
            await reconcile(engine, live=live, pinned={pinned}, prefetch=[prefetched])
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while (
                str(prefetched) not in engine.stats().cpu_adapters
                or str(pinned) not in engine.stats().device_adapters
            ):
                assert asyncio.get_running_loop().time() < deadline, f"not loaded: {engine.stats()}"
                await asyncio.sleep(0.05)
    finally:
        gate.set()
        for name in real:
            delattr(store, name)
        await reconcile(engine, live=set())
    assert {"adapter-spec", "adapter-load"} <= {name.split("_")[0] for name in readers}, readers
    assert "engine-loop" not in readers, readers


@pytest.fixture
def s3_store() -> Iterator[tuple[ThreadedMotoServer, str]]:
    """An S3 store (moto's server over HTTP, s3fs as in production) that can be stopped and started again
    on its port."""
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {**AWS_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            patch.setenv(name, value)
        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("engine-adapters")
        yield server, "s3://engine-adapters/store"
    server.stop()


async def test_the_store_down_before_this_node_cached_the_adapter(
    llama: TinySetup, s3_store: tuple[ThreadedMotoServer, str], tmp_path: Path
) -> None:
    """A fresh node, the store down: requests for adapters it never read fail with the store's error
    (a crash loop before), the base model keeps serving, and once the store is back so do they."""
    server, url = s3_store
    ref = AdapterStore(url, cache_dir=tmp_path / "uploader").put_dir("remote", llama.adapter_dirs["demo-sql"])
    config = engine_config(url, model=llama.model_dir, adapter_cache_dir=tmp_path / "engine-cache")
    engine = AsyncEngine(config)
    try:
        async with Neighbour(engine, "n-s3") as neighbour:
            server.stop()
            before = neighbour.tokens
            try:
                with pytest.raises(AdapterStoreUnavailable):
                    await outputs(engine, "store-down", SHORT, ref)
                # The store's retries run off the loop: the neighbour decoded meanwhile (it may even have
                # finished on a fast machine, so progress is the check, not "still running").
                assert neighbour.tokens > before
            finally:
                server.start()
        assert await served(engine, "store-back", ref)  # a failed read is not remembered
    finally:
        engine.shutdown()
