"""The reasoning split on its own: vLLM's qwen3 / deepseek_r1 semantics, hostile output, streaming equal to
whole; and which templates think, open thinking in the prompt, or write Phi-4-mini's tool calls."""

import random
from pathlib import Path

import pytest

from app.completions.chat_renderer import ChatRenderer
from app.completions.plan import Shape
from app.completions.reasoning import ReasoningStream, split
from app.modelprep.demo_model import CHAT_TEMPLATE
from app.schemas.openai import ChatMessage, CompletionTokensDetails
from app.served_models.chat_format import HERMES, PHI4, THINK_BEGIN, THINK_END, ChatFormat
from app.served_models.prompts import PromptBuilder
from deployments.engine.interface import FinishReason, RequestOutput
from tests.app.chat_families import OPENING_TEMPLATE, PHI4_TEMPLATE, QWEN3_TEMPLATE, with_template
from tests.model_fixtures import TinySetup


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nweigh it\n</think>\n\nYes.", False, ("weigh it", "Yes.")),
        ("  <think>a</think>b", False, ("a", "b")),
        ("Yes. <think>not reasoning</think>", False, (None, "Yes. <think>not reasoning</think>")),
        ("no tags at all", False, (None, "no tags at all")),
        ("weigh it</think>Yes.", True, ("weigh it", "Yes.")),  # the template opened <think>
        ("<think></think>Yes.", False, (None, "Yes.")),
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),  # only the first close ends it
        ("<think>cut short by max_tokens", False, ("cut short by max_tokens", None)),
        ("cut short by max_tokens", True, ("cut short by max_tokens", None)),
        ("<thi", False, (None, "<thi")),  # an unfinished tag at the end is text after all
        ("<think>a</thi", False, ("a</thi", None)),
        ("", False, (None, None)),
    ],
)
def test_the_split_follows_vllms_reasoning_parsers(
    text: str, opened: bool, expected: tuple[str | None, str | None]
) -> None:
    assert split(text, opened) == expected
    assert _streamed(text, opened, 1) == expected


def _streamed(text: str, opened: bool, size: int) -> tuple[str | None, str | None]:
    stream = ReasoningStream(opened)
    reasoning, content = [], []
    for start in range(0, len(text), size):
        r, c = stream.feed(text[start : start + size])
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join([*reasoning, r]) or None, "".join([*content, c]) or None


def test_many_openings_are_reasoning_text_read_in_one_pass() -> None:
    """A response_format or a bad model can write thousands of openings: only the first opens reasoning;
    the rest are its text, and an unterminated one leaves no content."""
    text = THINK_BEGIN * 50_000
    assert split(text) == (THINK_BEGIN * 49_999, None)
    assert split(text + THINK_END + "done") == (THINK_BEGIN * 49_999, "done")
    assert _streamed(text, False, 7) == (THINK_BEGIN * 49_999, None)
    blanks = " " * 100_000
    assert split(blanks + THINK_BEGIN + blanks + "x" + blanks) == ("x", None)


def test_streaming_equals_the_whole_split_and_never_leaks_a_tag() -> None:
    rng = random.Random(0)
    alphabet = [THINK_BEGIN, THINK_END, "<", "</", "<th", "</thi", " ", "\n", "a", "b", ">"]
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.3
        whole = split(text, opened)
        for size in (1, 2, 3, 5):
            assert _streamed(text, opened, size) == whole, (text, opened, size)
    stream = ReasoningStream()
    pieces = [stream.feed(c) for c in "<think>x</think>y"]
    assert all(THINK_BEGIN[:2] not in r + c for r, c in pieces)  # no piece of a tag comes out


def test_tokens_count_as_reasoning_until_the_close() -> None:
    stream = ReasoningStream()
    reasoned = []
    for token in ["<think>", " plan", "</think>", " answer"]:
        stream.feed(token)
        reasoned.append(stream.reasoned)
    assert reasoned == [True, True, True, False]


