"""Quantized and reduced-precision bases against PEFT in the same precision, with stated tolerances.

- nf4, int8 (bitsandbytes) and AWQ: PEFT wraps the very same quantized modules, one adapter at a time;
  greedy tokens must be equal (same kernels, same weights).
- bf16: attention kernels differ (paged gather vs HF's contiguous cache), so bf16 rounding can flip a
  near-tie. Every token the engine picks must be within BF16_LOGIT_TOL of PEFT's best logit at that
  position (teacher-forced on the engine's own output).
- AWQ vs the fp32 model with the same dequantized weights: within AWQ_REL_TOL (the int4 kernel computes
  in bf16).
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

from adapters.ref import AdapterRef
from app.modelprep.awq_export import export_awq, load_dequantized_state_dict
from deployments.engine.interface import EngineRequest
from deployments.engine.sampling_params import SamplingParams
from tests.engine.helpers import drain, make_engine, preload, tokens
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

BF16_LOGIT_TOL = 0.1  # logits here are O(3); bf16 keeps ~3 significant digits
AWQ_REL_TOL = 0.03
N = 16
REQUESTS: list[tuple[str | None, list[int]]] = [
    ("demo-sql", list(range(10, 40))),
    ("demo-poet", list(range(50, 70))),
    (None, list(range(80, 100))),
    ("demo-chef", list(range(5, 30))),
    ("demo-pirate", list(range(300, 310))),
]


@dataclass(frozen=True)
class QuantSetup:
    tiny: TinySetup
    awq_dir: Path


@pytest.fixture(scope="module")
def quant(llama: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> QuantSetup:
    awq_dir = export_awq(llama.model_dir, tmp_path_factory.mktemp("awq") / "model", group_size=32)
    return QuantSetup(llama, awq_dir)


def bnb_base(model_dir: Path, mode: str) -> PreTrainedModel:
    settings = (
        {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.float32}
        if mode == "nf4"
        else {"load_in_8bit": True}
    )
    # transformers leaves BitsAndBytesConfig.__init__ unannotated
    quantization_config = BitsAndBytesConfig(**settings)  # type: ignore[no-untyped-call]
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=quantization_config, device_map="cpu"
    )


def engine_outputs(quant: QuantSetup, model_dir: Path, **config) -> list[list[int]]:
    engine = make_engine_for(quant, model_dir, **config)
    preload(engine, quant.tiny)
    refs: dict[str, AdapterRef] = quant.tiny.refs
    for i, (adapter, prompt) in enumerate(REQUESTS):
        params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params, None if adapter is None else refs[adapter]))
    outputs = drain(engine)
    engine.close()
    return [tokens(outputs[f"r{i}"]) for i in range(len(REQUESTS))]


def make_engine_for(quant: QuantSetup, model_dir: Path, **config):
    return make_engine(quant.tiny, model=model_dir, max_num_batched_tokens=32, max_num_seqs=8, **config)


@pytest.mark.filterwarnings("ignore:MatMul8bitLt")
@pytest.mark.parametrize("mode", ["nf4", "int8", "awq"])
def test_quantized_greedy_equals_peft_on_the_same_quantized_model(quant: QuantSetup, mode: str) -> None:
    tiny = quant.tiny
    base: PreTrainedModel
    if mode == "awq":
        ours = engine_outputs(quant, quant.awq_dir, quantization="awq")
        base = AutoModelForCausalLM.from_pretrained(quant.awq_dir, dtype=torch.float32, device_map="cpu")
    else:
        ours = engine_outputs(quant, tiny.model_dir, quantization=mode)
        base = bnb_base(tiny.model_dir, mode)
    reference = PeftReference(tiny.model_dir, tiny.adapter_dirs, base=base)
    for (adapter, prompt), got in zip(REQUESTS, ours, strict=True):
        assert got == reference.greedy(prompt, adapter, N), f"{mode} {adapter}"


def test_bf16_greedy_within_tolerance_of_bf16_peft(quant: QuantSetup) -> None:
    tiny = quant.tiny
    ours = engine_outputs(quant, tiny.model_dir, dtype="bfloat16")
    reference = PeftReference(tiny.model_dir, tiny.adapter_dirs, dtype=torch.bfloat16)
    worst = 0.0
    for (adapter, prompt), got in zip(REQUESTS, ours, strict=True):
        logits = reference.all_logits([*prompt, *got], adapter)[len(prompt) - 1 : -1]  # [N, V]
        chosen = logits.gather(1, torch.tensor(got)[:, None]).squeeze(1)
        worst = max(worst, float((logits.max(dim=1).values - chosen).max()))
    assert worst <= BF16_LOGIT_TOL


def test_awq_is_close_to_the_fp32_model_with_the_same_dequantized_weights(quant: QuantSetup) -> None:
    tiny = quant.tiny
    config = AutoConfig.from_pretrained(tiny.model_dir)
    # transformers leaves _BaseAutoModelClass.from_config unannotated
    dense: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    result = dense.load_state_dict(load_dequantized_state_dict(quant.awq_dir), strict=False)
    assert not result.unexpected_keys
    assert all("rotary" in k for k in result.missing_keys)
    reference = PeftReference(tiny.model_dir, tiny.adapter_dirs, base=dense)
    engine = make_engine_for(quant, quant.awq_dir, quantization="awq")
    preload(engine, tiny)
    captured: dict[str, torch.Tensor] = {}
    run = engine.runner.run

    def capture(scheduled):
        logits = run(scheduled)
        for item, row in zip([s for s in scheduled if s.samples], logits, strict=True):
            captured.setdefault(item.seq.request_id, row.clone())
        return logits

    engine.runner.run = capture
    for i, (adapter, prompt) in enumerate(REQUESTS):
        engine.add_request(
            EngineRequest(
                f"r{i}", prompt, SamplingParams(max_tokens=1), None if adapter is None else tiny.refs[adapter]
            )
        )
    drain(engine)
    for i, (adapter, prompt) in enumerate(REQUESTS):
        want = reference.last_logits(prompt, adapter)
        rel = float((captured[f"r{i}"] - want).abs().max() / want.abs().max())
        assert rel <= AWQ_REL_TOL, f"{adapter}: {rel:.3f}"
    engine.close()


def test_memory_footprint_is_reported_and_quantization_shrinks_it(quant: QuantSetup) -> None:
    sizes = {}
    for name, model_dir, config in [
        ("fp32", quant.tiny.model_dir, {}),
        ("bf16", quant.tiny.model_dir, {"dtype": "bfloat16"}),
        ("nf4", quant.tiny.model_dir, {"quantization": "nf4"}),
        ("awq", quant.awq_dir, {"quantization": "awq"}),
    ]:
        engine = make_engine_for(quant, model_dir, **config)
        sizes[name] = engine.loaded.weights_bytes
        engine.close()
    # The tiny model is mostly embeddings, which stay in the compute dtype (fp32) under nf4 and AWQ.
    assert sizes["fp32"] > sizes["bf16"]
    assert sizes["fp32"] > sizes["nf4"]
    assert sizes["fp32"] > sizes["awq"]
