"""Prompt logprobs (echo) inside the engine's memory plan: a step computes the vocabulary-wide logits of at
most `prompt_logprob_rows` prompt positions, sized from prompt_logprobs_memory_mb, so a long echoed prompt
is prefilled in chunks of that many positions, never max_num_batched_tokens x vocab at once."""

import pytest
import torch

from deployments.engine.interface import EngineRequest, SamplingParams, TokenLogprob
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sequence import ScheduledSequence
from tests.engine.helpers import drain, make_engine
from tests.model_fixtures import TinySetup

ECHO = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, logprobs=0)
PROMPTS = {"long": list(range(10, 90)), "other": list(range(300, 340)), "plain": list(range(500, 530))}


def _serve(engine: LLMEngine) -> tuple[dict[str, list[TokenLogprob | None]], list[int]]:
    """Every prompt at once (echo for two, plain decoding for one): each echo's prompt logprobs, and per step
    the logits rows the model runner returned at prompt positions."""
    rows: list[int] = []
    run_step = engine.runner.run

    def counting(scheduled: list[ScheduledSequence]) -> torch.Tensor:
        logits = run_step(scheduled)
        rows.append(logits.shape[0] - sum(item.draws for item in scheduled))  # the rest are sampling rows
        return logits

    engine.runner.run = counting  # type: ignore[method-assign]
    for rid, prompt in PROMPTS.items():
        params = SamplingParams(max_tokens=8, temperature=0) if rid == "plain" else ECHO
        engine.add_request(EngineRequest(rid, prompt, params))
    outputs = drain(engine)
    got = {}
    for rid in ("long", "other"):
        lps = outputs[rid][0].prompt_logprobs
        assert lps is not None and len(lps) == len(PROMPTS[rid])
        got[rid] = lps
    return got, rows


def test_a_step_holds_at_most_its_prompt_logprob_rows(llama: TinySetup) -> None:
    unbounded = make_engine(llama)  # 64 tokens a step: both echoes' rows in one step
    want, rows = _serve(unbounded)
    assert max(rows) > 5
    unbounded.close()

    bounded = make_engine(llama, max_prompt_logprob_rows=5)
    got, rows = _serve(bounded)
    assert bounded.prompt_logprob_rows == 5 and max(rows) <= 5
    assert sum(rows) == len(PROMPTS["long"]) - 1 + len(PROMPTS["other"]) - 1  # each position once
    for rid, lps in got.items():
        for a, b in zip(lps[1:], want[rid][1:], strict=True):
            assert a is not None and b is not None and a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4) and a.top[0][0] == b.top[0][0]
    bounded.close()


def test_the_row_bound_is_sized_from_its_memory_budget(llama: TinySetup) -> None:
    engine = make_engine(llama, max_num_batched_tokens=4096, max_num_seqs=16, prompt_logprobs_memory_mb=1)
    per_row = engine.vocab_size * 2 * 4  # float32 logits and their log-softmax
    assert engine.prompt_logprob_row_bytes == per_row
    assert engine.prompt_logprob_rows == 2**20 // per_row
    assert engine.prompt_logprob_rows * per_row <= 2**20 < (engine.prompt_logprob_rows + 1) * per_row
    engine.close()
    small = make_engine(llama, prompt_logprobs_memory_mb=100_000)
    assert small.prompt_logprob_rows == small.config.max_num_batched_tokens  # never above a step's tokens
    small.close()
