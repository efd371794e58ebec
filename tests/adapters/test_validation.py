import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from adapters.errors import AdapterInvalid, AdapterRankTooLarge, UnsupportedAdapter
from adapters.layout import BaseModelLayout
from adapters.spec import CONFIG_FILE, WEIGHTS_FILE
from adapters.validation import validate_adapter_dir
from tests.adapters.conftest import MakeAdapter, edit_config, edit_tensors, lora_key, tiny_llama_config

Q0 = "model.layers.0.self_attn.q_proj"
K0 = "model.layers.0.self_attn.k_proj"
DOWN1 = "model.layers.1.mlp.down_proj"


def problems_of(path: Path, layout: BaseModelLayout, max_rank: int = 16) -> AdapterInvalid:
    with pytest.raises(AdapterInvalid) as caught:
        validate_adapter_dir(path, layout, max_rank=max_rank)
    return caught.value


def set_tensor(path: Path, key: str, value: torch.Tensor) -> None:
    edit_tensors(path, lambda tensors: tensors.update({key: value}))


# ----------------------------------------------------------------------------------------------- layout


def test_layout_lists_the_target_linears_with_their_shapes(layout: BaseModelLayout) -> None:
    assert layout.num_layers == 2
    assert len(layout.modules) == 14
    assert layout.modules[Q0] == (64, 64)
    assert layout.modules[K0] == (64, 32)  # 2 kv heads of 16
    assert layout.modules[DOWN1] == (128, 64)
    assert "lm_head" not in layout.modules


def test_layout_from_model_agrees_with_meta_instantiation(
    base_model_dir: Path, layout: BaseModelLayout
) -> None:
    model = LlamaForCausalLM.from_pretrained(base_model_dir)
    assert BaseModelLayout.from_model(model) == layout
    assert BaseModelLayout.from_config(AutoConfig.from_pretrained(base_model_dir)) == layout