def test_one_whole_output_counts_its_reasoning_tokens_as_its_steps_one_by_one_would() -> None:
    """A non-streamed request gets one output a choice (EngineRequest.whole) with each step's end in its
    text: the reasoning tokens counted off it equal those of the same steps taken one output each."""
    steps = ["<think>", " plan", "", " more", "</think>", "\n\n", " answer", " done"]  # "": text held back
    one_by_one = ReasoningStream()
    parts = [one_by_one.take(text, [(len(text), 1)], i == len(steps) - 1) for i, text in enumerate(steps)]
    ends = [sum(map(len, steps[: i + 1])) for i in range(len(steps))]
    whole = ReasoningStream()
    assert whole.take("".join(steps), [(end, 1) for end in ends], True) == (
        "".join(r for r, _ in parts),
        "".join(c for _, c in parts),
    )
    assert whole.tokens == one_by_one.tokens == 5
    unsplit = ReasoningStream()  # one step for the whole text would count every token as reasoning
    unsplit.take("".join(steps), [(ends[-1], len(steps))], True)
    assert unsplit.tokens == len(steps)


def test_the_template_says_whether_a_model_thinks_and_how_it_calls_tools() -> None:
    assert ChatFormat.of(QWEN3_TEMPLATE) == ChatFormat(thinks=True, tools=HERMES)
    assert ChatFormat.of(CHAT_TEMPLATE) == ChatFormat(thinks=False, tools=HERMES)
    assert ChatFormat.of(PHI4_TEMPLATE) == ChatFormat(thinks=False, tools=PHI4)
    assert ChatFormat.of(None) == ChatFormat(thinks=False, tools=HERMES)


@pytest.fixture
def model_copy(llama: TinySetup, tmp_path: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((llama.model_dir / name).read_bytes())
    return tmp_path


def test_enable_thinking_reaches_the_template_and_an_opened_block_is_seen(model_copy: Path) -> None:
    hi = [ChatMessage(role="user", content="hi")]
    with_template(model_copy, QWEN3_TEMPLATE)
    qwen3 = PromptBuilder(model_copy)
    default, on, off = (qwen3.chat_prompt(hi, None, t) for t in (None, True, False))
    assert default == on and not on.opened
    assert str(qwen3.tokenizer.decode(off.ids)).endswith("<think>\n\n</think>\n\n") and not off.opened
    with_template(model_copy, OPENING_TEMPLATE)
    assert PromptBuilder(model_copy).chat_prompt(hi).opened


def test_phi4_tools_render_in_the_system_message_and_past_calls_as_written(model_copy: Path) -> None:
    with_template(model_copy, PHI4_TEMPLATE)
    prompts = PromptBuilder(model_copy)
    tool = {"type": "function", "function": {"name": "get_time", "description": "The time."}}
    past = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ],
        }
    )
    messages = [
        ChatMessage(role="user", content="time?"),
        past,
        ChatMessage(role="tool", tool_call_id="c1", content="noon"),
    ]
    text = str(prompts.tokenizer.decode(prompts.chat(messages, [tool])))
    assert text.startswith('<|system|><|tool|>[{"type": "function", "function": {"name": "get_time"')
    assert '<|assistant|><|tool_call|>[{"name": "get_time", "arguments": {}}]<|/tool_call|><|end|>' in text


def _outputs(pieces: list[str]) -> list[RequestOutput]:
    last = len(pieces) - 1
    return [
        RequestOutput(
            request_id="r",
            text=p,
            token_ids=[7],
            finished=n == last,
            finish_reason=FinishReason.STOP if n == last else None,
        )
        for n, p in enumerate(pieces)
    ]


def test_a_thinking_models_call_is_read_from_its_content_only(llama: TinySetup) -> None:
    """Reasoning first, then the tool-call parser on what follows it: whole and streamed alike."""
    texts = PromptBuilder(llama.model_dir).tokens
    shape = Shape(tool_names=frozenset({"get_time"}), reasoning=True)
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    pieces = ["<think>", " use", " <tool_", "call>?", "</think>", "\n\n", call[:9], call[9:]]
    whole = ChatRenderer("r", "m", shape, [[1]], texts)
    for out in _outputs(pieces):
        whole.add(out)
    [choice] = whole.choices()
    message = choice.message
    assert (message.reasoning_content, message.content) == ("use <tool_call>?", None)
    assert message.tool_calls and message.tool_calls[0].function.name == "get_time"
    assert choice.finish_reason == "tool_calls"
    stream = ChatRenderer("r", "m", shape, [[1]], texts)
    deltas = [p.delta for out in _outputs(pieces) for p in stream._pieces(out)]
    assert "".join(d.reasoning_content or "" for d in deltas) == "use <tool_call>?"
    assert not "".join(d.content or "" for d in deltas)
    assert [c.function.name for d in deltas for c in d.tool_calls or () if c.function.name] == ["get_time"]
    assert stream._usage(None).completion_tokens_details == CompletionTokensDetails(reasoning_tokens=5)
