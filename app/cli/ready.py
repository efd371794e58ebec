"""`loraplex ready`: wait until the platform can serve (models loaded, database and limiter answering),
showing each readiness check as it turns ok; the way to follow a model load after `loraplex up`."""

import time
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from app.cli.common import EXIT_API_ERROR, emit, fail, options, stdout

POLL_S = 1.0


def ready(
    ctx: typer.Context,
    wait: Annotated[
        float, typer.Option("--wait", metavar="SECONDS", help="How long to wait for readiness (0: ask once).")
    ] = 300.0,
) -> None:
    """Wait until GET /readyz says ready; exit 1 with the failing checks when --wait runs out."""
    url = options(ctx).url
    deadline = time.monotonic() + wait
    checks: dict[str, str] = {}
    console = Console(stderr=True, highlight=False)
    with httpx.Client(base_url=url, timeout=10) as http, Live(console=console, transient=True) as live:
        while True:
            state, checks = _probe(http)
            live.update(_table(state, checks, deadline))
            if state == "ready" or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    if state != "ready":
        pending = ", ".join(f"{name}: {result}" for name, result in checks.items() if result != "ok")
        fail(f"not ready after {wait:g}s: {pending or state}", code=EXIT_API_ERROR)
    answer = {"status": "ready", "checks": checks}
    emit(ctx, answer, lambda _: stdout().print(f"{url} is ready", markup=False))


def _probe(http: httpx.Client) -> tuple[str, dict[str, str]]:
    """("ready" | "not_ready" | why it could not ask, the checks)."""
    try:
        response = http.get("/readyz")
    except httpx.HTTPError as error:
        return f"unreachable ({type(error).__name__}): starting?", {}
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}, not a loraplex platform?", {}
    checks = body.get("checks") if isinstance(body, dict) else None
    return str(body.get("status", "not_ready")), checks if isinstance(checks, dict) else {}


def _table(state: str, checks: dict[str, str], deadline: float) -> Table:
    left = max(0.0, deadline - time.monotonic())
    table = Table(box=None, title=f"waiting for readiness ({left:.0f}s left): {state}", title_justify="left")
    table.add_column("CHECK")
    table.add_column("STATE")
    for name, result in checks.items():
        table.add_row(Text(name), Text("ok" if result == "ok" else f"… {result}"))
    return table
