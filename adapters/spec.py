"""AdapterSpec: a PEFT LoRA adapter_config.json, parsed and checked to be servable by the multi-LoRA engine.

The engine computes `base(x) + x @ A.T @ B.T` with a per-module scaling folded into B, on the base model's
linear layers only. Every PEFT option that changes that forward pass, or that needs modified base weights or
extra trainable modules, is rejected; options that only affect training are ignored.

PEFT is imported lazily: the registry imports AdapterStatus from here without loading torch/transformers.
"""

import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from adapters.errors import AdapterInvalid, UnsupportedAdapter
from adapters.layout import BaseModelLayout, module_suffix
from adapters.patterns import PatternError, TargetRule, check_keys, check_pattern, fullmatch, pattern_value

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"  # the only weights format read: never a pickle
ALL_LINEAR = "all-linear"  # PEFT's shorthand; saved configs normally hold the resolved names instead
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head"})
# Real adapters use alphas up to a few thousand; far beyond that the folded weights only overflow fp16/bf16.
MAX_LORA_ALPHA = 65536.0
_SHOWN_PATTERNS = 5  # refused patterns named one by one; a config may hold a thousand

# Read into AdapterSpec (init_lora_weights is only checked).
SUPPORTED_OPTIONS = frozenset(
    {
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "init_lora_weights",
    }
)
# Bookkeeping, or training/initialisation only: the saved A and B already hold their effect.
IGNORED_OPTIONS = frozenset(
    {
        "auto_mapping",
        "peft_version",
        "revision",
        "inference_mode",
        "lora_dropout",
        "runtime_config",
        "megatron_core",
        "qalora_group_size",  # only read with use_qalora, which is rejected
        "ensure_weight_tying",  # only ties embedding/lm_head adapters, which are rejected
        "loftq_config",  # init-time configs; init_lora_weights decides whether the result is servable
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "velora_config",  # VeLoRA changes only the backward pass; its embed buffer is skipped on load
        "monteclora_config",  # Monte Carlo sampling runs only in training; eval forward is plain LoRA
    }
)
# Rejected when set to anything but their off value (None, False, an empty list).
REJECTED_OPTIONS: Mapping[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA) needs a magnitude vector in the forward pass",
    "modules_to_save": "modules_to_save replaces whole base modules",
    "lora_bias": "lora_bias adds a bias to lora_B",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style transposed base weights)",
    "target_parameters": "target_parameters adapts raw nn.Parameters (MoE experts), not linear modules",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "layer_replication": "layer_replication changes the base model's layer stack",
    "use_qalora": "QALoRA pools the input before lora_A",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies the adapter only after invocation tokens",
    "use_bdlora": "block-diagonal LoRA stores A or B in blocks",
    "arrow_config": "Arrow routes between several adapters per token",
    "kasa_config": "KaSA truncates the base weights and inserts a diagonal between A and B",
    "megatron_config": "Megatron parallel layers",
}
_SERVABLE_INIT_NAMES = ("gaussian", "eva", "orthogonal", "mica")  # and True/False: A and B are all there is
# These initialisations subtract the adapter's initial value from the base weights: unless the adapter was
# re-saved with `path_initial_model_for_weight_conversion`, it only works on those modified base weights.
_BASE_MUTATING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterStatus(StrEnum):
    UPLOADING = "uploading"
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class AdapterSpec(BaseModel):
    """The servable subset of a PEFT LoraConfig. Module paths are the base model's `named_modules()` names."""

    # Scalars are strict so that a JSON "8" is an error, not a rank; sequences accept lists or tuples.
    model_config = ConfigDict(frozen=True, extra="forbid")

    peft_type: Literal["LORA"] = Field(default="LORA", description="PEFT method; only LORA is served.")
    task_type: Literal["CAUSAL_LM"] | None = Field(default=None, description="PEFT task type, if recorded.")
    base_model_name_or_path: str | None = Field(
        default=None,
        strict=True,
        description="Base model the adapter was trained on, as recorded by PEFT (informational).",
    )
    r: int = Field(gt=0, strict=True, description="Default LoRA rank.")
    lora_alpha: float = Field(
        strict=True,
        allow_inf_nan=False,
        gt=0,
        le=MAX_LORA_ALPHA,
        description="Default LoRA alpha; scaling is alpha/r, or alpha/sqrt(r) with rsLoRA. Positive, at most "
        "MAX_LORA_ALPHA.",
    )
    use_rslora: bool = Field(
        default=False, strict=True, description="Rank-stabilised LoRA: scaling alpha/sqrt(r)."
    )
    target_modules: tuple[str, ...] = Field(
        description="Sorted suffix names of the targeted modules, e.g. ('q_proj', 'v_proj'). Empty when the "
        "config gave a regex or 'all-linear' and no base layout was available to resolve it."
    )
    target_pattern: str | None = Field(
        default=None, description="target_modules as given when it was a string: a regex, or 'all-linear'."
    )
    exclude_modules: tuple[str, ...] | str | None = Field(
        default=None, description="PEFT exclude_modules: names, or a regex string."
    )
    layers_to_transform: tuple[StrictInt, ...] | None = Field(
        default=None, description="Layer indices to adapt; None means all layers."
    )
    layers_pattern: tuple[str, ...] | None = Field(
        default=None, description="Name of the layer list that layers_to_transform indexes, e.g. 'layers'."
    )
    rank_pattern: dict[str, Annotated[int, Field(gt=0, strict=True)]] = Field(
        default_factory=dict, description="Per-module rank overrides; keys are PEFT pattern keys."
    )
    alpha_pattern: dict[
        str, Annotated[float, Field(strict=True, allow_inf_nan=False, gt=0, le=MAX_LORA_ALPHA)]
    ] = Field(
        default_factory=dict,
        description="Per-module alpha overrides (positive, at most MAX_LORA_ALPHA); keys are PEFT pattern "
        "keys.",
    )

    @classmethod
    def from_config_dict(
        cls, config: Mapping[str, Any], *, layout: BaseModelLayout | None = None
    ) -> "AdapterSpec":
        """Parse adapter_config.json contents; raise UnsupportedAdapter/AdapterInvalid with every problem."""
        return check_adapter_config(config, layout=layout).spec_or_raise()

    @classmethod
    def from_dir(cls, path: Path, *, layout: BaseModelLayout | None = None) -> "AdapterSpec":
        return cls.from_config_dict(read_adapter_config(path), layout=layout)

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.rank_pattern.values()])

    def rank_for(self, module_path: str) -> int:
        rank: int = pattern_value(self.rank_pattern, module_path, self.r)
        return rank

    def alpha_for(self, module_path: str) -> float:
        alpha: float = pattern_value(self.alpha_pattern, module_path, self.lora_alpha)
        return alpha

    def scaling_for(self, module_path: str) -> float:
        """The factor PEFT multiplies lora_B(lora_A(x)) by in this module (LoraLayer.update_layer)."""
        rank = self.rank_for(module_path)
        alpha = self.alpha_for(module_path)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, module_path: str) -> bool:
        """Whether PEFT would put this adapter on the module at `module_path`."""
        if self.target_pattern == ALL_LINEAR:
            return True  # layouts only hold linear modules
        targets = self.target_pattern if self.target_pattern is not None else frozenset(self.target_modules)
        exclude = (
            frozenset(self.exclude_modules)
            if isinstance(self.exclude_modules, tuple)
            else self.exclude_modules
        )
        rule = TargetRule(targets, exclude, self.layers_to_transform, self.layers_pattern)
        return rule.targets(module_path)


