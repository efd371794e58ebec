"""Bad input raises a named error at once, and the engine keeps serving everyone else."""

import json

import pytest
from safetensors.torch import load_file, save_file

from adapters.errors import AdapterNotFound, AdapterRankTooLarge, UnsupportedAdapter
from adapters.ref import AdapterRef
from adapters.store import AdapterStore
from deployments.engine.errors import (
    DuplicateRequestId,
    EmptyPrompt,
    InvalidRequest,
    InvalidSamplingParams,
    PromptTooLong,
)
from deployments.engine.interface import EngineRequest, FinishReason
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, tokens
from tests.model_fixtures import TinySetup

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def test_bad_requests_raise_named_errors_and_others_are_served(llama: TinySetup) -> None:
    engine = make_engine(llama)
    engine.add_request(EngineRequest("ok-before", [1, 2, 3, 4], GREEDY, llama.refs["demo-sql"]))
    engine.step()

    with pytest.raises(AdapterNotFound):
        engine.add_request(EngineRequest("x1", [1, 2, 3], GREEDY, AdapterRef("no-such-adapter", 1)))
    with pytest.raises(AdapterNotFound):
        engine.add_request(EngineRequest("x2", [1, 2, 3], GREEDY, AdapterRef("demo-sql", 99)))
    with pytest.raises(EmptyPrompt):
        engine.add_request(EngineRequest("x3", [], GREEDY))
    with pytest.raises(PromptTooLong) as too_long:
        engine.add_request(EngineRequest("x4", [1] * engine.max_model_len, GREEDY))
    assert str(engine.max_model_len) in str(too_long.value)
    with pytest.raises(PromptTooLong):
        engine.add_request(EngineRequest("x5", [1] * 10, SamplingParams(max_tokens=engine.max_model_len)))
    with pytest.raises(InvalidRequest, match="token ids"):
        engine.add_request(EngineRequest("x6", [1, engine.vocab_size], GREEDY))
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(InvalidSamplingParams, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(DuplicateRequestId):
        engine.add_request(EngineRequest("ok-before", [1, 2], GREEDY))

    engine.add_request(EngineRequest("ok-after", [5, 6, 7], GREEDY, llama.refs["demo-poet"]))
    outputs = drain(engine)
    assert set(outputs) == {"ok-before", "ok-after"}
    for outs in outputs.values():
        assert outs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert len(tokens(outs)) >= 1
    engine.close()


def test_rank_over_the_limit_and_unsupported_options_are_refused(llama: TinySetup, tmp_path) -> None:
    store = AdapterStore(llama.store_root)
    engine = make_engine(llama, max_lora_rank=8)
    with pytest.raises(AdapterRankTooLarge, match="16"):  # demo-poet has rank 16
        engine.add_request(EngineRequest("r", [1, 2, 3], GREEDY, llama.refs["demo-poet"]))

    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((llama.adapter_dirs["demo-sql"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    save_file(
        load_file(llama.adapter_dirs["demo-sql"] / "adapter_model.safetensors"),
        dora / "adapter_model.safetensors",
    )
    ref = store.put_dir("dora-adapter", dora)
    with pytest.raises(UnsupportedAdapter, match="use_dora"):
        engine.add_request(EngineRequest("d", [1, 2, 3], GREEDY, ref))
    store.delete("dora-adapter")

    engine.add_request(EngineRequest("fine", [1, 2, 3], GREEDY, llama.refs["demo-sql"]))
    assert drain(engine)["fine"][-1].finished
    engine.close()


def test_adapter_that_fails_to_load_fails_only_its_request(llama: TinySetup, tmp_path) -> None:
    store = AdapterStore(llama.store_root)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(
        (llama.adapter_dirs["demo-sql"] / "adapter_config.json").read_text()
    )
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    ref = store.put_dir("broken-adapter", broken)
    engine = make_engine(llama)
    engine.add_request(EngineRequest("bad", [1, 2, 3], GREEDY, ref))
    engine.add_request(EngineRequest("good", [1, 2, 3], GREEDY))
    outputs = drain(engine)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert outputs["bad"][-1].error
    assert outputs["bad"][-1].usage is not None
    assert outputs["good"][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    store.delete("broken-adapter")
    engine.close()


def test_a_row_that_cannot_be_sampled_fails_alone(llama: TinySetup, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(llama)
    sample = engine.sampler.sample_on_device

    def fragile(logits, rows):
        if any(row.params.seed == 666 for row in rows):  # stands for parameters that overflow the sampler
            raise IndexError("index out of range")
        return sample(logits, rows)

    monkeypatch.setattr(engine.sampler, "sample_on_device", fragile)
    engine.add_request(EngineRequest("bad", [1, 2, 3], SamplingParams(max_tokens=8, seed=666)))
    engine.add_request(EngineRequest("good", [4, 5, 6], GREEDY, llama.refs["demo-sql"]))
    outputs = drain(engine)
    assert outputs["bad"][-1].finish_reason is FinishReason.ERROR
    assert outputs["good"][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert len(tokens(outputs["good"])) >= 1
    assert engine.stats().running == 0 and engine.blocks.usage == 0  # the failed row's blocks are free
    engine.close()
