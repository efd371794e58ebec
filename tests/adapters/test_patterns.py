"""adapters.patterns: PEFT's module matching rules, in linear time, and the same answers as PEFT's own."""

import time
from types import SimpleNamespace
from typing import Any

import pytest
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from adapters.errors import AdapterInvalid
from adapters.layout import BaseModelLayout
from adapters.patterns import MAX_PATTERN_KEYS, TargetRule, pattern_key
from adapters.spec import AdapterSpec

CATASTROPHIC = "(.+)+z"  # Python's re: about 2^n steps on an n-character path that does not end in z
BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}


def rule_id(rule: TargetRule) -> str:
    """A test id that is the same in every process: a frozenset's repr follows the hash seed, and the xdist
    workers must collect the same ids."""
    names = (rule.target_modules, rule.exclude_modules)
    parts = (sorted(v) if isinstance(v, frozenset) else v for v in names)
    return repr((*parts, rule.layers_to_transform, rule.layers_pattern))[:60]


@pytest.mark.parametrize(
    "rule",
    [
        TargetRule(frozenset({"q_proj", "v_proj"})),
        TargetRule(frozenset({"model.layers.0.self_attn.q_proj", "up_proj"})),
        TargetRule(r".*\.(q|k)_proj"),
        TargetRule(r"model\.layers\.1\..*"),
        TargetRule(frozenset({"q_proj", "down_proj"}), exclude_modules=frozenset({"layers.0.mlp.down_proj"})),
        TargetRule(frozenset({"q_proj", "o_proj"}), exclude_modules=r".*\.1\..*"),
        TargetRule(frozenset({"q_proj", "gate_proj"}), layers_to_transform=[1]),
        TargetRule(frozenset({"q_proj"}), layers_to_transform=[0], layers_pattern=["layers"]),
        TargetRule(frozenset({"q_proj"}), layers_to_transform=[0, 1], layers_pattern=["nope", "lay.rs"]),
    ],
    ids=lambda rule: rule_id(rule),
)
def test_targets_agree_with_peft_on_every_module(layout: BaseModelLayout, rule: TargetRule) -> None:
    view = SimpleNamespace(
        target_modules=set(rule.target_modules)
        if isinstance(rule.target_modules, frozenset)
        else rule.target_modules,
        exclude_modules=set(rule.exclude_modules)
        if isinstance(rule.exclude_modules, frozenset)
        else rule.exclude_modules,
        modules_to_save=None,
        target_parameters=None,
        layers_to_transform=list(rule.layers_to_transform) if rule.layers_to_transform else None,
        layers_pattern=list(rule.layers_pattern) if rule.layers_pattern else None,
    )
    for path in layout.modules:
        assert rule.targets(path) == bool(check_target_module_exists(view, path)), path


def test_pattern_keys_agree_with_peft(layout: BaseModelLayout) -> None:
    keys = ("layers.0.self_attn.q_proj", "down_proj", r"model\.layers\.1\.mlp\.up_proj", "v_proj|k_proj", "q")
    for path in layout.modules:
        expected = get_pattern_key(list(keys), path)
        assert (pattern_key(keys, path) or path) == expected, path


@pytest.mark.parametrize(
    "changes",
    [
        {"target_modules": CATASTROPHIC},
        {"target_modules": ["q_proj"], "exclude_modules": CATASTROPHIC},
        {"target_modules": ["q_proj"], "rank_pattern": {CATASTROPHIC: 2}},
        {"target_modules": ["q_proj"], "alpha_pattern": {CATASTROPHIC: 2.0}},
        {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": CATASTROPHIC},
    ],
    ids=["target_modules", "exclude_modules", "rank_pattern", "alpha_pattern", "layers_pattern"],
)
def test_catastrophic_patterns_are_matched_in_linear_time(
    layout: BaseModelLayout, changes: dict[str, Any]
) -> None:
    started = time.monotonic()
    try:
        spec = AdapterSpec.from_config_dict({**BASE, **changes}, layout=layout)
    except AdapterInvalid:
        pass  # target_modules matching nothing: refused, quickly
    else:
        for path in layout.modules:
            spec.targets(path), spec.scaling_for(path)
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"target_modules": r"(q)\1_proj"}, "target_modules is not a valid regular expression here"),
        ({"target_modules": ["q_proj"], "exclude_modules": "(?!q).*"}, "exclude_modules"),
        ({"target_modules": ["q_proj"], "rank_pattern": {"x" * 300: 2}}, "longer than 256 characters"),
        (
            {
                "target_modules": ["q_proj"],
                "alpha_pattern": {f"k{i}": 2.0 for i in range(MAX_PATTERN_KEYS + 1)},
            },
            f"alpha_pattern has {MAX_PATTERN_KEYS + 1} keys",
        ),
        ({"target_modules": "[a-z]{1000}" * 5}, "is too complex"),
    ],
    ids=["backreference", "lookahead", "too-long", "too-many-keys", "too-complex"],
)
def test_patterns_that_cannot_be_matched_safely_are_named(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(AdapterInvalid) as caught:
        AdapterSpec.from_config_dict({**BASE, **changes})
    assert named in str(caught.value)


@pytest.mark.parametrize("alpha", [0, -8, 1e30, 65536.5])
@pytest.mark.parametrize("field", ["lora_alpha", "alpha_pattern"])
def test_lora_alpha_is_bounded(field: str, alpha: float) -> None:
    value: Any = alpha if field == "lora_alpha" else {"q_proj": alpha}
    with pytest.raises(AdapterInvalid) as caught:
        AdapterSpec.from_config_dict({**BASE, "target_modules": ["q_proj"], field: value})
    assert field in str(caught.value)
