"""The rate limits a tier sells and a tenant may override: the options that `loraplex tiers create|update`
and `loraplex tenants update` share, and how limits are sent and shown.

A limit left unset is unlimited. `--unlimited rpm,tpm` (tiers) and `--clear-overrides rpm,tpm` (tenants)
send those limits as JSON null.
"""

from typing import Annotated

import typer

from app.cli.common import EXIT_USAGE, JSON, fail

LIMITS = ("rpm", "tpm", "max_concurrent", "max_tokens_cap")  # as billing.models.LIMIT_FIELDS (not imported:
# the HTTP commands stay free of SQLAlchemy)
LIMIT_CHOICES = "rpm, tpm, max_concurrent, max_tokens_cap, or all"

RpmOption = Annotated[
    int | None, typer.Option("--rpm", min=1, metavar="N", help="Requests per minute.", show_default=False)
]
TpmOption = Annotated[
    int | None,
    typer.Option(
        "--tpm", min=1, metavar="N", help="Tokens (prompt + completion) per minute.", show_default=False
    ),
]
MaxConcurrentOption = Annotated[
    int | None,
    typer.Option(
        "--max-concurrent",
        min=1,
        metavar="N",
        help="Sequences in flight at once (n x prompts per request).",
        show_default=False,
    ),
]
MaxTokensCapOption = Annotated[
    int | None,
    typer.Option(
        "--max-tokens-cap", min=1, metavar="N", help="Largest max_tokens of one request.", show_default=False
    ),
]


def limit_values(
    rpm: int | None, tpm: int | None, max_concurrent: int | None, max_tokens_cap: int | None
) -> dict[str, int]:
    """The limit options that were given, by API field name."""
    values = dict(zip(LIMITS, (rpm, tpm, max_concurrent, max_tokens_cap), strict=True))
    return {field: value for field, value in values.items() if value is not None}


def limit_names(values: list[str] | None, *, option: str) -> list[str]:
    """`rpm,tpm` (repeatable; `max-concurrent` or `max_concurrent`; `all`) as API field names; exits 2 on
    an unknown one."""
    names: list[str] = []
    for value in values or []:
        for part in value.split(","):
            name = part.strip().lower().replace("-", "_")
            if not name:
                continue
            if name == "all":
                names.extend(LIMITS)
            elif name in LIMITS:
                names.append(name)
            else:
                fail(
                    f"{option}: unknown limit {part.strip()!r}",
                    code=EXIT_USAGE,
                    hint=f"give {LIMIT_CHOICES}",
                )
    return list(dict.fromkeys(names))


def limits_body(set_to: dict[str, int], cleared: list[str], *, option: str) -> JSON:
    """Limits to set plus limits to send as null; exits 2 if one is both set and cleared."""
    both = [name for name in cleared if name in set_to]
    if both:
        flag = "--" + both[0].replace("_", "-")
        fail(f"{flag} and {option} {both[0]} contradict each other", code=EXIT_USAGE)
    return {**set_to, **dict.fromkeys(cleared)}


def fmt_limit(value: object) -> str:
    """A limit for people: `100,000`, or `unlimited` for none."""
    return f"{value:,}" if isinstance(value, int) else "unlimited"


def fmt_on_limit(limits: JSON) -> str:
    if limits.get("on_limit") == "queue":
        return f"queue up to {limits.get('max_queue_ms')} ms"
    return "reject"


def tenant_limit_rows(tenant: JSON) -> list[tuple[str, object]]:
    """A tenant's effective limits, each marked as its own override or its tier's."""
    limits: JSON = tenant.get("limits") or {}
    rows: list[tuple[str, object]] = []
    for name in LIMITS:
        source = "override" if tenant.get(name) is not None else f"tier {tenant.get('tier')}"
        rows.append((name, f"{fmt_limit(limits.get(name))} ({source})"))
    rows.append(("on_limit", fmt_on_limit(limits)))
    return rows
