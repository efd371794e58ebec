"""The demo model builder: HF-loadable dirs for all archs, ChatML tokenizer, determinism, ensure_model."""

import json
import unicodedata
from pathlib import Path
from typing import Any

import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from app.modelprep.demo_model import (
    ARCHS,
    BOS,
    EOS,
    IM_END,
    IM_START,
    MARKER_FILE,
    PAD,
    PRESETS,
    ModelShape,
    build_model,
    build_tokenizer,
    count_parameters,
    ensure_model,
    main,
    synthetic_corpus,
)

UNICODE_SAMPLES = [
    "plain ascii, with  two spaces and a tab\t and\nnewlines\n",
    " leading space and trailing space ",
    "café naïve Straße jalapeño ünïcödé",
    "東京で日本語を話します。中文也可以。",
    "emoji 🦜🫠👩‍👩‍👧 flags 🇯🇵 skin 👍🏾",
    "Ελληνικά Русский עברית العربية हिन्दी",
    "special-looking text <s> and </s> and <|im_start|>",
]


def load_tokenizer(model_dir: Path) -> Any:
    # Any: HF's annotated return unions (str | list | BatchEncoding ...) are too wide to assert on.
    return AutoTokenizer.from_pretrained(model_dir)


def load_model(model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), arch="llama", preset="tiny")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    dirs = {"llama": tokenizer_dir}
    for arch in (a for a in ARCHS if a != "llama"):
        dirs[arch] = build_model(tmp_path_factory.mktemp(arch), arch=arch, tokenizer_dir=tokenizer_dir)
    return dirs


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_with_auto_classes(model_dirs: dict[str, Path], arch: str) -> None:
    tokenizer = load_tokenizer(model_dirs[arch])
    model = load_model(model_dirs[arch])

    assert model.config.model_type == arch
    assert model.config.vocab_size == PRESETS["tiny"].vocab_size >= len(tokenizer)
    assert tokenizer.unk_token is None  # no extra <|endoftext|> from Qwen2Tokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    assert model.generation_config.eos_token_id == eos_ids
    assert not model.config.tie_word_embeddings


def test_qwen2_has_random_qkv_biases(model_dirs: dict[str, Path]) -> None:
    model = load_model(model_dirs["qwen2"])
    attention = model.model.layers[0].self_attn
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert proj.bias is not None
        assert proj.bias.abs().max() > 0
    assert attention.o_proj.bias is None
    assert not torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))


