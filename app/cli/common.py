"""What every `loraplex` command group shares: the global options, the admin HTTP client, output, errors.

A group (a `typer.Typer()` in its own module of app.cli, registered in app/cli/__init__.py) takes a
`typer.Context` and calls `admin_client(ctx)`, `emit(ctx, data, human)` and `fail(...)`; tables and records
come from app.cli.output, the billing database from app.cli.billing_database. Nothing here does any
work at import time.

Exit codes: 0 done; 1 the platform refused (its message is printed); 2 the CLI could not get an answer
(platform unreachable, no admin key, bad options).
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import quote

import httpx
import typer
from rich.console import Console
from rich.markup import escape

from app.surfaces import CLI_USER_AGENT

DEFAULT_URL = "http://127.0.0.1:8000"
EXIT_API_ERROR = 1
EXIT_USAGE = 2

JSON = dict[str, Any]
URL_HINT = "give the platform's base URL, e.g. --url http://127.0.0.1:8000"


@dataclass(frozen=True)
class CLIOptions:
    """The root command's global options, kept on the Click context (`ctx.obj`)."""

    url: str = DEFAULT_URL
    admin_key: str | None = None
    json: bool = False


def options(ctx: typer.Context) -> CLIOptions:
    """The global options of this invocation (defaults when a group runs without the root command)."""
    found = ctx.find_object(CLIOptions)
    return found if found is not None else CLIOptions()


def stdout() -> Console:
    """A console on stdout, made per call so that it follows redirections; sentences are never wrapped."""
    return Console(highlight=False, soft_wrap=True)


def fail(message: str, *, code: int = EXIT_API_ERROR, hint: str | None = None) -> NoReturn:
    """Print `error: message` (and a hint) to stderr and exit with `code`: never a traceback."""
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"[bold red]error:[/] {escape(message)}")
    if hint:
        console.print(f"[dim]hint:[/] {escape(hint)}")
    raise typer.Exit(code)


def emit(ctx: typer.Context, data: JSON, human: Callable[[JSON], None]) -> None:
    """The API's JSON with --json, else `human(data)` (tables, sentences)."""
    if options(ctx).json:
        typer.echo(json.dumps(data, indent=2))
    else:
        human(data)


def segment(value: str) -> str:
    """A user-given ID or name as one URL path segment."""
    return quote(value, safe="")


class AdminClient:
    """The admin API of one deployment. Failures do not return: they print a message and exit."""

    def __init__(self, url: str, admin_key: str, *, timeout: float = 30.0) -> None:
        self.url = url
        try:
            headers = {"authorization": f"Bearer {admin_key}", "user-agent": CLI_USER_AGENT}  # the surface
            self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)
        except httpx.InvalidURL as exc:
            fail(f"invalid platform URL {url!r}: {exc}", code=EXIT_USAGE, hint=URL_HINT)

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> JSON:
        return self.request("GET", path)

    def post(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body)

    def patch(self, path: str, body: JSON) -> JSON:
        return self.request("PATCH", path, body)

    def put(self, path: str, body: JSON) -> JSON:
        return self.request("PUT", path, body)

    def delete(self, path: str) -> JSON:
        return self.request("DELETE", path)

    def request(self, method: str, path: str, body: JSON | None = None) -> JSON:
        """Send one request; the decoded JSON object of a 2xx answer."""
        try:
            response = self._http.request(method, path, json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            fail(
                f"cannot reach {self.url}: is the platform running? (set --url or LORAPLEX_URL)",
                code=EXIT_USAGE,
            )
        except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
            fail(f"invalid platform URL {self.url!r}: {exc}", code=EXIT_USAGE, hint=URL_HINT)
        except httpx.HTTPError as exc:
            fail(f"{method} {self.url}{path} failed: {exc or type(exc).__name__}", code=EXIT_USAGE)
        if response.is_error:
            fail_from_response(response)
        try:
            payload = response.json()
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            fail(
                f"unexpected answer from {self.url}{path}: not a JSON object (is --url a loraplex platform?)"
            )
        return payload


def admin_client(ctx: typer.Context) -> AdminClient:
    """A client for the deployment named by --url, closed when the command ends; exits if no admin key."""
    opts = options(ctx)
    if not opts.admin_key:
        fail(
            "no admin key given",
            code=EXIT_USAGE,
            hint="pass --admin-key KEY (before the command) or set LORAPLEX_ADMIN_KEY; "
            "it is the platform's own LORAPLEX_ADMIN_KEY",
        )
    client = AdminClient(opts.url, opts.admin_key)
    ctx.call_on_close(client.close)
    return client


def fail_from_response(response: httpx.Response) -> NoReturn:
    """Exit 1 with the API's error message (OpenAI shape `{"error": {"message", "code"}}`) and status."""
    message, code = _error_of(response)
    hint = None
    if code == "invalid_admin_key":
        hint = "check --admin-key / LORAPLEX_ADMIN_KEY: it must equal the platform's LORAPLEX_ADMIN_KEY"
    elif code is None and response.status_code in (404, 405):  # the route itself is missing
        hint = "is --url the platform's base URL (no path), and does the platform have this command's API?"
    fail(f"{message} (HTTP {response.status_code})", hint=hint)


def _error_of(response: httpx.Response) -> tuple[str, str | None]:
    try:
        payload = response.json()
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            code = error.get("code")
            return error["message"], code if isinstance(code, str) else None
        if isinstance(payload.get("detail"), str):  # a plain FastAPI/Starlette error
            return payload["detail"], None
    text = " ".join(response.text.split())
    return (text[:300] or response.reason_phrase or "request failed"), None


def confirmed_delete(
    ctx: typer.Context,
    path: str,
    *,
    yes: bool,
    already_gone: Callable[[JSON], bool],
    question: Callable[[JSON], str],
    cancelled: str,
    print_already: Callable[[JSON], None],
    print_done: Callable[[JSON], None],
) -> None:
    """DELETE `path`, unless the caller declines when asked; say so when there is nothing left to do."""
    client = admin_client(ctx)
    if not yes:
        current = client.get(path)
        if already_gone(current):
            emit(ctx, current, print_already)
            return
        if not typer.confirm(question(current), err=True):
            fail(cancelled)
    emit(ctx, client.delete(path), print_done)
