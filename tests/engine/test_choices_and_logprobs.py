"""Logprobs, prompt logprobs (echo), n choices, prompt lists and logit_bias in the engine.

Logprobs are checked against HF PEFT with each request's adapter alone, in fp32, in one mixed batch of
adapters and the base model where one request is a prefix-cache hit; n choices are checked to share the
prompt's prefill (the siblings compute at most the last partial block).
"""

import pytest
import torch

from deployments.engine.interface import EngineRequest, FinishReason, RequestOutput, SamplingParams
from deployments.engine.llm_engine import LLMEngine
from tests.engine.helpers import drain, make_engine, preload
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

TOLERANCE = 1e-4  # fp32, as the issue asks
SHARED = list(range(40, 70))  # 30 tokens: a follow-up with the same start reuses 7 blocks of 4


@pytest.fixture(scope="module")
def reference(llama: TinySetup) -> PeftReference:
    return PeftReference(llama.model_dir, llama.adapter_dirs)


def _ref_logprobs(reference: PeftReference, ids: list[int], adapter: str | None) -> torch.Tensor:
    return torch.log_softmax(reference.all_logits(ids, adapter), dim=-1)  # [len(ids), V]


def _by_index(outputs: list[RequestOutput]) -> dict[int, list[RequestOutput]]:
    choices: dict[int, list[RequestOutput]] = {}
    for out in outputs:
        if not out.accepted:
            choices.setdefault(out.index, []).append(out)
    return choices


def test_logprobs_equal_peft_in_a_mixed_batch_with_a_prefix_hit(
    llama: TinySetup, reference: PeftReference
) -> None:
    engine = make_engine(llama)
    preload(engine, llama)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=5)
    plain = SamplingParams(max_tokens=6, temperature=0)
    requests = [
        ("sql", "demo-sql", SHARED, SamplingParams(max_tokens=6, temperature=0, logprobs=3)),
        ("poet", "demo-poet", list(range(200, 217)), sampled),
        ("base", None, list(range(100, 112)), SamplingParams(max_tokens=6, temperature=0, logprobs=0)),
        ("quiet", "demo-legal", list(range(300, 310)), plain),  # asks for nothing: gets nothing
    ]
    for rid, adapter, prompt, params in requests:
        engine.add_request(
            EngineRequest(rid, prompt, params, None if adapter is None else llama.refs[adapter])
        )
    outputs = drain(engine)
    # The follow-up arrives once sql's blocks are cached: its logprobs come from a prefix-cache hit.
    follow_up = [*SHARED, *range(500, 506)]
    follow_params = SamplingParams(max_tokens=5, temperature=0, logprobs=2)
    engine.add_request(EngineRequest("follow", follow_up, follow_params, llama.refs["demo-sql"]))
    outputs |= drain(engine)
    follow_usage = outputs["follow"][-1].usage
    assert follow_usage is not None and follow_usage.cached_prompt_tokens == 28

    checked = 0
    for rid, adapter, prompt, params in [*requests, ("follow", "demo-sql", follow_up, follow_params)]:
        outs = outputs[rid]
        tokens = [t for out in outs for t in out.token_ids]
        lps = [lp for out in outs for lp in (out.logprobs or [])]
        if params.logprobs is None:
            assert lps == [] and all(out.logprobs is None for out in outs)
            continue
        assert [lp.token_id for lp in lps] == tokens
        want = _ref_logprobs(reference, prompt + tokens, adapter)[len(prompt) - 1 : -1]  # [T, V]
        for step, lp in enumerate(lps):
            assert lp.logprob == pytest.approx(float(want[step, lp.token_id]), abs=TOLERANCE)
            assert len(lp.top) == params.logprobs
            best = want[step].topk(params.logprobs)
            assert [t for t, _ in lp.top] == best.indices.tolist()
            for (_, got), expected in zip(lp.top, best.values.tolist(), strict=True):
                assert got == pytest.approx(expected, abs=TOLERANCE)
            checked += 1
    assert checked >= 20
    engine.close()


