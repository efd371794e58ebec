"""Phi-3 through HTTP: an adapter on its fused qkv_proj and gate_up_proj (the only q/k/v and gate/up linears
PEFT can adapt there) is accepted at upload and serves PEFT's greedy output; a LongRoPE Phi-3 checkpoint is
refused when the engine loads it, with the reason."""

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from deployments.engine.config import EngineConfig
from deployments.engine.llm_engine import LLMEngine
from tests.app.conftest import MODEL, Served, serving
from tests.app.test_adapters_api import greedy, reference_text, upload_files
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

ADAPTER = "demo-pirate"  # r=4 on qkv_proj, o_proj, gate_up_proj and down_proj


@pytest.fixture(scope="module")
def phi3(tiny_setups: dict[str, TinySetup]) -> TinySetup:
    return tiny_setups["phi3"]


@pytest.fixture(scope="module")
def served_phi3(phi3: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serving(phi3, tmp_path_factory.mktemp("phi3-app")) as app:
        yield app


def test_an_adapter_on_the_fused_linears_is_accepted_and_serves_peft(
    served_phi3: Served, phi3: TinySetup
) -> None:
    tenant_id, key = served_phi3.new_tenant(f"phi-{uuid.uuid4().hex[:8]}")
    response = upload_files(served_phi3, "pirate", tenant_id, phi3.adapter_dirs[ADAPTER])
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "ready" and body["rank"] == 4
    assert body["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    client = OpenAI(base_url=f"{served_phi3.url}/v1", api_key=key, max_retries=0)
    reference = PeftReference(phi3.model_dir, {ADAPTER: phi3.adapter_dirs[ADAPTER]})
    assert greedy(client, "pirate") == reference_text(served_phi3, reference, ADAPTER)
    assert greedy(client, "pirate") != greedy(client, MODEL)


def test_a_longrope_checkpoint_is_refused_at_load_with_the_reason(phi3: TinySetup, tmp_path: Path) -> None:
    model_dir = shutil.copytree(phi3.model_dir, tmp_path / "phi3-longrope")
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config.pop("rope_parameters", None)
    # As Phi-3-mini-128k's config.json writes it (transformers reads the legacy key).
    config["rope_scaling"] = {"type": "longrope", "short_factor": [1.0] * half, "long_factor": [4.0] * half}
    config["original_max_position_embeddings"] = config["max_position_embeddings"] // 4
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="LongRoPE switches its factors with the sequence length"):
        LLMEngine(EngineConfig(model=model_dir, dtype="float32", adapter_store=phi3.store_root))
