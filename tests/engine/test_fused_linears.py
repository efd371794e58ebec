"""Phi-3's fused linears in our forward: q/k/v and gate/up cut from qkv_proj and gate_up_proj, each with the
adapter PEFT put on the fused module, equal PEFT's own outputs sliced as HF's Phi3Attention and Phi3MLP
slice them; on the module path (CPU) and on the fused base with the group LoRA kernel (Triton: its
interpreter without CUDA)."""

from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from adapters.spec import AdapterSpec
from adapters.weights import load_adapter_weights
from deployments.engine.config import DEFAULT_LORA_TARGETS
from deployments.engine.model.fused_linears import gate_up_group, qkv_group
from deployments.engine.model.lora_kernels import LoRABatch
from deployments.engine.model.lora_layers import LoRAContext, load_adapter_into_slot, wrap_lora_modules
from deployments.engine.model.projection import Projection
from tests.model_fixtures import TinySetup

ADAPTER = "demo-pirate"  # r=4 on qkv_proj, o_proj, gate_up_proj and down_proj
SLOT, SLOTS, MAX_RANK = 1, 3, 16


@pytest.mark.parametrize("grouped", [False, True], ids=["module-path", "fused-group-lora"])
def test_fused_members_split_as_peft_applies_the_adapter(
    tiny_setups: dict[str, TinySetup], grouped: bool
) -> None:
    if grouped:
        pytest.importorskip("triton")
    device = torch.device("cuda" if grouped and torch.cuda.is_available() else "cpu")
    setup = tiny_setups["phi3"]
    adapter_dir = setup.adapter_dirs[ADAPTER]
    base = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter_dir, autocast_adapter_dtype=False).eval()
    config = base.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(3))
    peft_layer: Any = peft.get_base_model().get_submodule("model.layers.1")
    with torch.no_grad():
        qkv = peft_layer.self_attn.qkv_proj(x)  # PEFT: base + lora_B(lora_A(x)) * scaling, fused
        gate_up = peft_layer.mlp.gate_up_proj(x)
    q_end, kv = heads * head_dim, kv_heads * head_dim
    want_qkv = [qkv[:, :q_end], qkv[:, q_end : q_end + kv], qkv[:, q_end + kv :]]  # Phi3Attention's slices
    want_gate_up = list(gate_up.chunk(2, dim=-1))  # Phi3MLP: gate, up

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=torch.float32)
    model.to(device)
    context = LoRAContext()
    modules = wrap_lora_modules(
        model, targets=DEFAULT_LORA_TARGETS, pages=SLOTS, page_rank=MAX_RANK, dtype=torch.float32,
        device=device, context=context,
    )  # fmt: skip
    assert {path.rsplit(".", 1)[-1] for path in modules} == {
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    }
    weights = load_adapter_weights(adapter_dir, AdapterSpec.from_dir(adapter_dir), dtype=torch.float32)
    load_adapter_into_slot(modules, SLOT, 1, weights)
    ends = [0, len(x), len(x)]  # every row on SLOT
    batch = LoRABatch(
        num_lora_tokens=len(x),
        offsets=torch.tensor(ends, dtype=torch.int32, device=device),
        segments=[(SLOT, 0, len(x))],
        segment_table=torch.tensor([(SLOT, 0, len(x))], dtype=torch.int64),
    )
    context.batch = batch
    layer: Any = model.get_submodule("model.layers.1")
    groups = {
        "qkv": (
            qkv_group(layer.self_attn, q_width=heads * head_dim),
            want_qkv,
        ),
        "gate_up": (gate_up_group(layer.mlp), want_gate_up),
    }
    for name, (group, want) in groups.items():
        assert len(group.members) == 1, f"{name}: the fused linear stays one member"
        projection = Projection(group.members, fuse_base=grouped, group_lora=grouped, splits=group.splits)
        assert projection.fused == grouped and (projection.lora_a is not None) == grouped
        with torch.no_grad():
            got = projection(x.to(device), batch)
        assert [g.shape for g in got] == [w.shape for w in want], name
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.cpu(), w, atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # the adapter is there: without the step's batch the outputs differ
            context.batch = None
            plain = projection(x.to(device), None)
            context.batch = batch
        assert not torch.allclose(plain[0].cpu(), want[0], atol=1e-3), name
