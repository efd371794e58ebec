"""What the ingress parses on its event loop's behalf, on hostile input: tool calls in model output, and
a /v1/completions prompt of token ids.

Tool calls: a `response_format` pattern can make a model write thousands of `<tool_call>` openings with
no closing one. The lazy regex `<tool_call>(.*?)</tool_call>` this platform used scanned to the end of the
text again from every opening (quadratic: 6.35 s per choice at 8,192 openings);
`app.completions.tool_calls.parse` reads the text once, and `ToolCallStream` (fed a few characters at a
time, as tokens arrive) too.
Prompts: `CompletionRequest` branches on the prompt's first element; the plain union it replaced tried
`list[str]` on every token id first.
Peers run in turns (bench.measure.Interleaved); each ratio is old / new, per round.
Run: python -m bench.parsing [--openings 8192] [--ids 1000000] [--repeats 3]; the last line is one JSON
object.
"""

import argparse
import json
import re
import time
from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from app.completions.tool_calls import BEGIN, END, ParsedCall, ToolCallStream, parse, parse_block
from app.schemas.openai import CompletionRequest
from bench.measure import Interleaved, machine

NAMES = frozenset({"get_weather"})
PIECE = 4  # characters per streamed output, about a token's
_BLOCK = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.DOTALL)


def regex_parse(text: str, names: frozenset[str]) -> tuple[str | None, list[ParsedCall]]:
    """The parser as it was before issue 24: `finditer` over a lazy block pattern."""
    calls: list[ParsedCall] = []
    pieces: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        block = parse_block(match.group(1), names)
        if block is None:
            continue
        pieces.append(text[position : match.start()].rstrip())
        position = match.end()
        calls.extend(block)
    if not calls:
        return text, []
    pieces.append(text[position:].rstrip())
    return "".join(pieces) or None, calls


def stream(text: str) -> str:
    parser = ToolCallStream(NAMES)
    events = []
    for i in range(0, len(text), PIECE):
        events += parser.feed(text[i : i + PIECE])
    events += parser.finish()
    return "".join(e for e in events if isinstance(e, str))


def timed(work: Callable[[], Any]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--openings", type=int, default=8192, help="unclosed <tool_call> openings")
    parser.add_argument("--ids", type=int, default=1_000_000, help="token ids in the prompt (~2 MB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each pair of peers")
    parser.add_argument("--tiny", action="store_true", help="small inputs, two rounds: checks it runs")
    args = parser.parse_args()
    openings, ids, repeats = (512, 20_000, 2) if args.tiny else (args.openings, args.ids, args.repeats)

    text = "Sure. " + BEGIN * openings
    assert parse(text, NAMES) == regex_parse(text, NAMES) == (text, [])
    assert stream(text) == text
    tools = Interleaved(
        {
            "one_pass": lambda: timed(lambda: parse(text, NAMES)),
            "regex": lambda: timed(lambda: regex_parse(text, NAMES)),
            "stream": lambda: timed(lambda: stream(text)),
        },
        repeats=repeats,
    ).run()

    body = {"model": "m", "prompt": [7] * ids}
    union = TypeAdapter(str | list[str] | list[int] | list[list[int]])  # the prompt's type before issue 24
    prompts = Interleaved(
        {
            "validate": lambda: timed(lambda: CompletionRequest.model_validate(body)),
            "union": lambda: timed(lambda: union.validate_python(body["prompt"])),
        },
        repeats=repeats,
    ).run()

    result: dict[str, Any] = {
        "openings": openings,
        "one_pass_s": round(tools.median("one_pass"), 7),
        "regex_s": round(tools.median("regex"), 7),
        "stream_s": round(tools.median("stream"), 7),
        "ratio_regex_vs_one_pass": tools.ratio("regex", "one_pass"),
        "prompt_ids": ids,
        "validate_s": round(prompts.median("validate"), 7),
        "union_s": round(prompts.median("union"), 7),
        "ratio_union_vs_validate": prompts.ratio("union", "validate"),
        "repeats": repeats,
        "machine": machine(),
    }
    print(
        f"{openings} openings: one pass {result['one_pass_s'] * 1e3:.2f} ms, stream "
        f"{result['stream_s'] * 1e3:.1f} ms, regex {result['regex_s'] * 1e3:.0f} ms; {ids:,} token ids: "
        f"validated in {result['validate_s'] * 1e3:.0f} ms, union {result['union_s'] * 1e3:.0f} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
