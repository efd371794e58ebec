import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from peft import LoraConfig
from peft.tuners.lora import LoraLayer

from adapters.errors import AdapterInvalid, UnsupportedAdapter
from adapters.layout import BaseModelLayout
from adapters.spec import (
    IGNORED_OPTIONS,
    REJECTED_OPTIONS,
    SUPPORTED_OPTIONS,
    AdapterSpec,
    AdapterStatus,
)
from tests.adapters.conftest import ALL_SEVEN, peft_model

PREFIX = "base_model.model."


def lora_config(**changes: Any) -> dict[str, Any]:
    """An adapter_config.json dict as PEFT 0.21.2 writes it."""
    peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    config: dict[str, Any] = peft_config.to_dict()  # type: ignore[no-untyped-call]
    config["peft_type"] = "LORA"
    config["target_modules"] = sorted(config["target_modules"])
    config.update(changes)
    return config


def test_parses_a_peft_written_config(good_adapter: Path) -> None:
    spec = AdapterSpec.from_dir(good_adapter)
    assert spec.peft_type == "LORA"
    assert spec.task_type == "CAUSAL_LM"
    assert (spec.r, spec.lora_alpha, spec.use_rslora) == (4, 8, False)
    assert spec.target_modules == tuple(sorted(ALL_SEVEN))
    assert spec.scaling_for("model.layers.0.mlp.up_proj") == 2.0
    assert spec.max_rank == 4


