"""A multimodal Gemma 3 checkpoint (`gemma3`: Gemma3ForConditionalGeneration, a vision tower beside the text
decoder) serves text requests on our forward, through its text tower: the engine's reference-equality
scenario (adapters and the base arriving at different steps, fewer slots than adapters, chunked prefill,
forced preemption) equals HF PEFT over the whole multimodal model, greedy tokens exactly and logprobs within
the scenario's tolerance (fp32). The checkpoint is the tiny Gemma 3 text model's weights under a tiny
random SigLIP tower; the adapters are PEFT's own, on the text tower's linears.
"""

import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration

from adapters.layout import BaseModelLayout
from adapters.store import AdapterStore
from adapters.validation import validate_adapter_dir
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.decoder_forward import DecoderForward
from tests.engine.reference import PeftReference
from tests.engine.test_reference_equality import assert_equals_peft, run_engine, scenario_config, script
from tests.model_fixtures import TinySetup

REQUESTS = ("sql-a", "base-a", "pirate-long", "sql-follow-up", "legal")
ADAPTERS = ("demo-sql", "demo-pirate", "demo-legal")
TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def multimodal_checkpoint(text_dir: Path, out: Path) -> Path:
    """The text model's weights as the text tower of a Gemma3ForConditionalGeneration, with its tokenizer."""
    text_config = AutoConfig.from_pretrained(text_dir)
    vocab = int(text_config.vocab_size)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}  # fmt: skip
    config = Gemma3Config(
        text_config=text_config.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=vocab - 1,
        boi_token_index=vocab - 2,
        eoi_token_index=vocab - 3,
    )
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    text = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out)
    for path in text_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",):
            shutil.copy(path, out / path.name)
    return out


def peft_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """Three rank-8 PEFT adapters on the text tower's seven linears, B not zero (each changes the output)."""
    dirs = {}
    for seed, name in enumerate(ADAPTERS):
        torch.manual_seed(100 + seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        peft = get_peft_model(base, config)
        with torch.no_grad():
            for param_name, param in peft.named_parameters():
                if "lora_" in param_name:
                    param.mul_(0.3)
        dirs[name] = out / name
        peft.save_pretrained(str(dirs[name]))
    return dirs


@pytest.mark.slow
def test_a_multimodal_gemma3_checkpoint_serves_text_on_our_forward_equal_to_peft(
    tiny_setups: dict[str, TinySetup], tmp_path: Path
) -> None:
    model_dir = multimodal_checkpoint(tiny_setups["gemma3_text"].model_dir, tmp_path / "model")
    assert AutoConfig.from_pretrained(model_dir).model_type == "gemma3"
    adapter_dirs = peft_adapters(model_dir, tmp_path / "adapters")
    layout = BaseModelLayout.from_model_dir(model_dir)  # what an upload is validated against
    for path in adapter_dirs.values():
        assert validate_adapter_dir(path, layout, max_rank=16).r == 8
    store = AdapterStore(tmp_path / "store")
    for name, path in adapter_dirs.items():
        store.put_dir(name, path)
    engine = LLMEngine(scenario_config(model_dir, tmp_path / "store"))
    assert isinstance(engine.runner.forward, DecoderForward), "gemma3 fell back to HF's forward"
    arrivals = [a for a in script() if a.request_id in REQUESTS]
    outputs = run_engine(engine, arrivals, logprobs=0)
    engine.close()
    reference = PeftReference(model_dir, adapter_dirs)
    prompt = arrivals[0].prompt
    assert all(reference.greedy(prompt, name, 8) != reference.greedy(prompt, None, 8) for name in ADAPTERS)
    assert_equals_peft(reference, arrivals, outputs, "gemma3 multimodal")
