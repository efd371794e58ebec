"""JsonlCheck (app/files/jsonl.py): a JSONL upload checked as its bytes arrive, in chunks cut anywhere."""

import json

import pytest

from app.errors import APIError
from app.files.jsonl import JsonlCheck


def checked(content: bytes, chunk: int, **limits: int) -> JsonlCheck:
    check = JsonlCheck(**{"max_bytes": 10_000, "max_lines": 10, "max_line_bytes": 100, **limits})
    for start in range(0, len(content), chunk):
        check.feed(bytearray(content[start : start + chunk]))
    check.end()
    return check


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_lines_are_counted_whatever_the_chunks(chunk: int) -> None:
    content = b'{"a": 1}\n\n  \n{"b": [1, 2]}\r\n{"c": "\xc3\xa9"}'  # blank lines skipped, last without \n
    check = checked(content, chunk)
    assert (check.lines, check.bytes) == (3, len(content))


@pytest.mark.parametrize(
    ("content", "limits", "status", "code", "words"),
    [
        (b'{"a": 1}\n{"a": \n', {}, 400, "invalid_jsonl", "Line 2 "),
        (b'{"a": 1}\n\n"text"\n', {}, 400, "invalid_jsonl", "Line 3 "),
        (b'{"a": "\xff"}\n', {}, 400, "invalid_jsonl", "Line 1 "),
        (b"{}\n" * 11, {}, 400, "too_many_lines", "10 lines"),
        (json.dumps({"a": "x" * 200}).encode(), {}, 400, "line_too_long", "Line 1 "),
        (b"{}\n" + json.dumps({"a": "x" * 200}).encode() + b"\n", {}, 400, "line_too_long", "Line 2 "),
        (b"{}\n" * 5, {"max_bytes": 12}, 413, "file_too_large", "12 bytes"),
        (b"\n \n", {}, 400, "empty_file", "no lines"),
    ],
)
def test_each_fault_is_named_at_its_line(
    content: bytes, limits: dict[str, int], status: int, code: str, words: str
) -> None:
    for chunk in (1, 4, len(content)):
        with pytest.raises(APIError) as caught:
            checked(content, chunk, **limits)
        assert (caught.value.status, caught.value.code) == (status, code)
        assert words in caught.value.message, caught.value.message
