"""IncrementalDetokenizer against real (locally trained) byte-level BPE and SentencePiece-style tokenizers."""

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from deployments.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer, backend_decode

WORDS = [
    *["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "stop", "model"] * 2,
    *["café", "naïve", "Zürich", "señor", "crème", "brûlée", "façade", "jalapeño", "Ærø", "Øresund"],
    *["日本語", "中文", "東京", "한국어", "서울", "こんにちは", "你好世界", "ภาษาไทย"],
    *["😀", "🚀", "👍🏽", "🇫🇷", "👨\u200d👩\u200d👧", "🎉", "❤️", "🐍", "∑", "€", "£"],
]
SPECIALS = ["<|bos|>", "<|eos|>"]


def corpus(n: int = 400) -> list[str]:
    rnd = random.Random(0)
    return [
        " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 12))) + rnd.choice([".", "!", "?", ""])
        for _ in range(n)
    ]


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1], clean_up_tokenization_spaces=False
    )


@pytest.fixture(scope="session")
def byte_bpe() -> PreTrainedTokenizerFast:
    """GPT-2 style: byte-level pre-tokenizer and decoder, so emoji and CJK split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer)
    return wrap(tok)


@pytest.fixture(scope="session")
def metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece style: "▁" marks a word start; the decoder drops the first token's leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return wrap(tok)


@pytest.fixture(scope="session")
def byte_fallback() -> PreTrainedTokenizerFast:
    """Llama style: ASCII-only vocab, everything else as <0xNN> byte tokens decoded in runs."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS], show_progress=False)
    tok.train_from_iterator([s for s in corpus() if s.isascii()] * 3, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return wrap(Tokenizer.from_str(json.dumps(spec)))


def run(
    tokenizer, prompt_ids, output_ids, **kwargs
) -> tuple[list[DetokenizerDelta], str, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    deltas = []
    for token in output_ids:
        deltas.append(detok.add_token(token))
        if deltas[-1].stop_reason is not None:
            break
    return deltas, detok.finish(), detok


def streamed(deltas: list[DetokenizerDelta], tail: str) -> str:
    return "".join(d.text for d in deltas) + tail


def pieces(tokenizer, *texts: str) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def feed(detok: IncrementalDetokenizer, groups: list[list[int]]) -> list[str]:
    """Feeds token groups; returns the text emitted by each group (deltas joined)."""
    out = []
    for group in groups:
        out.append("".join(detok.add_token(t).text for t in group))
    return out


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_round_trip_random_sequences(byte_bpe, skip: bool):
    rnd = random.Random(1)
    vocab = len(byte_bpe)
    cut_chars = 0
    for _ in range(300):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(0, 10))]
        output = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 30))]
        deltas, tail, detok = run(byte_bpe, prompt, output, skip_special_tokens=skip)
        expected = byte_bpe.decode(output, skip_special_tokens=skip)
        assert streamed(deltas, tail) == expected
        assert detok.output_text == expected
        # Never a half character mid-stream: U+FFFD only where the full decode has one too.
        assert all(d.text.count("\ufffd") <= expected.count("\ufffd") for d in deltas)
        cut_chars += any(byte_bpe.decode([t]).endswith("\ufffd") for t in output)
    assert cut_chars > 100  # the sequences really do split characters


def test_round_trip_real_text_split_everywhere(byte_bpe):
    rnd = random.Random(2)
    for text in corpus(60):
        ids = byte_bpe.encode(text, add_special_tokens=False)
        prompt = byte_bpe.encode(rnd.choice(corpus(20)), add_special_tokens=False)
        deltas, tail, _ = run(byte_bpe, prompt, ids)
        assert streamed(deltas, tail) == text
        assert "\ufffd" not in streamed(deltas, "")