class PackedLinear(torch.nn.Module):
    """Stands in for a 4-bit layer: two weights per byte, so the weight shape is not (out, in)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.zeros(in_features * out_features // 2, 1, dtype=torch.uint8), False
        )


def test_layout_from_quantized_model_reads_feature_attributes(
    base_model_dir: Path, layout: BaseModelLayout
) -> None:
    model = LlamaForCausalLM.from_pretrained(base_model_dir)
    model.model.layers[0].self_attn.k_proj = PackedLinear(64, 32)
    assert BaseModelLayout.from_model(model) == layout


def test_layout_target_names_are_configurable() -> None:
    layout = BaseModelLayout.from_config(tiny_llama_config(), target_names={"q_proj", "lm_head"})
    assert sorted(layout.modules) == ["lm_head", Q0, "model.layers.1.self_attn.q_proj"]


# ------------------------------------------------------------------------------------------ valid ones


def test_peft_adapter_passes(good_adapter: Path, layout: BaseModelLayout) -> None:
    spec = validate_adapter_dir(good_adapter, layout, max_rank=4)
    assert spec.r == 4


@pytest.mark.parametrize(
    "lora_kwargs",
    [
        {"r": 8, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {"v_proj": 2}, "use_rslora": True},
        {"r": 4, "target_modules": r".*\.1\.self_attn\.(q|k)_proj"},
        {"r": 4, "target_modules": ["up_proj"], "layers_to_transform": [1]},
        {"r": 4, "target_modules": ["q_proj", "o_proj"], "exclude_modules": [Q0]},
    ],
)
def test_peft_adapter_variants_pass(
    make_adapter: MakeAdapter, layout: BaseModelLayout, lora_kwargs: dict[str, Any]
) -> None:
    validate_adapter_dir(make_adapter(**lora_kwargs), layout, max_rank=16)


def test_fp16_and_bf16_tensors_pass(adapter_copy: Path, layout: BaseModelLayout) -> None:
    def cast(tensors: dict[str, torch.Tensor]) -> None:
        for i, key in enumerate(sorted(tensors)):
            tensors[key] = tensors[key].to(torch.float16 if i % 2 else torch.bfloat16)

    edit_tensors(adapter_copy, cast)
    validate_adapter_dir(adapter_copy, layout, max_rank=16)


# ------------------------------------------------------------------------------- one test per problem


@pytest.mark.parametrize("name", [CONFIG_FILE, WEIGHTS_FILE])
def test_missing_file(adapter_copy: Path, layout: BaseModelLayout, name: str) -> None:
    (adapter_copy / name).unlink()
    assert f"missing {name}" in problems_of(adapter_copy, layout).problems


def test_missing_directory(tmp_path: Path, layout: BaseModelLayout) -> None:
    assert "does not exist" in str(problems_of(tmp_path / "nope", layout))


@pytest.mark.parametrize("name", ["adapter_model.bin", "training_args.pt", "optimizer.pth", "x.pkl"])
def test_pickle_file_is_refused_unopened(
    adapter_copy: Path, layout: BaseModelLayout, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    (adapter_copy / name).write_bytes(b"\x80\x04 not even a valid pickle")
    monkeypatch.setattr(torch, "load", pytest.fail)
    error = problems_of(adapter_copy, layout)
    assert f"pickle-format files are refused and were not opened: {name}" in str(error)


def test_bad_json(adapter_copy: Path, layout: BaseModelLayout) -> None:
    (adapter_copy / CONFIG_FILE).write_text('{"r": 8,')
    assert f"{CONFIG_FILE} is not valid JSON" in str(problems_of(adapter_copy, layout))


def test_config_not_an_object(adapter_copy: Path, layout: BaseModelLayout) -> None:
    (adapter_copy / CONFIG_FILE).write_text("[1, 2]")
    assert "must hold a JSON object" in str(problems_of(adapter_copy, layout))


def test_dora(make_adapter: MakeAdapter, layout: BaseModelLayout) -> None:
    error = problems_of(make_adapter(r=4, use_dora=True), layout)
    assert isinstance(error, UnsupportedAdapter)
    assert "use_dora=True is not supported: DoRA" in str(error)
    assert "14 tensors are not LoRA A/B weights" in str(error)
    assert "self_attn.k_proj.lora_magnitude_vector" in str(error)
    assert "and 9 more" in str(error)


def test_embedding_target(make_adapter: MakeAdapter, layout: BaseModelLayout) -> None:
    error = problems_of(make_adapter(r=4, target_modules=["q_proj", "embed_tokens"]), layout)
    assert isinstance(error, UnsupportedAdapter)
    assert "target_modules includes embedding/LM head embed_tokens" in str(error)


def test_unknown_target_module(adapter_copy: Path, layout: BaseModelLayout) -> None:
    edit_config(adapter_copy, target_modules=["q_proj", "v_proj", "dense", "c_attn"])
    error = problems_of(adapter_copy, layout)
    assert "target modules not found among the base model's servable linear layers: c_attn, dense" in str(
        error
    )


def test_tensor_for_a_module_the_base_lacks(adapter_copy: Path, layout: BaseModelLayout) -> None:
    set_tensor(adapter_copy, lora_key("model.layers.7.self_attn.q_proj", "A"), torch.zeros(4, 64))
    assert "model.layers.7.self_attn.q_proj is not a servable linear layer" in str(
        problems_of(adapter_copy, layout)
    )


def test_tensor_for_an_untargeted_module(adapter_copy: Path, layout: BaseModelLayout) -> None:
    edit_config(adapter_copy, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"])
    assert f"module {DOWN1} is not targeted" in str(problems_of(adapter_copy, layout))


def test_wrong_a_shape(adapter_copy: Path, layout: BaseModelLayout) -> None:
    set_tensor(adapter_copy, lora_key(Q0, "A"), torch.zeros(4, 65))
    assert f"lora_A of {Q0} has shape [4, 65], expected [4, 64]" in str(problems_of(adapter_copy, layout))


def test_wrong_b_shape(adapter_copy: Path, layout: BaseModelLayout) -> None:
    set_tensor(adapter_copy, lora_key(K0, "B"), torch.zeros(64, 4))
    assert f"lora_B of {K0} has shape [64, 4], expected [32, 4]" in str(problems_of(adapter_copy, layout))


def test_rank_differs_from_declared(adapter_copy: Path, layout: BaseModelLayout) -> None:
    edit_config(adapter_copy, rank_pattern={"q_proj": 2})
    error = str(problems_of(adapter_copy, layout))
    assert f"lora_A of {Q0} has shape [4, 64], expected [2, 64] (rank 2 from {CONFIG_FILE})" in error


def test_rank_over_max(good_adapter: Path, layout: BaseModelLayout) -> None:
    with pytest.raises(AdapterRankTooLarge, match="adapter rank 4 exceeds max_lora_rank 2") as caught:
        validate_adapter_dir(good_adapter, layout, max_rank=2)
    assert (caught.value.rank, caught.value.max_rank) == (4, 2)


def test_rank_over_max_through_rank_pattern(make_adapter: MakeAdapter, layout: BaseModelLayout) -> None:
    adapter = make_adapter(r=4, target_modules=["q_proj", "down_proj"], rank_pattern={"down_proj": 32})
    with pytest.raises(AdapterRankTooLarge, match="adapter rank 32 exceeds max_lora_rank 16"):
        validate_adapter_dir(adapter, layout, max_rank=16)


def test_nan(adapter_copy: Path, layout: BaseModelLayout) -> None:
    a = torch.zeros(4, 64)
    a[1, 2] = float("nan")
    set_tensor(adapter_copy, lora_key(Q0, "A"), a)
    assert f"tensor {lora_key(Q0, 'A')} contains NaN" in problems_of(adapter_copy, layout).problems


def test_inf(adapter_copy: Path, layout: BaseModelLayout) -> None:
    b = torch.zeros(64, 4, dtype=torch.bfloat16)
    b[0, 0] = float("-inf")
    set_tensor(adapter_copy, lora_key(DOWN1, "B"), b)
    assert f"tensor {lora_key(DOWN1, 'B')} contains Inf" in problems_of(adapter_copy, layout).problems


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.float64])
def test_non_float_dtype(adapter_copy: Path, layout: BaseModelLayout, dtype: torch.dtype) -> None:
    set_tensor(adapter_copy, lora_key(Q0, "B"), torch.zeros(64, 4, dtype=dtype))
    assert f"tensor {lora_key(Q0, 'B')} has dtype" in str(problems_of(adapter_copy, layout))


@pytest.mark.parametrize(
    "content",
    [b"", os.urandom(300), b"\x08\x00\x00\x00\x00\x00\x00\x00{bad:js}", b"\xff" * 8 + b"{}"],
)
def test_garbage_safetensors(adapter_copy: Path, layout: BaseModelLayout, content: bytes) -> None:
    (adapter_copy / WEIGHTS_FILE).write_bytes(content)
    assert f"{WEIGHTS_FILE} is not a readable safetensors file" in str(problems_of(adapter_copy, layout))


def test_truncated_safetensors(adapter_copy: Path, layout: BaseModelLayout) -> None:
    data = (adapter_copy / WEIGHTS_FILE).read_bytes()
    (adapter_copy / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    assert f"{WEIGHTS_FILE} is not a readable safetensors file" in str(problems_of(adapter_copy, layout))


def test_missing_lora_b(adapter_copy: Path, layout: BaseModelLayout) -> None:
    edit_tensors(adapter_copy, lambda tensors: tensors.pop(lora_key(K0, "B")))
    assert f"module {K0} has lora_A but no lora_B" in problems_of(adapter_copy, layout).problems


def test_no_lora_tensors(adapter_copy: Path, layout: BaseModelLayout) -> None:
    edit_tensors(adapter_copy, lambda tensors: tensors.clear())
    assert "holds no LoRA tensors" in str(problems_of(adapter_copy, layout))


# ------------------------------------------------------------------------------------ all at once


def test_every_problem_is_listed(adapter_copy: Path, layout: BaseModelLayout) -> None:
    (adapter_copy / "adapter_model.bin").write_bytes(b"pickle")
    edit_config(adapter_copy, use_dora=True, target_modules=[*layout.suffixes, "dense"])
    nan_b = torch.zeros(64, 4)
    nan_b[3, 3] = float("nan")

    def tamper(tensors: dict[str, torch.Tensor]) -> None:
        tensors.pop(lora_key(K0, "B"))
        tensors[lora_key(Q0, "A")] = torch.zeros(4, 70)
        tensors[lora_key(Q0, "B")] = nan_b
        tensors[lora_key(DOWN1, "A")] = torch.ones(4, 128, dtype=torch.int32)

    edit_tensors(adapter_copy, tamper)
    error = problems_of(adapter_copy, layout, max_rank=2)
    assert type(error) is AdapterInvalid
    expected = [
        "pickle-format files are refused",
        "use_dora=True is not supported",
        "target modules not found among the base model's servable linear layers: dense",
        f"module {K0} has lora_A but no lora_B",
        f"lora_A of {Q0} has shape [4, 70], expected [4, 64]",
        f"tensor {lora_key(Q0, 'B')} contains NaN",
        f"tensor {lora_key(DOWN1, 'A')} has dtype I32",
        "adapter rank 4 exceeds max_lora_rank 2",
    ]
    for fragment in expected:
        assert any(fragment in problem for problem in error.problems), fragment
    assert len(error.problems) == len(expected)
