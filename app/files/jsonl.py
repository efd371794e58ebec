"""JsonlCheck: a JSONL upload checked as its bytes arrive, never held whole: each non-empty line one JSON
object of at most `max_line_bytes`, at most `max_lines` lines and `max_bytes` bytes. Only the line being
received is buffered, so a file of any size takes at most a line's bytes of memory.

Blank lines are allowed and skipped; line numbers are the file's own (1-based, blank lines counted), as a
batch's line errors name them.
"""

import json

from app.errors import InvalidParameter, PayloadTooLarge


class JsonlCheck:
    def __init__(self, *, max_bytes: int, max_lines: int, max_line_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.max_line_bytes = max_line_bytes
        self.bytes = 0
        self.lines = 0  # non-empty lines: requests
        self._number = 0  # lines seen, blank ones included
        self._partial = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        """The next bytes of the file; a 4xx naming what it breaks at the first line that breaks it."""
        self.bytes += len(data)
        if self.bytes > self.max_bytes:
            message = f"The file is larger than {self.max_bytes:,} bytes, the most one file may hold."
            raise PayloadTooLarge(message, code="file_too_large")
        start = 0
        while (end := data.find(b"\n", start)) != -1:
            if self._partial:
                self._partial += data[start:end]
                self._line(bytes(self._partial))
                self._partial.clear()
            else:
                self._line(bytes(data[start:end]))
            start = end + 1
        self._partial += data[start:]
        if len(self._partial) > self.max_line_bytes:
            self._too_long(self._number + 1)

    def end(self) -> None:
        """The file is complete: its last line (without a newline) is checked, and an empty file refused."""
        if self._partial:
            self._line(bytes(self._partial))
            self._partial.clear()
        if self.lines == 0:
            raise InvalidParameter(
                "The file has no lines; a batch file holds one request per line.",
                param="file",
                code="empty_file",
            )

    def _line(self, raw: bytes) -> None:
        self._number += 1
        if len(raw) > self.max_line_bytes:
            self._too_long(self._number)
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            message = f"The file has more than {self.max_lines:,} lines, the most one file may hold."
            raise InvalidParameter(message, param="file", code="too_many_lines")
        try:
            value = json.loads(raw)
        except ValueError as error:  # UnicodeDecodeError included
            message = f"Line {self._number} is not valid JSON ({error}); each line must be one JSON object."
            raise InvalidParameter(message, param="file", code="invalid_jsonl") from None
        if not isinstance(value, dict):
            message = f"Line {self._number} is not a JSON object; each line must be one JSON object."
            raise InvalidParameter(message, param="file", code="invalid_jsonl")

    def _too_long(self, number: int) -> None:
        message = (
            f"Line {number} is longer than {self.max_line_bytes:,} bytes, the most one request may take."
        )
        raise InvalidParameter(message, param="file", code="line_too_long")