def test_prompt_logprobs_with_no_output_equal_peft(llama: TinySetup, reference: PeftReference) -> None:
    """Echo with max_tokens 0, as evaluation harnesses send for log-likelihood: the prompt's logprobs, no
    token generated, and the prompt billed as processed."""
    engine = make_engine(llama, max_num_batched_tokens=16)  # a 40-token prompt in three chunks
    preload(engine, llama)
    prompt = list(range(60, 100))
    # The prompt is cached first, under the same adapter: prompt logprobs must not take that shortcut.
    engine.add_request(EngineRequest("warm", prompt, SamplingParams(max_tokens=1), llama.refs["demo-chef"]))
    drain(engine)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2, temperature=0)
    engine.add_request(EngineRequest("echo", prompt, params, llama.refs["demo-chef"]))
    outs = [out for out in drain(engine)["echo"] if not out.accepted]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].token_ids == [] and outs[0].text == ""
    lps = outs[0].prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    want = _ref_logprobs(reference, prompt, "demo-chef")
    for position, lp in enumerate(lps[1:], start=1):
        assert lp is not None and lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(float(want[position - 1, prompt[position]]), abs=TOLERANCE)
        assert [t for t, _ in lp.top] == [int(i) for i in want[position - 1].topk(2).indices]
    usage = outs[0].usage
    assert usage is not None and usage.prompt_tokens == len(prompt) and usage.completion_tokens == 0
    assert usage.cached_prompt_tokens == 0
    engine.close()


def test_n_choices_share_one_prefill_and_have_their_own_seeded_streams(llama: TinySetup) -> None:
    prompt = list(range(10, 47))  # 37 tokens: 9 full blocks of 4
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=123, n=3, ignore_eos=True)

    def run(engine: LLMEngine) -> tuple[dict[int, list[int]], int, list[RequestOutput]]:
        computed: dict[str, int] = {}
        run_step = engine.runner.run

        def counting(scheduled: list) -> torch.Tensor:  # type: ignore[type-arg]
            for item in scheduled:
                computed[item.seq.request_id] = computed.get(item.seq.request_id, 0) + item.num_tokens
            return run_step(scheduled)

        engine.runner.run = counting  # type: ignore[method-assign]
        engine.add_request(EngineRequest("n3", prompt, params, llama.refs["demo-poet"]))
        outs = drain(engine)["n3"]
        choices = _by_index(outs)
        # Each sibling computes its prompt tail (< one block) and its own tokens, never the whole prompt.
        sibling_prompt = max(computed[f"n3#{i}"] - (params.max_tokens or 0) for i in (1, 2))
        return {i: [t for o in c for t in o.token_ids] for i, c in choices.items()}, sibling_prompt, outs

    engine = make_engine(llama)
    preload(engine, llama)
    tokens, sibling_prompt, outs = run(engine)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 8 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) == 3, "each choice draws from its own stream"
    assert sibling_prompt <= engine.config.block_size
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    usage = outs[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt) and usage.completion_tokens == 24
    engine.close()

    again = make_engine(llama)  # a fresh engine, same seed: the same three streams
    preload(again, llama)
    assert run(again)[0] == tokens
    again.close()


def test_a_prompt_list_gives_choices_in_openai_order(llama: TinySetup) -> None:
    engine = make_engine(llama)
    first, second = list(range(5, 15)), list(range(70, 76))
    params = SamplingParams(max_tokens=3, temperature=0, n=2)
    engine.add_request(EngineRequest("list", first, params, more_prompts=(second,)))
    engine.add_request(EngineRequest("one", first, SamplingParams(max_tokens=3, temperature=0)))
    engine.add_request(EngineRequest("two", second, SamplingParams(max_tokens=3, temperature=0)))
    outputs = drain(engine)
    choices = _by_index(outputs["list"])
    one = [t for o in outputs["one"] for t in o.token_ids]
    two = [t for o in outputs["two"] for t in o.token_ids]
    assert {i: [t for o in c for t in o.token_ids] for i, c in choices.items()} == {
        0: one,
        1: one,
        2: two,
        3: two,
    }
    usage = outputs["list"][-1].usage
    assert usage is not None and usage.prompt_tokens == len(first) + len(second)
    assert usage.completion_tokens == 12
    engine.close()


