"""Which models our forward takes, and the rope scaling it inherits from HF's rotary module.

Llama 3.x's rope scaling ("llama3": low frequencies divided by the factor, a smooth band between) is fixed
per position, so our forward runs it from the table HF's module computes: the mixed-batch scenario on a tiny
Llama with that scaling equals HF PEFT, tokens and logprobs. Scalings whose frequencies change with the
sequence length, and Gemma's attention softcap, which our attention kernels do not apply, fall back to HF's
forward with the reason logged.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.decoder_forward import DecoderForward, unsupported_reason
from tests.engine.reference import PeftReference
from tests.engine.test_reference_equality import assert_equals_peft, run_engine, scenario_config, script
from tests.model_fixtures import TinySetup

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short: the scaled band covers most of head_dim 16's frequencies
}


def _with_config(model_dir: Path, out: Path, **changes: Any) -> Path:
    """A copy of `model_dir` whose config.json has `changes` (same weights)."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_llama3_rope_scaling_runs_on_our_forward_and_equals_peft(llama: TinySetup, tmp_path: Path) -> None:
    model_dir = _with_config(llama.model_dir, tmp_path / "llama3-rope", rope_parameters=LLAMA3_ROPE)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(llama.model_dir, dtype=torch.float32)
    assert hf.model.rotary_emb.rope_type == "llama3"
    assert not torch.equal(hf.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)  # scaling applies

    engine = LLMEngine(scenario_config(model_dir, llama.store_root))
    assert isinstance(engine.runner.forward, DecoderForward)
    arrivals = [a for a in script() if a.request_id in ("sql-a", "base-a", "pirate-long", "legal")]
    outputs = run_engine(engine, arrivals, logprobs=0)
    engine.close()
    assert_equals_peft(
        PeftReference(model_dir, llama.adapter_dirs, base=hf), arrivals, outputs, "llama3 rope"
    )


@pytest.mark.parametrize(
    ("arch", "changes", "reason"),
    [
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "dynamic"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attention logit softcapping"),
        ("gemma3_text", {"hidden_activation": "relu"}, "hidden activation 'relu'"),
        ("qwen3", {}, None),
        ("gemma3_text", {}, None),
    ],
)
def test_which_configs_our_forward_takes(
    tiny_setups: dict[str, TinySetup], arch: str, changes: dict[str, Any], reason: str | None
) -> None:
    config = AutoConfig.from_pretrained(tiny_setups[arch].model_dir)
    for key, value in changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # unannotated in HF
    got = unsupported_reason(model)
    assert got == reason if reason is None else (got is not None and reason in got), got
