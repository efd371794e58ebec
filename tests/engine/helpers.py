"""Small drivers for engine tests."""

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from adapters.ref import AdapterRef
from deployments.engine.config import EngineConfig
from deployments.engine.interface import AsyncEngine, EngineRequest, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.outputs import RequestOutput
from tests.model_fixtures import TinySetup


def tiny_config(setup: TinySetup, **overrides: Any) -> EngineConfig:
    """The tiny model in fp32 over its adapter store, 256 KV blocks of 4 tokens; `overrides`: any field."""
    settings: dict[str, Any] = {
        "model": setup.model_dir,
        "dtype": "float32",  # the references are fp32 PEFT
        "adapter_store": setup.store_root,
        "block_size": 4,
        "num_kv_blocks": 256,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def make_engine(setup: TinySetup, **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {
        "max_loras": 4,
        "max_lora_rank": 16,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 16,
    }
    return LLMEngine(tiny_config(setup, **{**settings, **overrides}))


@contextlib.contextmanager
def running(config: EngineConfig) -> Iterator[AsyncEngine]:
    """An AsyncEngine on `config`, shut down when the block ends, however it ends."""
    engine = AsyncEngine(config)
    try:
        yield engine
    finally:
        engine.shutdown()


def preload(engine: LLMEngine, setup: TinySetup) -> None:
    """Load every demo adapter into CPU memory so the schedule does not depend on load timing."""
    for ref in setup.refs.values():
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()


def drain(engine: LLMEngine, max_steps: int = 5000) -> dict[str, list[RequestOutput]]:
    """Step until idle; outputs per request."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if engine.counters.last_step_tokens == 0:  # only adapter loads are pending: give them time
            time.sleep(0.002)
    raise AssertionError("engine did not finish")


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(out.text for out in outputs)


def copy_adapter(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def queued_adapters(setup: TinySetup) -> tuple[LLMEngine, list[AdapterRef]]:
    """An engine with one slot and one row whose stats name two adapters, and adapters x, y, z, w: x's
    request runs; y queues three requests, z two and w one (in that order), and the queue figures are fresh.
    The caller drains and closes it."""
    engine = make_engine(setup, max_loras=1, max_num_seqs=1, stats_top_adapters=2, adapter_wait_bound_s=0)
    preload(engine, setup)
    refs = [setup.refs[n] for n in ("demo-sql", "demo-poet", "demo-pirate", "demo-chef")]
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    engine.add_request(EngineRequest("x-0", [11, 12, 13], replace(params, max_tokens=8), refs[0]))
    engine.step()
    for ref, count in zip(refs[1:], (3, 2, 1), strict=True):
        for i in range(count):
            engine.add_request(EngineRequest(f"{ref}-{i}", [20 + i, 30, 40], params, ref))
    engine.step()  # a scheduling pass orders the rotation
    engine._queue_stats = None  # the queue figures are refreshed at most every 0.5 s: now
    return engine, refs