def test_logit_bias_forces_and_bans_tokens(llama: TinySetup) -> None:
    engine = make_engine(llama)
    prompt = list(range(20, 30))
    engine.add_request(EngineRequest("free", prompt, SamplingParams(max_tokens=4, temperature=0)))
    free = [t for o in drain(engine)["free"] for t in o.token_ids]
    forced = SamplingParams(max_tokens=4, temperature=0, logit_bias=((77, 100.0),))
    banned = SamplingParams(max_tokens=4, temperature=0, logit_bias=((free[0], -100.0),))
    engine.add_request(EngineRequest("forced", prompt, forced))
    engine.add_request(EngineRequest("banned", prompt, banned))
    engine.add_request(EngineRequest("beside", prompt, SamplingParams(max_tokens=4, temperature=0)))
    outputs = drain(engine)
    assert [t for o in outputs["forced"] for t in o.token_ids] == [77] * 4
    assert next(t for o in outputs["banned"] for t in o.token_ids) != free[0]
    assert [t for o in outputs["beside"] for t in o.token_ids] == free  # its neighbours' biases never leak
    engine.close()


def test_aborting_a_request_ends_every_choice(llama: TinySetup) -> None:
    engine = make_engine(llama)
    engine.add_request(EngineRequest("many", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, n=3)))
    for _ in range(3):
        engine.step()
    outs = engine.abort("many")
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert [o.finished for o in outs] == [False, False, True]
    assert all(o.finish_reason is FinishReason.ABORT for o in outs)
    assert not engine.has_unfinished() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.close()


def test_echo_with_n_choices_computes_the_prompts_logprobs_once(llama: TinySetup) -> None:
    """Echo + logprobs with n = 8: the leader computes the prompt's logprobs and every choice reports them on
    its first output; the other seven prefill from its cached blocks, so the engine runs the prompt about as
    often as for n = 1 (each sibling computes at most its last partial block)."""
    prompt = list(range(100, 250))  # 150 tokens: three chunks of 64

    def run(n: int) -> tuple[dict[int, list[RequestOutput]], int]:
        engine = make_engine(llama)
        params = SamplingParams(
            n=n, max_tokens=3, temperature=1.0, seed=11, prompt_logprobs=2, logprobs=1, ignore_eos=True
        )
        engine.add_request(EngineRequest("echo", prompt, params))
        outs = drain(engine)["echo"]
        prefilled = engine.stats().prefill_tokens
        engine.close()
        return _by_index(outs), prefilled

    one, one_prefilled = run(1)
    eight, eight_prefilled = run(8)
    assert one_prefilled == len(prompt)
    assert eight_prefilled <= len(prompt) + 7 * 4  # block_size 4: the siblings' partial last blocks
    want = one[0][0].prompt_logprobs
    assert want is not None and len(want) == len(prompt) and want[0] is None
    for index, outs in eight.items():
        first = outs[0].prompt_logprobs  # on the choice's first output, which carries a token too
        assert outs[0].token_ids and first is not None and len(first) == len(prompt) and first[0] is None
        for got, expected in zip(first[1:], want[1:], strict=True):
            assert got is not None and expected is not None
            assert got.token_id == expected.token_id and got.top[0][0] == expected.top[0][0]
            assert got.logprob == pytest.approx(expected.logprob, abs=TOLERANCE)
        assert all(out.prompt_logprobs is None for out in outs[1:]), f"choice {index}: prompt logprobs once"
    assert [t for o in eight[0] for t in o.token_ids] == [t for o in one[0] for t in o.token_ids]
    final = next(o for outs in eight.values() for o in outs if o.finished).usage
    assert final is not None and final.prompt_tokens == len(prompt) and final.completion_tokens == 24
