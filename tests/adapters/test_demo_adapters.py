from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from adapters.demo_adapters import DEMO_ADAPTERS, build_demo_adapter, build_demo_adapters, main
from adapters.layout import BaseModelLayout
from adapters.spec import WEIGHTS_FILE, AdapterSpec
from adapters.validation import validate_adapter_dir

PROMPTS = torch.randint(5, 256, (4, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="session")
def demo_dirs(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_demo_adapters(base_model_dir, tmp_path_factory.mktemp("demo"))


def greedy(model: torch.nn.Module, new_tokens: int = 8) -> torch.Tensor:
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        PROMPTS, attention_mask=torch.ones_like(PROMPTS), max_new_tokens=new_tokens, do_sample=False
    )
    return out[:, PROMPTS.shape[1] :]


def test_recipes_cover_the_intended_variety() -> None:
    assert len({d.name for d in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS) >= 5
    assert {d.r for d in DEMO_ADAPTERS} >= {4, 8, 16}
    assert any(d.use_rslora for d in DEMO_ADAPTERS)
    assert any(d.rank_pattern for d in DEMO_ADAPTERS)
    assert len({d.target_modules for d in DEMO_ADAPTERS}) == len(DEMO_ADAPTERS)


def test_every_demo_adapter_validates(demo_dirs: dict[str, Path], layout: BaseModelLayout) -> None:
    assert set(demo_dirs) == {d.name for d in DEMO_ADAPTERS}
    for demo in DEMO_ADAPTERS:
        spec = validate_adapter_dir(demo_dirs[demo.name], layout, max_rank=16)
        assert spec.use_rslora == demo.use_rslora
        assert spec.rank_pattern == (demo.rank_pattern or {})
        assert not list(demo_dirs[demo.name].glob("*.bin"))


def test_demo_adapters_load_in_peft_and_change_greedy_output(
    demo_dirs: dict[str, Path], base_model_dir: Path
) -> None:
    base_output = greedy(LlamaForCausalLM.from_pretrained(base_model_dir))
    outputs = {}
    for name, path in demo_dirs.items():
        model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base_model_dir), path)
        with torch.no_grad():
            logits = model(PROMPTS).logits
        assert torch.isfinite(logits).all(), name
        outputs[name] = greedy(model)
        assert not torch.equal(outputs[name], base_output), f"{name} does not change greedy output"
    assert len({tuple(o.flatten().tolist()) for o in outputs.values()}) == len(outputs), (
        "adapters must differ"
    )


def test_update_is_a_fixed_fraction_of_the_base_weight(
    demo_dirs: dict[str, Path], base_model_dir: Path
) -> None:
    base = load_file(base_model_dir / "model.safetensors")
    path = demo_dirs["demo-chef"]
    spec = AdapterSpec.from_dir(path)
    tensors = load_file(path / WEIGHTS_FILE)
    module = "model.layers.1.mlp.down_proj"
    a, b = (tensors[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
    assert a.shape[0] == 16  # from rank_pattern
    ratio = (spec.scaling_for(module) * b @ a).norm() / base[f"{module}.weight"].norm()
    assert ratio.item() == pytest.approx(0.25, rel=1e-4)


def test_builds_are_deterministic(base_model_dir: Path, demo_dirs: dict[str, Path], tmp_path: Path) -> None:
    demo = DEMO_ADAPTERS[3]
    again = build_demo_adapter(
        base_model_dir,
        tmp_path / demo.name,
        r=demo.r,
        lora_alpha=demo.lora_alpha,
        target_modules=demo.target_modules,
        use_rslora=demo.use_rslora,
        seed=demo.seed,
        rank_pattern=demo.rank_pattern,
    )
    first, second = load_file(demo_dirs[demo.name] / WEIGHTS_FILE), load_file(again / WEIGHTS_FILE)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_build_leaves_the_global_rng_alone(base_model_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_demo_adapter(base_model_dir, tmp_path / "x", r=4, lora_alpha=4, target_modules=["q_proj"], seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_cli(base_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(base_model_dir), str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in DEMO_ADAPTERS)
    assert "demo-sql" in capsys.readouterr().out
