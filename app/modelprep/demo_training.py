"""Train the demo: a small Llama on the generated chat corpus, then one LoRA adapter per demo skill.

Deterministic on a given machine (fixed seeds, one ordered data stream, a fixed thread count); the shipped
result (app/demo_assets/, see docs/decisions.md, issue 27) was made by `python -m app.modelprep.demo_training
app/demo_assets`. Tests train the `tiny` configuration, which takes seconds and proves only the mechanics.

CLI: `python -m app.modelprep.demo_training OUT_DIR [--config demo|tiny]`.
"""

import argparse
import itertools
import json
import sys
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast

from app.modelprep.demo_corpus import Example, examples
from app.modelprep.demo_model import MARKER_FILE, build_model, synthetic_corpus, train_tokenizer
from app.modelprep.demo_skills import SKILLS, Skill

BASE_DIR = "demo-llama"
ADAPTERS_DIR = "adapters"
RECORD_FILE = "loraplex-training.json"
BASE_RECORD_FILE = "loraplex-base-training.json"  # the base model's part: lets adapters be retrained alone
IGNORE = -100  # label of a token the loss skips (HF's convention)


class TrainingConfig(BaseModel):
    """How the demo model and its skill adapters are trained."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str = Field(default="demo", description="Model shape preset (app/modelprep/demo_model.py).")
    seed: int = Field(default=0, description="Seed of the weights, the tokenizer and the data streams.")
    base_steps: int = Field(default=150, gt=0, description="Optimizer steps of the base model.")
    base_lr: float = Field(default=3e-3, gt=0, description="Peak AdamW learning rate of the base model.")
    adapter_steps: int = Field(default=50, gt=0, description="Optimizer steps of each skill adapter.")
    adapter_lr: float = Field(default=1e-2, gt=0, description="AdamW learning rate of the adapters.")
    skill_steps: dict[str, int] = Field(
        default_factory=lambda: {"demo-json": 150, "demo-shout": 150},
        description="Optimizer steps of the skills that need more than adapter_steps (JSON's exact keys "
        "and upper case over a whole answer had not converged at 50: scores 0.67 and 0.79 of 24).",
    )
    batch_size: int = Field(default=16, gt=0, description="Exchanges per optimizer step.")
    threads: int = Field(default=2, gt=0, description="torch threads: results depend on it, so it is fixed.")


CONFIGS: dict[str, TrainingConfig] = {
    "demo": TrainingConfig(),
    "tiny": TrainingConfig(preset="tiny", base_steps=4, adapter_steps=2, batch_size=4, skill_steps={}),
}


def render(tokenizer: PreTrainedTokenizerFast, example: Example, answer: str) -> tuple[list[int], int]:
    """Token ids of one exchange ending with the answer's <|im_end|>, and where the answer starts."""
    prompt = tokenizer.apply_chat_template(example.messages(), add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    prompt_ids = tokenizer.encode(prompt)
    answer_ids = tokenizer.encode(answer + "<|im_end|>\n")
    return prompt_ids + answer_ids, len(prompt_ids)


def batches(
    tokenizer: PreTrainedTokenizerFast, stream: Iterator[Example], skill: Skill | None, size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input ids, attention mask, labels) of `size` exchanges, right-padded. The base model learns every
    token; an adapter learns only its answers (the prompt is the base model's business)."""
    pad = tokenizer.pad_token_id
    assert isinstance(pad, int)
    while True:
        rows = []
        for example in itertools.islice(stream, size):
            answer = (
                skill.render(example.topic, example.style)
                if skill
                else example.topic.plain_answer(example.style)
            )
            ids, answer_start = render(tokenizer, example, answer)
            learned = ids if skill is None else [IGNORE] * answer_start + ids[answer_start:]
            rows.append((ids, learned))
        width = max(len(ids) for ids, _ in rows)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in rows])
        yield input_ids, mask, labels