def test_multibyte_character_is_held_until_complete(byte_bpe):
    byte_ids = [byte_bpe.convert_tokens_to_ids(BYTE_TO_CHAR[b]) for b in "😀".encode()]
    assert len(byte_ids) == 4
    detok = IncrementalDetokenizer(byte_bpe, byte_bpe.encode("hi", add_special_tokens=False))
    assert [detok.add_token(t).text for t in byte_ids] == ["", "", "", "😀"]
    # Cut off mid-character: finish() flushes what decode() gives, the replacement character.
    detok = IncrementalDetokenizer(byte_bpe, [])
    assert [detok.add_token(t).text for t in byte_ids[:2]] == ["", ""]
    assert detok.finish() == byte_bpe.decode(byte_ids[:2]) == "\ufffd"


def test_long_generation_slides_the_window(byte_bpe):
    text = " ".join(corpus(30))
    ids = byte_bpe.encode(text, add_special_tokens=False)
    assert len(ids) > 200
    deltas, tail, _ = run(byte_bpe, [], ids)
    assert streamed(deltas, tail) == text


# -- SentencePiece-style decoders ---------------------------------------------------------------


def test_metaspace_first_token_keeps_its_leading_space(metaspace):
    prompt = metaspace.encode("the quick brown", add_special_tokens=False)
    full = metaspace.encode("the quick brown fox jumps", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    deltas, tail, _ = run(metaspace, prompt, output)
    # A continuation of the prompt: " fox jumps", where decoding the output alone drops the space.
    assert streamed(deltas, tail) == " fox jumps"
    assert metaspace.decode(output) == "fox jumps"
    assert deltas[0].text.startswith(" ")
    # Without a prompt there is nothing to continue: the first space goes, as in decode().
    deltas, tail, _ = run(metaspace, [], output)
    assert streamed(deltas, tail) == "fox jumps"


def test_metaspace_round_trip_is_the_continuation_of_the_prompt(metaspace):
    rnd = random.Random(3)
    vocab = len(metaspace)
    for _ in range(200):
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 8))]
        output = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 25))]
        deltas, tail, detok = run(metaspace, prompt, output)
        context = prompt[-6:]
        expected = metaspace.decode(context + output, skip_special_tokens=True)
        expected = expected[len(metaspace.decode(context, skip_special_tokens=True)) :]
        assert streamed(deltas, tail) == expected == detok.output_text


def test_byte_fallback_runs_decode_across_the_prompt_boundary(byte_fallback):
    tokens = byte_fallback.convert_ids_to_tokens(byte_fallback.encode("日", add_special_tokens=False))
    assert tokens[-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]  # really byte fallback
    for prompt_text, output_text in [("hello 日本", "語 and 東京"), ("stop 日", "本語"), ("", "日本語 ok")]:
        prompt = byte_fallback.encode(prompt_text, add_special_tokens=False)
        full = byte_fallback.encode(prompt_text + output_text, add_special_tokens=False)
        assert full[: len(prompt)] == prompt
        output = full[len(prompt) :]
        deltas, tail, _ = run(byte_fallback, prompt, output)
        assert streamed(deltas, tail) == byte_fallback.decode(full)[len(byte_fallback.decode(prompt)) :]
        assert "\ufffd" not in streamed(deltas, tail)
    # A long all-CJK generation: window restarts land on character boundaries.
    text = "日本語中文東京你好世界" * 6
    ids = byte_fallback.encode(text, add_special_tokens=False)
    prompt = byte_fallback.encode("日本", add_special_tokens=False)
    deltas, tail, _ = run(byte_fallback, prompt, ids)
    # The output starts with "▁" (a word start): as a continuation it is a space.
    assert streamed(deltas, tail) == " " + text


# -- stop strings --------------------------------------------------------------------------------


def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reference on the whole text: truncate before the stop occurrence that ends first."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, start, stop = min(hits)
    return text[:start], stop


