"""A step built as chunks (StepChunks: what the paged prefill kernel reads, one launch per layer) gives what
the split path gives (decode rows batched, one SDPA call per prefill span), token for token.

Runs on every machine: the chunk attention here is the plain-torch reference of the kernel's tests, fed the
engine's own chunk metadata (first rows, lengths, contexts, block tables), in mixed steps with decode rows,
cached prefixes that end mid-block, prompt logprobs and (Mistral; Qwen3 and Gemma 3 in some layers) a sliding
window shorter than a prompt.
The kernel itself runs in tests/engine/test_prefill_attention.py.
"""

from typing import Any

import pytest
import torch

import deployments.engine.model.model_runner as model_runner
from deployments.engine.interface import EngineRequest, SamplingParams
from deployments.engine.model.layer_ops import TorchOps
from tests.engine.helpers import drain, make_engine, preload, tokens
from tests.engine.test_prefill_attention import reference_prefill
from tests.engine.test_step_buffers import requests as buffer_requests
from tests.model_fixtures import TinySetup


class ReferenceChunkOps(TorchOps):
    """TorchOps whose steps attend as chunks, through the kernel's plain-torch reference."""

    paged_prefill = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []  # (query lengths, cached lengths) per call

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        chunks = list(zip(query_start.tolist(), query_len.tolist(), context_len.tolist(), strict=True))
        self.calls.append(([n for _, n, _ in chunks], [c - n for _, n, c in chunks]))
        window = sliding_window
        found = reference_prefill(q, k_cache, v_cache, chunks, block_tables, block_size, scale, window)
        for start, rows in found.items():
            out[start : start + rows.shape[0]] = rows.to(out.dtype)


def run(setup: TinySetup, ops: TorchOps, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setattr(model_runner, "layer_ops_for", lambda device: ops)
    engine = make_engine(setup)
    preload(engine, setup)
    names = list(setup.refs)
    prompt = [(7 * i + 3) % 200 + 1 for i in range(150)]  # longer than the step's 64 tokens: chunked
    long = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    echo = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    extra = [
        EngineRequest("long", prompt, long, setup.refs[names[1]]),
        EngineRequest("echo", [*prompt[:90], 5, 6], echo),
    ]
    for request in [*buffer_requests(setup), *extra]:
        engine.add_request(request)
    outputs = drain(engine)
    engine.close()
    return {
        rid: (
            tokens(outs),
            [lp.logprob for out in outs for lp in out.logprobs or ()],
            [lp.logprob for out in outs for lp in out.prompt_logprobs or () if lp is not None],
        )
        for rid, outs in outputs.items()
    }


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3_text"])
def test_steps_built_as_chunks_equal_the_split_path(
    tiny_setups: dict[str, TinySetup], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = tiny_setups[arch]
    want = run(setup, TorchOps(), monkeypatch)
    ops = ReferenceChunkOps()
    got = run(setup, ops, monkeypatch)
    # The chunk path really ran, on mixed steps: decode rows beside a prefill chunk whose cached prefix
    # ends mid-block (block_size 4).
    assert any(1 in lengths and any(n > 1 and c % 4 for n, c in zip(lengths, cached, strict=True))
               for lengths, cached in ops.calls)  # fmt: skip
    assert {rid: t for rid, (t, _, _) in got.items()} == {rid: t for rid, (t, _, _) in want.items()}
    for rid, (_, logprobs, prompt_logprobs) in want.items():  # einsum vs SDPA: the last bits may differ
        assert got[rid][1] == pytest.approx(logprobs, abs=1e-5)
        assert got[rid][2] == pytest.approx(prompt_logprobs, abs=1e-5)