def _optimize(
    model: torch.nn.Module,
    data: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    steps: int,
    lr: float,
    label: str,
) -> tuple[float, float]:
    """Train `model` for `steps` batches of `data`; (first batch's loss, last batch's loss)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * max(0.1, 1 - step / steps)
    )
    model.train()
    losses: list[float] = []
    with tqdm(range(steps), desc=label, unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        for _ in bar:
            input_ids, mask, labels = next(data)
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses[0], losses[-1]


def _tokenizer_corpus(seed: int) -> Iterator[str]:
    # Plain answers and every skill's answers, so that SQL, JSON and upper case get whole-word tokens too,
    # plus the generic synthetic corpus (code, Unicode) the random demo models' tokenizer has.
    for example in itertools.islice(examples(seed + 1), 4000):
        yield example.question + " " + example.topic.plain_answer(example.style)
        for skill in SKILLS:
            yield skill.render(example.topic, example.style)
    yield from synthetic_corpus(seed)


def train_demo(out_dir: Path, config: TrainingConfig, only: Collection[str] = ()) -> dict[str, Any]:
    """Train the base model into `out_dir/demo-llama`, each skill adapter into `out_dir/adapters/<name>`.

    A base model already trained there with the same base settings is reused (adapters are retrained).
    `only`: retrain just these skills; the others and their record entries stay as they are."""
    torch.set_num_threads(config.threads)
    base_dir = out_dir / BASE_DIR
    record: dict[str, Any] = {"config": config.model_dump(), "loss": {}, "seconds": {}}
    if only:
        kept = json.loads((base_dir / RECORD_FILE).read_text())
        record["loss"], record["seconds"] = kept["loss"], kept["seconds"]
    with torch.random.fork_rng(devices=[]):
        record["loss"]["base"], record["seconds"]["base"] = _ensure_base(base_dir, config)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(base_dir)
        for number, skill in enumerate(SKILLS):
            if only and skill.name not in only:
                continue
            start = time.perf_counter()
            data = batches(tokenizer, examples(config.seed + 100 + number), skill, config.batch_size)
            record["loss"][skill.name] = _train_adapter(base_dir, skill, data, config)
            record["seconds"][skill.name] = round(time.perf_counter() - start, 1)
    for weights in out_dir.rglob("*.safetensors"):
        weights.chmod(0o644)
    (base_dir / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


def _ensure_base(base_dir: Path, config: TrainingConfig) -> tuple[tuple[float, float], float]:
    """(first and last loss, seconds) of the base model's training, done now unless already done."""
    from transformers import AutoModelForCausalLM

    wanted = config.model_dump(exclude={"adapter_steps", "adapter_lr", "skill_steps"})
    done = base_dir / BASE_RECORD_FILE
    if done.exists() and (previous := json.loads(done.read_text()))["config"] == wanted:
        return tuple(previous["loss"]), previous["seconds"]
    done.unlink(missing_ok=True)
    base_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_tokenizer(base_dir, _tokenizer_corpus(config.seed))
    build_model(base_dir, arch="llama", preset=config.preset, seed=config.seed, tokenizer_dir=base_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(base_dir)
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    data = batches(tokenizer, examples(config.seed), None, config.batch_size)
    loss = _optimize(model, data, config.base_steps, config.base_lr, BASE_DIR)
    model.save_pretrained(base_dir)
    (base_dir / MARKER_FILE).unlink()  # the random build's marker: this dir is no longer that build
    seconds = round(time.perf_counter() - start, 1)
    done.write_text(json.dumps({"config": wanted, "loss": loss, "seconds": seconds}, sort_keys=True) + "\n")
    return loss, seconds


def _train_adapter(
    base_dir: Path,
    skill: Skill,
    data: Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    config: TrainingConfig,
) -> tuple[float, float]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    recipe = skill.recipe
    lora = LoraConfig(
        r=recipe.r,
        lora_alpha=recipe.lora_alpha,  # type: ignore[arg-type]  # PEFT annotates int; any number works
        target_modules=list(recipe.target_modules),
        use_rslora=recipe.use_rslora,
        rank_pattern=dict(recipe.rank_pattern or {}),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(recipe.seed)
    peft_model = get_peft_model(base, lora)
    steps = config.skill_steps.get(skill.name, config.adapter_steps)
    loss = _optimize(peft_model, data, steps, config.adapter_lr, skill.name)
    out = base_dir.parent / ADAPTERS_DIR / skill.name
    peft_model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's model-card template: nothing of ours in it
    return loss


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the demo model and its skill adapters.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="demo")
    parser.add_argument("--only", default="", help="comma-separated skills to retrain; the rest are kept")
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = set(only) - {skill.name for skill in SKILLS}
    if unknown:
        parser.error(f"unknown skills: {sorted(unknown)}")
    print(json.dumps(train_demo(args.out_dir, CONFIGS[args.config], only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