@dataclass(frozen=True)
class ConfigCheck:
    """Outcome of checking an adapter config: the spec (None if it could not be built) and every problem."""

    spec: AdapterSpec | None
    unsupported: tuple[str, ...]
    invalid: tuple[str, ...]

    @property
    def problems(self) -> list[str]:
        return [*self.invalid, *self.unsupported]

    def spec_or_raise(self) -> AdapterSpec:
        if self.invalid:
            raise AdapterInvalid(self.problems)
        if self.unsupported:
            raise UnsupportedAdapter(self.unsupported)
        if self.spec is None:  # unreachable: a spec is only missing when something is invalid
            raise AdapterInvalid(["adapter config could not be parsed"])
        return self.spec


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """Read adapter_config.json as a JSON object. Raises AdapterInvalid naming what is wrong."""
    path = adapter_dir / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterInvalid([f"missing {CONFIG_FILE}"]) from None
    except RecursionError:  # hostile nesting: json recurses per level
        raise AdapterInvalid([f"{CONFIG_FILE} is nested too deeply"]) from None
    except (OSError, ValueError) as exc:  # JSONDecodeError, bad UTF-8, 4300+-digit integers
        raise AdapterInvalid([f"{CONFIG_FILE} is not valid JSON: {exc}"]) from None
    if not isinstance(config, dict):
        raise AdapterInvalid([f"{CONFIG_FILE} must hold a JSON object, got {type(config).__name__}"])
    return config


