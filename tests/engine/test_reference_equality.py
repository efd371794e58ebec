"""Greedy decoding through the engine equals HF PEFT with each request's adapter alone, token for token.

One run per architecture mixes five adapters (ranks 4-16, different target sets, rsLoRA, rank_pattern) and
base-model requests arriving at different steps, with fewer device slots than adapters, chunked prefill,
prefix-cache hits and forced preemptions; every chosen token's logprob is held to PEFT's within 1e-4 (fp32).
Each architecture runs on our forward (DecoderForward), not HF's: Phi-3 (adapters on its fused qkv_proj and
gate_up_proj), Qwen3 (q/k norms, sliding layers per layer_types) and Gemma 3 (its norms, GeGLU, local/global
rope tables, a final softcap) included. The
engine's bookkeeping is checked on the same run.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.decoder_forward import DecoderForward
from deployments.engine.outputs import RequestOutput
from deployments.engine.sampling_params import SamplingParams
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup


@dataclass(frozen=True)
class Arrival:
    step: int
    request_id: str
    adapter: str | None
    prompt: list[int]
    max_tokens: int


TOLERANCE = 1e-4  # fp32 logprobs against PEFT's
SHARED = list(range(40, 70))  # 30 tokens: 7 full blocks of 4, so a follow-up reuses 28


def script() -> list[Arrival]:
    return [
        Arrival(0, "sql-a", "demo-sql", SHARED, 20),
        Arrival(0, "base-a", None, list(range(100, 112)), 20),
        Arrival(2, "pirate-long", "demo-pirate", list(range(200, 270)), 30),  # > Mistral's 64-token window
        Arrival(3, "sql-follow-up", "demo-sql", [*SHARED, *range(500, 510)], 20),  # reuses sql-a's blocks
        Arrival(4, "poet-same-prefix", "demo-poet", SHARED, 20),  # same tokens, other adapter: no reuse
        Arrival(5, "legal", "demo-legal", list(range(300, 320)), 20),
        Arrival(6, "chef", "demo-chef", list(range(400, 415)), 20),
        Arrival(7, "base-b", None, SHARED, 20),
        Arrival(9, "sql-b", "demo-sql", list(range(600, 616)), 16),
    ]


def scenario_config(model_dir: Path, store_root: str | Path, **overrides: Any) -> EngineConfig:
    """The engine the script runs on (bench.gpu_check's too); `overrides`: dtype, device, cuda_graphs..."""
    settings: dict[str, Any] = {
        "model": model_dir,
        "dtype": "float32",
        "adapter_store": store_root,
        "max_loras": 3,  # five adapters compete for three slots
        "max_lora_rank": 16,
        "block_size": 4,
        "num_kv_blocks": 48,  # too few for everyone at once: forces preemption
        "max_num_batched_tokens": 32,  # the 70-token prompt is prefilled in chunks
        "max_num_seqs": 8,
    }
    return EngineConfig(**{**settings, **overrides})


def run_engine(
    engine: LLMEngine, arrivals: list[Arrival], logprobs: int | None = None
) -> dict[str, list[RequestOutput]]:
    """Greedy, each request added at its step; `logprobs`: SamplingParams.logprobs for every request."""
    outputs: dict[str, list[RequestOutput]] = {a.request_id: [] for a in arrivals}
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            ref = None if a.adapter is None else engine.adapters.store.latest(a.adapter)
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0, logprobs=logprobs)
            engine.add_request(EngineRequest(a.request_id, a.prompt, params, ref))
        for out in engine.step():
            outputs[out.request_id].append(out)
        step += 1
        assert step < 2000, "engine did not finish"
    return outputs


def assert_equals_peft(
    reference: PeftReference, arrivals: list[Arrival], outputs: dict[str, list[RequestOutput]], label: str
) -> None:
    """Each request's greedy tokens are PEFT's alone, and each chosen token's logprob (SamplingParams
    logprobs=0) is PEFT's teacher-forced one within TOLERANCE."""
    for a in arrivals:
        got = [t for out in outputs[a.request_id] for t in out.token_ids]
        want = reference.greedy(a.prompt, a.adapter, a.max_tokens)
        assert got == want, f"{label} {a.request_id} ({a.adapter}) diverged from PEFT"
        logprobs = [lp.logprob for out in outputs[a.request_id] for lp in out.logprobs or ()]
        teacher = torch.log_softmax(reference.all_logits([*a.prompt, *got], a.adapter), dim=-1)
        rows = teacher[len(a.prompt) - 1 : -1]  # the distribution each generated token was chosen from
        peft = rows.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert logprobs == pytest.approx(peft.tolist(), abs=TOLERANCE), f"{label} {a.request_id} logprobs"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3", "qwen3", "gemma3_text"])
def test_mixed_batch_equals_peft_per_request(tiny_setups: dict[str, TinySetup], arch: str) -> None:
    setup = tiny_setups[arch]
    engine = LLMEngine(scenario_config(setup.model_dir, setup.store_root))
    assert isinstance(engine.runner.forward, DecoderForward), f"{arch} fell back to HF's forward"
    for ref in setup.refs.values():  # loads finishing mid-run would make the schedule timing-dependent
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()
    arrivals = script()
    outputs = run_engine(engine, arrivals, logprobs=0)

    assert_equals_peft(PeftReference(setup.model_dir, setup.adapter_dirs), arrivals, outputs, arch)

    final = {rid: outs[-1] for rid, outs in outputs.items()}
    assert all(out.finished and out.usage is not None for out in final.values())
    usage = {rid: out.usage for rid, out in final.items() if out.usage is not None}
    assert usage["sql-follow-up"].cached_prompt_tokens == 28
    assert usage["poet-same-prefix"].cached_prompt_tokens == 0  # same tokens under another adapter
    assert engine.scheduler.num_preemptions > 0, "the run was meant to force a preemption"
    assert engine.adapters.slots.evictions > 0, "the run was meant to swap adapters through the slots"
    # Everything is released at the end: all KV blocks free (cached or not), no slot in use.
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(engine.adapters.slots.users(s) == 0 for s in range(engine.adapters.slots.num_slots))
    # GPU time: the requests' shares add up to the engine's measured busy time.
    total_gpu_ms = sum(u.gpu_ms for u in usage.values())
    assert total_gpu_ms == pytest.approx(engine.counters.busy_seconds * 1e3, rel=1e-9)
    engine.close()


@pytest.mark.parametrize("page_rank", [3, 8])
def test_adapters_in_pages_of_any_width_equal_peft(tiny_setups: dict[str, TinySetup], page_rank: int) -> None:
    """The same run with adapter memory in pages of 3 rank units (rank 16 in six pages, the last part zeros;
    rank 4 in two) and of 8 (rank 16 in two); the default of 16 (one page an adapter here) runs above."""
    setup = tiny_setups["llama"]
    engine = LLMEngine(scenario_config(setup.model_dir, setup.store_root, lora_page_rank=page_rank))
    assert engine.loaded.lora_page_rank == page_rank
    assert engine.adapters.slots.num_slots == 3 * -(-16 // page_rank)
    for ref in setup.refs.values():
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()
    arrivals = script()
    outputs = run_engine(engine, arrivals, logprobs=0)
    assert_equals_peft(
        PeftReference(setup.model_dir, setup.adapter_dirs), arrivals, outputs, f"pages of {page_rank}"
    )
    assert engine.adapters.slots.evictions > 0, "the run was meant to swap adapters through the pages"
    engine.close()