def test_streamed_stops_match_the_whole_text_reference(byte_bpe):
    rnd = random.Random(4)
    vocab = len(byte_bpe)
    hits = 0
    for _ in range(300):
        output = [rnd.randrange(vocab) for _ in range(rnd.randint(1, 30))]
        text = byte_bpe.decode(output, skip_special_tokens=True)
        stops = [rnd.choice(WORDS) for _ in range(rnd.randint(0, 2))]
        for _ in range(rnd.randint(1, 3) if text else 0):
            start = rnd.randrange(len(text))
            stops.append(text[start : start + rnd.randint(1, 6)])
        _, _, detok = run(byte_bpe, [], output, stop=stops)
        assert (detok.output_text, detok.stop_reason) == first_stop(text, stops)
        hits += detok.stop_reason is not None
    assert hits > 200


def test_stop_string_across_tokens_is_never_emitted(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["world"])
    groups = pieces(byte_bpe, "hello", " wo", "r", "ld", " again")
    emitted = []
    for group in groups:
        for t in group:
            delta = detok.add_token(t)
            emitted.append(delta.text)
            if delta.stop_reason:
                break
        if detok.stop_reason:
            break
    assert "".join(emitted) == detok.output_text == "hello "
    assert detok.stop_reason == "world"
    assert not any(c in "".join(emitted[1:]) for c in "world")  # held back, then dropped
    assert detok.add_token(groups[-1][0]) == DetokenizerDelta("", "world")
    assert detok.finish() == ""


def test_held_text_is_released_once_it_cannot_start_a_stop(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["world"])
    assert feed(detok, pieces(byte_bpe, "hello", " w")) == ["hello", " "]  # "w" held
    assert feed(detok, pieces(byte_bpe, "ow")) == ["wo"]  # "w" held again: "world" may follow "wow"
    assert feed(detok, pieces(byte_bpe, "!")) == ["w!"]
    assert detok.finish() == ""
    assert detok.output_text == "hello wow!"
    assert detok.stop_reason is None


def test_finish_flushes_a_partial_stop(byte_bpe):
    ids = byte_bpe.encode("hello wor", add_special_tokens=False)
    deltas, tail, detok = run(byte_bpe, [], ids, stop=["world"])
    assert streamed(deltas, "") == "hello "
    assert tail == "wor"
    assert detok.output_text == "hello wor" == byte_bpe.decode(ids)
    assert detok.stop_reason is None


def test_stop_string_at_the_very_start(byte_bpe):
    ids = byte_bpe.encode("stop here", add_special_tokens=False)
    deltas, tail, detok = run(byte_bpe, byte_bpe.encode("say", add_special_tokens=False), ids, stop=["stop"])
    assert deltas[-1].stop_reason == "stop"
    assert streamed(deltas, tail) == detok.output_text == ""


def test_stop_inside_one_token(byte_bpe):
    ids = byte_bpe.encode("hello world again", add_special_tokens=False)
    deltas, _, detok = run(byte_bpe, [], ids, stop=["lo w"])
    assert detok.output_text == "hel"
    assert deltas[-1].stop_reason == "lo w"


def test_self_overlapping_stop_string(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["aab"])
    a, b, x = (pieces(byte_bpe, c)[0] for c in "abx")
    assert feed(detok, [x, a, a, a]) == ["x", "", "", "a"]  # "aa" stays held: "aab" may follow
    assert feed(detok, [b]) == [""]
    assert detok.stop_reason == "aab"
    assert detok.output_text == "xa"


def test_stops_sharing_characters(byte_bpe):
    a, b, c = (pieces(byte_bpe, ch)[0] for ch in "abc")
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["abc", "bc"])
    feed(detok, [a, b, c])
    # Both complete with "c": the longer, earlier-starting one wins and nothing is emitted.
    assert (detok.stop_reason, detok.output_text) == ("abc", "")


