"""AWQ checkpoints of the families tenants fine-tune today (Qwen3, Gemma 3 text, Phi-3 with its fused
qkv_proj and gate_up_proj quantized whole) load on our forward, with our AWQ linear, and serve the engine's
reference-equality scenario (adapters and the base arriving at different steps, fewer slots than adapters,
chunked prefill, forced preemption) equal to HF PEFT over the checkpoint's dequantized weights: greedy
tokens exactly, logprobs within the scenario's tolerance (both fp32; only the sums' order differs).

Without CUDA our AWQ kernels run through Triton's interpreter on CPU tensors; skipped without Triton.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from app.modelprep.awq_export import export_awq, load_dequantized_state_dict
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.awq_base import AwqLinear
from deployments.engine.model.decoder_forward import DecoderForward
from tests.engine.reference import PeftReference
from tests.engine.test_reference_equality import assert_equals_peft, run_engine, scenario_config, script
from tests.model_fixtures import TinySetup

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter cases; on CUDA bench.gpu_check's awq step runs them"
)
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
PHI3_PROJECTIONS = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
REQUESTS = ("sql-a", "base-a", "pirate-long", "sql-follow-up", "legal")


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "phi3"])
def test_an_awq_checkpoint_runs_on_our_forward_equal_to_peft_over_its_dequantized_weights(
    arch: str, tiny_setups: dict[str, TinySetup], tmp_path: Path
) -> None:
    setup = tiny_setups[arch]
    awq_dir = export_awq(setup.model_dir, tmp_path / "awq", group_size=32)
    config = scenario_config(awq_dir, setup.store_root, quantization="awq", awq_kernel="ours")
    engine = LLMEngine(config)
    assert isinstance(engine.runner.forward, DecoderForward), f"{arch} AWQ fell back to HF's forward"
    model = engine.loaded.model
    names = [name for name, module in model.named_modules() if isinstance(module, AwqLinear)]
    quantized = {part for name in names for part in name.split(".") if part.endswith("_proj")}
    assert quantized == (PHI3_PROJECTIONS if arch == "phi3" else PROJECTIONS)
    arrivals = [a for a in script() if a.request_id in REQUESTS]
    outputs = run_engine(engine, arrivals, logprobs=0)
    engine.close()

    hf_config = AutoConfig.from_pretrained(setup.model_dir)
    dense = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    dense.load_state_dict(load_dequantized_state_dict(awq_dir), strict=False)
    reference = PeftReference(setup.model_dir, setup.adapter_dirs, base=dense)
    assert_equals_peft(reference, arrivals, outputs, f"{arch} awq")