def test_chat_template_renders_chatml(model_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(model_dirs["llama"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]

    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)

    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids == tokenizer.encode(text)
    im_start, im_end = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    assert ids[0] == im_start
    assert ids.count(im_start) == 3
    assert ids.count(im_end) == 2
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not without_prompt.endswith("assistant\n")
    assert "chat_template" in json.loads((model_dirs["llama"] / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_unicode_round_trip(model_dirs: dict[str, Path], arch: str, text: str) -> None:
    tokenizer = load_tokenizer(model_dirs[arch])
    ids = tokenizer.encode(text)
    assert tokenizer.bos_token_id not in ids[:1]  # never added implicitly
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_non_nfc_text_is_only_normalized_by_qwen2(model_dirs: dict[str, Path], arch: str) -> None:
    # transformers 5 rebuilds a Qwen2 dir's tokenizer as Qwen2Tokenizer, whose pipeline applies NFC.
    decomposed = "cafe\u0301 n\u0303"
    tokenizer = load_tokenizer(model_dirs[arch])
    decoded = tokenizer.decode(tokenizer.encode(decomposed))
    assert decoded == (unicodedata.normalize("NFC", decomposed) if arch == "qwen2" else decomposed)


def test_emoji_is_split_across_tokens(model_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(model_dirs["llama"])
    ids = tokenizer.encode("🦜")
    assert len(ids) > 1
    assert all(tokenizer.decode([i]) != "🦜" for i in ids)
    assert tokenizer.decode(ids) == "🦜"


def test_token_ids_agree_across_archs(model_dirs: dict[str, Path]) -> None:
    tokenizers = {arch: load_tokenizer(model_dirs[arch]) for arch in ARCHS}
    for line in synthetic_corpus(seed=7, lines=200):
        ids = {arch: tok.encode(line) for arch, tok in tokenizers.items()}
        assert all(ids[arch] == ids["llama"] for arch in ARCHS), line


def test_generate_runs_and_stops(model_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(model_dirs["llama"])
    model = load_model(model_dirs["llama"])
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt_len = inputs["input_ids"].shape[1]

    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == prompt_len + 12
    assert len(set(out[0, prompt_len:].tolist())) > 1  # greedy is not stuck on one token

    # Pushing <|im_end|> up shows generation_config's eos list stops on it.
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    stopped = model.generate(**inputs, max_new_tokens=12, do_sample=False, sequence_bias={(im_end,): 100.0})
    assert stopped[0, prompt_len:].tolist() == [im_end]


def test_mistral_sliding_window_is_set_and_applied(model_dirs: dict[str, Path]) -> None:
    window = PRESETS["tiny"].sliding_window
    assert window is not None
    mistral = load_model(model_dirs["mistral"])
    llama = load_model(model_dirs["llama"])
    assert mistral.config.sliding_window == window
    qwen2 = load_model(model_dirs["qwen2"])
    assert not qwen2.config.use_sliding_window

    # Same seed and shapes give Mistral the Llama weights, so only the window can change the logits.
    llama_weights, mistral_weights = llama.state_dict(), mistral.state_dict()
    assert llama_weights.keys() == mistral_weights.keys()
    assert all(torch.equal(llama_weights[name], mistral_weights[name]) for name in llama_weights)
    input_ids = torch.arange(10, 10 + 2 * window).unsqueeze(0)
    with torch.no_grad():
        llama_logits = llama(input_ids).logits[0]
        mistral_logits = mistral(input_ids).logits[0]
    torch.testing.assert_close(mistral_logits[:window], llama_logits[:window])
    assert not torch.allclose(mistral_logits[window + 1 :], llama_logits[window + 1 :])


def test_builds_are_byte_identical(tmp_path: Path) -> None:
    first = build_model(tmp_path / "a", arch="qwen2", seed=3)
    second = build_model(tmp_path / "b", arch="qwen2", seed=3)
    other_seed = build_model(tmp_path / "c", arch="qwen2", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / "model.safetensors").read_bytes() != (other_seed / "model.safetensors").read_bytes()


def test_build_tokenizer_respects_vocab_size(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path, vocab_size=1024, seed=1)
    assert len(tokenizer) == 1024
    assert tokenizer.convert_tokens_to_ids([BOS, EOS, PAD, IM_START, IM_END]) == [0, 1, 2, 3, 4]


def test_bfloat16_build_loads_as_bfloat16(tmp_path: Path, tokenizer_dir: Path) -> None:
    model_dir = build_model(tmp_path, dtype=torch.bfloat16, tokenizer_dir=tokenizer_dir)
    assert load_model(model_dir).dtype == torch.bfloat16  # v5 default dtype="auto"


def test_ensure_model_builds_once(tmp_path: Path, tokenizer_dir: Path) -> None:
    weights = tmp_path / "model.safetensors"
    ensure_model(tmp_path, tokenizer_dir=tokenizer_dir)
    built_at = weights.stat().st_mtime_ns
    ensure_model(tmp_path, tokenizer_dir=tokenizer_dir)
    assert weights.stat().st_mtime_ns == built_at

    (tmp_path / MARKER_FILE).unlink()  # as after an interrupted build
    ensure_model(tmp_path, tokenizer_dir=tokenizer_dir)
    assert weights.stat().st_mtime_ns != built_at
    assert json.loads((tmp_path / MARKER_FILE).read_text())["seed"] == 0

    ensure_model(tmp_path, tokenizer_dir=tokenizer_dir, seed=1)
    assert json.loads((tmp_path / MARKER_FILE).read_text())["seed"] == 1


def test_shape_constraints() -> None:
    tiny = PRESETS["tiny"].model_dump()
    with pytest.raises(pydantic.ValidationError, match="multiple of 64"):
        ModelShape(**{**tiny, "intermediate_size": 96})
    with pytest.raises(pydantic.ValidationError, match="multiples of 32"):
        ModelShape(**{**tiny, "vocab_size": 2050})
    with pytest.raises(pydantic.ValidationError, match="num_key_value_heads"):
        ModelShape(**{**tiny, "num_key_value_heads": 3})


def test_vocab_smaller_than_tokenizer_is_rejected(tmp_path: Path, tokenizer_dir: Path) -> None:
    shape = PRESETS["tiny"].model_copy(update={"vocab_size": 1024})
    with pytest.raises(ValueError, match="tokenizer has 2048 tokens"):
        build_model(tmp_path, preset=shape, tokenizer_dir=tokenizer_dir)


def test_bench_preset_is_about_150m_parameters() -> None:
    fields = PRESETS["bench-150m"].model_dump(exclude={"sliding_window", "qwen2_use_sliding_window"})
    with torch.device("meta"):  # shapes only, no memory or init time
        model = LlamaForCausalLM(LlamaConfig(**fields))
    assert 140e6 < sum(p.numel() for p in model.parameters()) < 160e6


def test_cli_prints_dir_and_parameter_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--preset", "tiny", "--arch", "mistral", "--dtype", "bfloat16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(tmp_path)
    assert lines[1].startswith(f"parameters: {count_parameters(tmp_path):,}")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