def _pattern_problems(config: Mapping[str, Any]) -> list[str]:
    """Every pattern PEFT would evaluate must be matchable in linear time (adapters.patterns), as PEFT
    would use it; anything else is refused before a single module path is matched."""
    candidates: list[tuple[str, str, dict[str, bool]]] = []
    problems = []
    for field in ("rank_pattern", "alpha_pattern"):
        value = config.get(field)
        if isinstance(value, dict):
            try:
                check_keys(list(value))
            except PatternError as exc:
                problems.append(f"{field} {exc}")
                continue
            candidates += [(f"{field} key {key[:80]!r}", key, {"as_key": True}) for key in value]
    for field in ("target_modules", "exclude_modules"):
        if isinstance(config.get(field), str) and config[field] != ALL_LINEAR:
            candidates.append((field, config[field], {}))
    layers = config.get("layers_pattern")
    for pattern in [layers] if isinstance(layers, str) else layers if isinstance(layers, list) else []:
        if isinstance(pattern, str):
            candidates.append(("layers_pattern", pattern, {"as_layers": True}))
    refused = []
    for where, pattern, form in candidates:
        try:
            check_pattern(pattern, **form)
        except PatternError as exc:
            refused.append(f"{where} is not a valid regular expression here: it {exc}")
    more = (
        [f"and {len(refused) - _SHOWN_PATTERNS} more unusable patterns"]
        if len(refused) > _SHOWN_PATTERNS
        else []
    )
    return problems + refused[:_SHOWN_PATTERNS] + more


def check_adapter_config(config: Mapping[str, Any], *, layout: BaseModelLayout | None = None) -> ConfigCheck:
    """Collect every unsupported option and every invalid value; build the spec from what is usable."""
    unsupported = _unsupported_options(config)
    invalid: list[str] = []
    if "peft_type" not in config:
        invalid.append("peft_type is missing: not a PEFT adapter config")
    invalid += _pattern_problems(config)
    if invalid:  # a broken regex would raise inside PEFT's own matching below
        return ConfigCheck(spec=None, unsupported=tuple(unsupported), invalid=tuple(invalid))
    targets, pattern, target_problems = _resolve_targets(config.get("target_modules"), layout)
    invalid += target_problems
    spec = None
    if config.get("peft_type") == "LORA" and targets is not None:
        spec, spec_problems = _build_spec(config, targets, pattern)
        invalid += spec_problems
    if not invalid and not unsupported:
        invalid += _peft_config_problems(config)
    return ConfigCheck(spec=spec, unsupported=tuple(unsupported), invalid=tuple(invalid))


def _is_set(value: Any) -> bool:
    # An empty dict still switches a variant on: PEFT turns {} into its default sub-config dataclass.
    return value is not None and value is not False and value != [] and value != ""