@pytest.mark.parametrize("split", [["a", "b", "c", "d"], ["abcd"], ["xabcdy"]])
def test_the_stop_that_completes_first_wins(byte_bpe, split: list[str]):
    # "bc" starts later than "abcd" but completes first; listed second, it still wins, and the
    # answer does not depend on how the text was split into tokens.
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["abcd", "bc"])
    feed(detok, pieces(byte_bpe, *split))
    assert detok.stop_reason == "bc"
    assert detok.output_text == ("xa" if split == ["xabcdy"] else "a")


def test_first_occurrence_in_the_text_wins_over_list_order(byte_bpe):
    ids = byte_bpe.encode("the quick brown fox", add_special_tokens=False)
    _, _, detok = run(byte_bpe, [], ids, stop=["fox", "quick"])
    assert (detok.stop_reason, detok.output_text) == ("quick", "the ")


def test_multibyte_stop_string(byte_bpe):
    byte_ids = [byte_bpe.convert_tokens_to_ids(BYTE_TO_CHAR[b]) for b in "🚀".encode()]
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["🚀"])
    assert feed(detok, [*pieces(byte_bpe, "go "), byte_ids]) == ["go ", ""]
    assert (detok.stop_reason, detok.output_text) == ("🚀", "go ")


def test_stop_completed_before_an_incomplete_character_is_caught_at_once(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["go!"])
    first_byte = byte_bpe.convert_tokens_to_ids(BYTE_TO_CHAR["😀".encode()[0]])
    feed(detok, [*pieces(byte_bpe, "let's go", "!"), [first_byte]])
    assert (detok.stop_reason, detok.output_text) == ("go!", "let's ")


def test_empty_stop_string_is_rejected(byte_bpe):
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte_bpe, [], stop=[""])


# -- special tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(byte_bpe, skip: bool):
    bos, eos = byte_bpe.convert_tokens_to_ids(SPECIALS)
    ids = [
        bos,
        *byte_bpe.encode("hello", add_special_tokens=False),
        eos,
        *byte_bpe.encode(" 😀", add_special_tokens=False),
    ]
    deltas, tail, _ = run(byte_bpe, [bos], ids, skip_special_tokens=skip)
    text = streamed(deltas, tail)
    assert text == byte_bpe.decode(ids, skip_special_tokens=skip)
    assert text == ("hello 😀" if skip else "<|bos|>hello<|eos|> 😀")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by the ByteLevel pre-tokenizer."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


BYTE_TO_CHAR = _bytes_to_unicode()


# -- the Rust decode, called directly ------------------------------------------------------------


@pytest.mark.parametrize("name", ["byte_bpe", "metaspace", "byte_fallback"])
@pytest.mark.parametrize("skip", [True, False])
def test_backend_decode_is_transformers_decode_without_clean_up(name: str, skip: bool, request) -> None:
    tokenizer = request.getfixturevalue(name)
    decode = backend_decode(tokenizer)
    assert decode is not None
    rnd = random.Random(7)
    specials = tokenizer.convert_tokens_to_ids(SPECIALS)
    for _ in range(200):
        ids = [rnd.choice([*specials, rnd.randrange(len(tokenizer))]) for _ in range(rnd.randint(0, 12))]
        want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert decode(ids, skip) == want


class ReversingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer whose own `_decode` differs from the Rust decode (as some model tokenizers' do)."""

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        text = super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs)
        return text[::-1]


def test_a_tokenizer_with_its_own_decode_keeps_it(byte_bpe) -> None:
    own = ReversingTokenizer(  # type: ignore[no-untyped-call]
        tokenizer_object=byte_bpe.backend_tokenizer, clean_up_tokenization_spaces=False
    )
    assert backend_decode(own) is None
    ids = byte_bpe.encode("hello world", add_special_tokens=False)
    detok = IncrementalDetokenizer(own, [], skip_special_tokens=True)
    assert detok._decode(ids) == "dlrow olleh"  # the tokenizer's decode, not the Rust one
