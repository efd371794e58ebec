"""GET /usage: a small self-contained page where a tenant, logged in with its API key, sees its usage.

The page is static (app/static): its script calls the JSON API (/v1/usage, /v1/limits, /v1/models) with
the key as a Bearer token, so this router needs no auth and holds no tenant data. Nothing is fetched from
outside the platform: the charts are SVG drawn by the script, and the CSP forbids anything else.
"""

from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from app.errors import NotFound

STATIC = Path(__file__).resolve().parent.parent / "static"
# A fixed allow-list, not a static directory mount: only these files can ever be served from here.
ASSETS = {"usage.js": "text/javascript; charset=utf-8", "usage.css": "text/css; charset=utf-8"}
HEADERS = {
    # The key is typed into this page: no inline script, no third-party origin, no framing.
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

router = APIRouter(tags=["usage page"], include_in_schema=False)


@cache
def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/usage")
def usage_page() -> Response:
    return Response(_read("usage.html"), media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/usage/assets/{name}")
def usage_asset(name: str) -> Response:
    media_type = ASSETS.get(name)
    if media_type is None:
        raise NotFound(f"No such asset: {name!r}.")
    return Response(_read(name), media_type=media_type, headers=HEADERS)
