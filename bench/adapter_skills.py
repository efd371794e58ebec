"""Do the demo adapters do what they were trained for? Each skill's score through the platform's HTTP API for
the adapter, for the base model, and in HF PEFT with that adapter alone, on the same held-out questions.

The platform runs in-process as in bench/lm_eval_compare.py (the HTTP app on uvicorn over a real fp32 engine
and SQLite, no Ray); one tenant uploads the five skill adapters through the admin API and asks every held-out
question (app/modelprep/demo_corpus.py: never in any training data) of each adapter and of the base model,
greedy. The reference is transformers + PEFT `generate` (greedy, the model's own stop tokens) with one
adapter loaded at a time. A reply scores 1 if it shows the skill (app/modelprep/demo_skills.py: one scorer
per skill), else 0; a score is the mean. `agree` is the fraction of questions where our reply and PEFT's are
the same text.

Run: python -m bench.adapter_skills [--prompts 50] [--max-tokens 64]; `--tiny` trains the tiny demo
configuration in a temporary directory (seconds) and asks 3 questions: it checks the bench runs, its
scores mean nothing. The last line is one JSON object.
"""

import argparse
import itertools
import json
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from app.demo_assets import shipped_demo
from app.modelprep.demo_corpus import Example, examples
from app.modelprep.demo_skills import SKILLS, Skill
from app.modelprep.demo_training import ADAPTERS_DIR, BASE_DIR, CONFIGS, train_demo
from bench.lm_eval_compare import MODEL, serving
from bench.measure import machine

EVAL_SEED = 9_000  # the held-out questions' stream (any seed: held-out questions never reach training)


def questions(count: int) -> list[Example]:
    return list(itertools.islice(examples(EVAL_SEED, held_out=True), count))


def upload_skills(url: str, admin_key: str, adapters_dir: Path) -> str:
    """A tenant, its key, and every skill adapter uploaded as its own; returns the key once all answer."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {admin_key}"}, timeout=120) as admin:
        tenant = admin.post("/admin/tenants", json={"name": "skills", "tier": "enterprise"})
        tenant.raise_for_status()
        tenant_id = tenant.json()["id"]
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "skills"})
        key.raise_for_status()
        for skill in SKILLS:
            directory = adapters_dir / skill.name
            files = {name: (name, (directory / name).read_bytes()) for name in
                     ("adapter_config.json", "adapter_model.safetensors")}  # fmt: skip
            uploaded = admin.post(
                "/admin/adapters",
                data={"name": skill.name, "owner": tenant_id},
                files={"adapter_config": files["adapter_config.json"],
                       "adapter_model": files["adapter_model.safetensors"]},
            )  # fmt: skip
            assert uploaded.status_code == 201, uploaded.text
    api_key: str = key.json()["key"]
    deadline = time.monotonic() + 60
    pending = [s.name for s in SKILLS]
    while pending:  # each servable within a second or so (the registry watcher)
        reply = chat(url, api_key, pending[0], [{"role": "user", "content": "hi"}], 1, raise_for=False)
        if reply is not None:
            pending.pop(0)
        elif time.monotonic() > deadline:
            raise RuntimeError(f"adapter {pending[0]!r} not servable")
        else:
            time.sleep(0.1)
    return api_key


def chat(
    url: str,
    api_key: str,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    raise_for: bool = True,
) -> str | None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300,
                          headers={"authorization": f"Bearer {api_key}"})  # fmt: skip
    if response.status_code != 200:
        if raise_for:
            raise RuntimeError(f"{model}: {response.status_code} {response.text}")
        return None
    content: str = response.json()["choices"][0]["message"]["content"] or ""
    return content


def api_replies(
    url: str, api_key: str, models: Sequence[str], asked: list[Example], max_tokens: int
) -> dict[str, list[str]]:
    """Every (model, question) through the API, 8 at a time so that they share engine steps."""
    jobs = [(model, example) for model in models for example in asked]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda job: chat(url, api_key, job[0], job[1].messages(), max_tokens), jobs))
    replies: dict[str, list[str]] = {model: [] for model in models}
    for (model, _), text in zip(jobs, texts, strict=True):
        replies[model].append(text or "")
    return replies


@torch.no_grad()
def peft_replies(model_dir: Path, adapter_dir: Path, asked: list[Example], max_tokens: int) -> list[str]:
    """HF PEFT with this adapter alone, greedy, one question at a time (no padding to differ by)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Any: HF's annotated unions (str | list | BatchEncoding ...) are wider than what these calls return.
    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model: Any = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    replies = []
    for example in asked:
        ids = tokenizer.apply_chat_template(
            example.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False)  # fmt: skip
        replies.append(str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return replies


def measure(model_dir: Path, adapters_dir: Path, count: int, max_tokens: int) -> dict[str, Any]:
    """The skills table: per skill {"api", "base", "peft", "agree"}, and the replies to the first question."""
    asked = questions(count)
    admin_key = secrets.token_urlsafe(32)
    names = [s.name for s in SKILLS]
    with (
        tempfile.TemporaryDirectory(prefix="adapter-skills-") as work,
        serving(model_dir, Path(work), admin_key) as url,
    ):
        api_key = upload_skills(url, admin_key, adapters_dir)
        ours = api_replies(url, api_key, [MODEL, *names], asked, max_tokens)
    table: dict[str, dict[str, float]] = {}
    for skill in SKILLS:
        peft = peft_replies(model_dir, adapters_dir / skill.name, asked, max_tokens)
        table[skill.name] = {
            "api": skill_score(skill, ours[skill.name]),
            "base": skill_score(skill, ours[MODEL]),
            "peft": skill_score(skill, peft),
            "agree": sum(a == b for a, b in zip(ours[skill.name], peft, strict=True)) / len(asked),
        }
    first = {model: replies[0] for model, replies in ours.items()}
    return {"table": table, "question": asked[0].messages()[-1]["content"], "replies": first}


def skill_score(skill: Skill, replies: list[str]) -> float:
    return sum(map(skill.shows, replies)) / len(replies)


def print_table(result: dict[str, Any]) -> None:
    descriptions = {s.name: s.description for s in SKILLS}
    print(f"{'adapter':<12} {'api':>5} {'base':>5} {'peft':>5} {'agree':>6}  skill")
    for name, row in result["table"].items():
        print(f"{name:<12} {row['api']:>5.2f} {row['base']:>5.2f} {row['peft']:>5.2f} {row['agree']:>6.2f}  "
              f"{descriptions[name]}")  # fmt: skip
    print(f"\nQ: {result['question']}")
    for model, reply in result["replies"].items():
        print(f"{model}: {reply!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=50, help="held-out questions asked of every model")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every reply")
    parser.add_argument("--tiny", action="store_true", help="the tiny demo, trained here, 3 questions")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="adapter-skills-demo-") as tmp:
        if args.tiny:
            args.prompts, args.max_tokens = 3, 8
            train_demo(Path(tmp), CONFIGS["tiny"])
            root = Path(tmp)
        else:
            root = shipped_demo()
        start = time.perf_counter()
        result = measure(root / BASE_DIR, root / ADAPTERS_DIR, args.prompts, args.max_tokens)
    print_table(result)
    table = result["table"]
    print(json.dumps({
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "scores": table,
        "min_api": min(row["api"] for row in table.values()),
        "max_base": max(row["base"] for row in table.values()),
        "max_api_peft_gap": max(abs(row["api"] - row["peft"]) for row in table.values()),
        "seconds": round(time.perf_counter() - start, 1),
        "tiny": args.tiny,
        "machine": machine("float32"),
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
