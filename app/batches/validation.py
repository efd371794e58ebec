"""A batch's input file validated whole before any line runs, in two steps:

1. `scan` reads the file a line at a time from the store (never whole in memory): each line checked
   (app/batches/lines.py), custom_ids unique, and the lines naming each model noted;
2. `model_errors` asks once per distinct model whether the tenant may use it (a base model, its own
   adapter or a public one, as the interactive routes resolve `model`), each refused model an error on
   every line naming it.

Errors are listed by line, at most `max_errors` (the scan stops there). 50,000 lines scan in about a second
(pydantic validation dominates), so it runs inside the create request, in the thread pool: a batch is
created `in_progress` with its lines stored, or `failed` with its errors, in one transaction, and a process
that dies meanwhile leaves nothing half-validated behind.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from app.auth.authenticator import Principal
from app.batches.lines import LineCheck, LineError, Request
from app.errors import ModelNotFound
from app.services import Services


def numbered_lines(handle: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """The file's non-blank lines with their 1-based numbers (blank lines counted, as uploads count them)."""
    for number, raw in enumerate(handle, start=1):
        if raw.strip():
            yield number, raw


@dataclass
class Scan:
    lines: int = 0
    errors: list[LineError] = field(default_factory=list)
    models: dict[str, list[int]] = field(default_factory=dict)  # model -> the lines naming it

    def full(self, max_errors: int) -> bool:
        return len(self.errors) >= max_errors


def scan(handle: IO[bytes], endpoint: str, *, max_errors: int, max_models: int) -> Scan:
    """Blocking (reads the store): run it in a thread."""
    check = LineCheck(endpoint)
    result = Scan()
    seen: set[str] = set()
    for number, raw in numbered_lines(handle):
        result.lines += 1
        outcome = check.check(number, raw)
        error = _new(outcome, seen, result.models, max_models) if isinstance(outcome, Request) else outcome
        if error is not None:
            result.errors.append(error)
            if result.full(max_errors):
                break
    return result


def _new(request: Request, seen: set[str], models: dict[str, list[int]], max_models: int) -> LineError | None:
    if request.custom_id in seen:
        message = f"custom_id '{request.custom_id[:64]}' appears on an earlier line; each must be unique."
        return LineError(request.line, "duplicate_custom_id", message, "custom_id")
    seen.add(request.custom_id)
    if request.model not in models and len(models) >= max_models:
        message = f"The lines of one batch may name at most {max_models} distinct models."
        return LineError(request.line, "too_many_models", message, "body.model")
    models.setdefault(request.model, []).append(request.line)
    return None


async def model_errors(result: Scan, principal: Principal, services: Services, max_errors: int) -> None:
    """Adds an error for each line whose model the tenant may not use, then keeps the first `max_errors`
    errors by line."""
    for model, lines in result.models.items():
        try:
            await services.resolve(principal, model)
        except ModelNotFound as error:
            result.errors.extend(
                LineError(line, "model_not_found", error.message, "body.model") for line in lines[:max_errors]
            )
    result.errors = sorted(result.errors, key=lambda error: error.line)[:max_errors]