def _unsupported_options(config: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    peft_type = config.get("peft_type")
    if peft_type is not None and peft_type != "LORA":
        problems.append(f"peft_type={peft_type!r}: only LORA adapters are served")
    task_type = config.get("task_type")
    if task_type not in (None, "CAUSAL_LM"):
        problems.append(f"task_type={task_type!r}: only CAUSAL_LM adapters are served")
    bias = config.get("bias", "none")
    if bias != "none":
        problems.append(f"bias={bias!r}: trained base-layer biases are not served (bias must be 'none')")
    for name, why in REJECTED_OPTIONS.items():
        if _is_set(config.get(name)):
            problems.append(f"{name}={config[name]!r} is not supported: {why}")
    problems += _init_problems(config.get("init_lora_weights", True))
    problems += _embedding_target_problems(config.get("target_modules"))
    known = SUPPORTED_OPTIONS | IGNORED_OPTIONS | REJECTED_OPTIONS.keys() | {"bias"}
    for name in sorted(set(config) - known):
        if _is_set(config[name]):
            problems.append(f"unknown option {name}={config[name]!r} (from a newer PEFT?) is not supported")
    return problems


def _init_problems(init: Any) -> list[str]:
    if isinstance(init, bool) or init in _SERVABLE_INIT_NAMES:
        return []
    if isinstance(init, str) and init.lower().startswith(_BASE_MUTATING_INITS):
        return [
            f"init_lora_weights={init!r} is not supported: it modifies the base weights; re-save the adapter "
            "with save_pretrained(path_initial_model_for_weight_conversion=...) to get a plain LoRA"
        ]
    return [f"init_lora_weights={init!r} is not supported"]


def _embedding_target_problems(targets: Any) -> list[str]:
    if isinstance(targets, str):
        hits = [name for name in ("lm_head", "model.embed_tokens") if _safe_fullmatch(targets, name)]
    elif isinstance(targets, list):
        hits = [t for t in targets if isinstance(t, str) and module_suffix(t) in EMBEDDING_MODULES]
    else:
        hits = []
    return [f"target_modules includes embedding/LM head {', '.join(hits)}: not supported"] if hits else []


def _safe_fullmatch(pattern: str, name: str) -> bool:
    try:
        check_pattern(pattern)  # an unusable pattern is _pattern_problems' to report
    except PatternError:
        return False
    return fullmatch(pattern, name)


def _resolve_targets(
    raw: Any, layout: BaseModelLayout | None
) -> tuple[tuple[str, ...] | None, str | None, list[str]]:
    """(suffix names, the raw string form if any, problems). Embedding targets are _unsupported_options'."""
    if raw is None:
        return None, None, ["target_modules is not set"]
    if isinstance(raw, str):
        return _resolve_target_string(raw, layout)
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        return None, None, [f"target_modules must be a list of names or a regex string, got {raw!r}"]
    if not raw:
        return None, None, ["target_modules is empty"]
    names = [t for t in raw if module_suffix(t) not in EMBEDDING_MODULES]
    problems = []
    if layout is not None:
        missing = [t for t in names if not any(TargetRule(frozenset({t})).targets(p) for p in layout.modules)]
        if missing:
            names_missing = ", ".join(sorted(missing))
            problems.append(
                f"target modules not found among the base model's servable linear layers: {names_missing}"
            )
    return tuple(sorted({module_suffix(t) for t in names})), None, problems


def _resolve_target_string(
    raw: str, layout: BaseModelLayout | None
) -> tuple[tuple[str, ...], str, list[str]]:
    if raw == ALL_LINEAR:
        return (tuple(sorted(layout.suffixes)) if layout is not None else ()), raw, []
    if layout is None:  # (the regex itself compiled: _pattern_problems checked it first)
        return (), raw, []
    matched = [p for p in layout.modules if fullmatch(raw, p)]
    if not matched:
        problem = f"target_modules regex {raw!r} matches none of the base model's servable linear layers"
        return (), raw, [problem]
    return tuple(sorted({module_suffix(p) for p in matched})), raw, []


def _as_tuple(value: Any) -> Any:
    """JSON lists become tuples (the spec is immutable); a bare int/str becomes a 1-tuple, as in PEFT."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, int | str) and not isinstance(value, bool):
        return (value,)
    return value


def _build_spec(
    config: Mapping[str, Any], targets: tuple[str, ...], pattern: str | None
) -> tuple[AdapterSpec | None, list[str]]:
    exclude = config.get("exclude_modules")
    fields: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": config.get("task_type") if config.get("task_type") == "CAUSAL_LM" else None,
        "base_model_name_or_path": config.get("base_model_name_or_path"),
        "r": config.get("r", 8),  # PEFT's defaults
        "lora_alpha": config.get("lora_alpha", 8),
        "use_rslora": config.get("use_rslora", False),
        "target_modules": targets,
        "target_pattern": pattern,
        "exclude_modules": exclude if isinstance(exclude, str) else _as_tuple(exclude),
        "layers_to_transform": _as_tuple(config.get("layers_to_transform")),
        "layers_pattern": _as_tuple(config.get("layers_pattern")),
        "rank_pattern": config.get("rank_pattern") or {},
        "alpha_pattern": config.get("alpha_pattern") or {},
    }
    try:
        return AdapterSpec.model_validate(fields), []
    except ValidationError as exc:
        problems = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
        return None, [f"invalid adapter config: {p}" for p in problems]


def _peft_config_problems(config: Mapping[str, Any]) -> list[str]:
    """Let PEFT itself parse the config too: it enforces cross-field rules we do not duplicate."""
    from peft import LoraConfig

    kwargs = {
        k: v for k, v in config.items() if k in SUPPORTED_OPTIONS | IGNORED_OPTIONS and k != "runtime_config"
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            LoraConfig(**kwargs)
    except Exception as exc:  # PEFT raises TypeError/ValueError/ImportError, and no narrower contract
        return [f"PEFT cannot parse the adapter config: {exc}"]
    return []
