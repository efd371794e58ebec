"""The shipped demo through the real HTTP API: every skill adapter shows its skill on held-out questions, the
base model shows none, PEFT with the same adapter scores the same; and the README's first example
(two adapters, one question) answers as the README says."""

import json
import re
import secrets
from pathlib import Path

import httpx
import pytest

from app.demo_assets import shipped_demo
from app.modelprep.demo_training import ADAPTERS_DIR, BASE_DIR
from bench.adapter_skills import measure, upload_skills
from bench.lm_eval_compare import serving

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_each_demo_adapter_shows_its_skill_and_the_base_none() -> None:
    demo = shipped_demo()
    result = measure(demo / BASE_DIR, demo / ADAPTERS_DIR, count=6, max_tokens=64)
    for name, row in result["table"].items():
        # The issue's goal, 0.8: every adapter scores 0.94-1.00 on bench.adapter_skills' 50 questions
        # (docs/benchmarks.md); on these 6, one miss (0.83) still passes.
        assert row["api"] >= 0.8, (name, row, result["replies"])
        assert row["base"] < 0.2, (name, row, result["replies"])
        assert abs(row["api"] - row["peft"]) <= 0.05, (name, row)


def readme_example() -> tuple[list[str], dict[str, object], dict[str, str]]:
    """(models, request body, {model: reply}) of the README's first example."""
    readme = (ROOT / "README.md").read_text()
    models = re.search(r"for model in ([^;]+); do", readme)
    body = re.search(r"-d '(\{\"model\": \"'\$model'\".*?)'\n", readme)
    assert models and body, "the README's first example changed shape"
    request = json.loads(body.group(1).replace("\"'$model'\"", '"MODEL"'))
    block = re.search(r"```text\n(.*?)```", readme, flags=re.S)
    assert block
    replies = dict(line.split(": ", 1) for line in block.group(1).strip().splitlines())
    return models.group(1).split(), request, replies


@pytest.mark.slow
def test_the_readme_example_shows_two_adapters_answering_differently(tmp_path: Path) -> None:
    models, request, shown = readme_example()
    assert len(models) == 2 and set(shown) == set(models)
    assert len(set(shown.values())) == 2
    demo = shipped_demo()
    admin_key = secrets.token_urlsafe(32)
    with serving(demo / BASE_DIR, tmp_path, admin_key) as url:
        api_key = upload_skills(url, admin_key, demo / ADAPTERS_DIR)
        for model in models:
            body = {**request, "model": model.removeprefix("public/")}  # here the tenant's own adapters
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                               headers={"authorization": f"Bearer {api_key}"})  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == json.loads(shown[model]), model