@pytest.mark.parametrize("use_rslora", [False, True])
def test_rank_and_scaling_match_peft_for_every_module(base_model_dir: Path, use_rslora: bool) -> None:
    kwargs: dict[str, Any] = {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": use_rslora,
        "rank_pattern": {
            "layers.0.self_attn.q_proj": 2,
            "down_proj": 8,
            r"model\.layers\.1\.mlp\.up_proj": 6,
        },
        "alpha_pattern": {"v_proj": 3, "layers.1.self_attn.o_proj": 32},
    }
    model = peft_model(base_model_dir, **kwargs)
    spec = AdapterSpec.from_config_dict(lora_config(target_modules=ALL_SEVEN, **kwargs))
    layers = {name.removeprefix(PREFIX): m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert len(layers) == 14
    for path, layer in layers.items():
        assert spec.rank_for(path) == layer.r["default"], path
        assert spec.scaling_for(path) == layer.scaling["default"], path
    assert spec.max_rank == 8
    expected = 3 / math.sqrt(4) if use_rslora else 3 / 4
    assert spec.scaling_for("model.layers.0.self_attn.v_proj") == expected


def test_target_names_are_normalised_to_sorted_suffixes() -> None:
    spec = AdapterSpec.from_config_dict(
        lora_config(target_modules=["v_proj", "model.layers.0.self_attn.q_proj", "self_attn.k_proj"])
    )
    assert spec.target_modules == ("k_proj", "q_proj", "v_proj")


def test_regex_targets_resolve_against_the_layout(layout: BaseModelLayout) -> None:
    config = lora_config(target_modules=r".*\.1\.self_attn\.(q|k)_proj")
    assert AdapterSpec.from_config_dict(config).target_modules == ()
    spec = AdapterSpec.from_config_dict(config, layout=layout)
    assert spec.target_modules == ("k_proj", "q_proj")
    assert spec.targets("model.layers.1.self_attn.q_proj")
    assert not spec.targets("model.layers.0.self_attn.q_proj")


def test_layers_to_transform_limits_targets() -> None:
    spec = AdapterSpec.from_config_dict(lora_config(layers_to_transform=[1]))
    assert spec.layers_to_transform == (1,)
    assert spec.targets("model.layers.1.self_attn.q_proj")
    assert not spec.targets("model.layers.0.self_attn.q_proj")
    assert not spec.targets("model.layers.1.mlp.up_proj")


def test_unknown_targets_are_named(layout: BaseModelLayout) -> None:
    with pytest.raises(AdapterInvalid, match="dense, fc1"):
        AdapterSpec.from_config_dict(lora_config(target_modules=["q_proj", "fc1", "dense"]), layout=layout)
    with pytest.raises(AdapterInvalid, match="matches none"):
        AdapterSpec.from_config_dict(lora_config(target_modules=r".*\.c_attn"), layout=layout)


REJECTED_VALUES: dict[str, Any] = {
    "use_dora": True,
    "modules_to_save": ["score"],
    "lora_bias": True,
    "fan_in_fan_out": True,
    "target_parameters": ["feed_forward.experts.down_proj"],
    "trainable_token_indices": [1, 2],
    "layer_replication": [[0, 2], [1, 2]],
    "use_qalora": True,
    "alora_invocation_tokens": [5, 6],
    "use_bdlora": {"nblocks": 2},
    "arrow_config": {"top_k": 2},
    "kasa_config": {},
    "megatron_config": {"tensor_model_parallel_size": 2},
}


def test_every_peft_option_has_a_decision() -> None:
    # Fails when a PEFT upgrade adds a LoraConfig field: decide whether it is supported, ignored or rejected.
    fields = {f.name for f in dataclasses.fields(LoraConfig)}
    decided = SUPPORTED_OPTIONS | IGNORED_OPTIONS | REJECTED_OPTIONS.keys() | {"bias"}
    assert fields == decided
    assert set(REJECTED_VALUES) == set(REJECTED_OPTIONS)


@pytest.mark.parametrize("option", sorted(REJECTED_VALUES))
def test_rejected_option_is_named(option: str) -> None:
    with pytest.raises(UnsupportedAdapter, match=option):
        AdapterSpec.from_config_dict(lora_config(**{option: REJECTED_VALUES[option]}))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"peft_type": "LOHA"}, "LOHA"),
        ({"task_type": "SEQ_CLS"}, "SEQ_CLS"),
        ({"bias": "all"}, "bias"),
        ({"bias": "lora_only"}, "bias"),
        ({"init_lora_weights": "pissa_niter_4"}, "modifies the base weights"),
        ({"init_lora_weights": "olora"}, "olora"),
        ({"init_lora_weights": "loftq"}, "loftq"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": r".*(embed_tokens|q_proj)"}, "embed_tokens"),
        ({"new_variant_config": {"k": 1}}, "new_variant_config"),
    ],
)
def test_unsupported_settings_are_named(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(UnsupportedAdapter, match=named):
        AdapterSpec.from_config_dict(lora_config(**changes))


def test_all_unsupported_options_are_listed_together() -> None:
    with pytest.raises(UnsupportedAdapter) as caught:
        AdapterSpec.from_config_dict(lora_config(use_dora=True, bias="all", modules_to_save=["lm_head"]))
    assert len(caught.value.problems) == 3
    assert all(
        any(name in p for p in caught.value.problems) for name in ("use_dora", "bias", "modules_to_save")
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"lora_dropout": 0.1, "init_lora_weights": "gaussian", "inference_mode": False},
        {"init_lora_weights": "eva", "eva_config": {"rho": 2.0}},
        {"velora_config": {"num_groups": 2}, "monteclora_config": {}},
        {"some_future_option": None, "another_future_flag": False, "future_list": []},
        {"runtime_config": {"ephemeral_gpu_offload": False}},
    ],
)
def test_training_only_options_are_ignored(changes: dict[str, Any]) -> None:
    AdapterSpec.from_config_dict(lora_config(**changes))


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"target_modules": None}, "target_modules is not set"),
        ({"target_modules": []}, "target_modules is empty"),
        ({"r": "8"}, "r"),
        ({"r": 0}, "r"),
        ({"rank_pattern": {"q_proj": -1}}, "rank_pattern"),
        ({"target_modules": "(unclosed"}, "not a valid regular expression"),
        ({"layers_to_transform": [0], "target_modules": "q_proj"}, "layers_to_transform"),
    ],
)
def test_invalid_values_are_named(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(AdapterInvalid, match=named) as caught:
        AdapterSpec.from_config_dict(lora_config(**changes))
    assert not isinstance(caught.value, UnsupportedAdapter)


def test_missing_peft_type_is_invalid() -> None:
    config = lora_config()
    del config["peft_type"]
    with pytest.raises(AdapterInvalid, match="peft_type"):
        AdapterSpec.from_config_dict(config)


def test_spec_is_frozen() -> None:
    spec = AdapterSpec.from_config_dict(lora_config())
    with pytest.raises(ValueError, match="frozen"):
        spec.r = 4  # type: ignore[misc]


def test_adapter_status_values() -> None:
    assert [s.value for s in AdapterStatus] == ["uploading", "validating", "ready", "failed", "deleted"]
    assert AdapterStatus("ready") is AdapterStatus.READY
