"""The demo trainer on its tiny configuration (seconds; the shipped demo is the `demo` one): a loadable base
model with the ChatML tokenizer, one valid PEFT adapter per skill with its recipe's LoRA shape, the same
weights from a second run, and losses that fall."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adapters.layout import BaseModelLayout
from adapters.validation import validate_adapter_dir
from app.modelprep.demo_skills import SKILLS
from app.modelprep.demo_training import (
    ADAPTERS_DIR,
    BASE_DIR,
    CONFIGS,
    RECORD_FILE,
    TrainingConfig,
    train_demo,
)

TINY = CONFIGS["tiny"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo-train")
    train_demo(root, TINY)
    return root


def test_tiny_training_writes_a_model_and_one_valid_adapter_per_skill(trained: Path) -> None:
    base = trained / BASE_DIR
    record = json.loads((base / RECORD_FILE).read_text())
    assert TrainingConfig.model_validate(record["config"]) == TINY
    assert set(record["loss"]) == {"base", *(s.name for s in SKILLS)}
    layout = BaseModelLayout.from_model_dir(base)
    for skill in SKILLS:
        directory = trained / ADAPTERS_DIR / skill.name
        spec = validate_adapter_dir(directory, layout, max_rank=16)
        config = json.loads((directory / "adapter_config.json").read_text())
        assert config["r"] == skill.recipe.r and config["use_rslora"] == skill.recipe.use_rslora
        assert config["rank_pattern"] == dict(skill.recipe.rank_pattern or {})
        assert set(spec.target_modules) == set(skill.recipe.target_modules)


def test_training_is_deterministic(trained: Path, tmp_path: Path) -> None:
    train_demo(tmp_path, TINY)
    for relative in (f"{BASE_DIR}/model.safetensors", *(f"{ADAPTERS_DIR}/{s.name}/adapter_model.safetensors"
                                                        for s in SKILLS)):  # fmt: skip
        ours, again = load_file(trained / relative), load_file(tmp_path / relative)
        assert ours.keys() == again.keys()
        assert all(torch.equal(ours[k], again[k]) for k in ours), relative


def test_training_lowers_the_loss(trained: Path) -> None:
    record = json.loads((trained / BASE_DIR / RECORD_FILE).read_text())
    first, last = record["loss"]["base"]
    assert last < first  # adapters' two tiny steps are too few to tell from batch noise
    assert all(math.isfinite(x) for pair in record["loss"].values() for x in pair)
