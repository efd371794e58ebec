"""GET /healthz (and /health, vLLM's name, which load tools such as GuideLLM probe before a run): the
process is up and serving HTTP. GET /readyz: it can serve requests now (the models
are loaded, the database and the rate limiter answer); 503 in the OpenAI error shape otherwise. It names
each check (every base model among them) unless this listener keeps them to itself
(`public_readiness_checks` off on the tenant port): then only ready or not."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.deps import ServicesDep
from app.errors import NotReady
from app.readiness import OK, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
@router.get("/health", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(request: Request, services: ServicesDep) -> JSONResponse:
    readiness: Readiness | None = getattr(request.app.state, "readiness", None)
    if readiness is None:  # one per app: it remembers a database probe that is still running
        readiness = request.app.state.readiness = Readiness(services)
    checks = await readiness.check()
    failed = [name for name, result in checks.items() if result != OK]
    named = bool(request.app.state.readiness_checks)
    if not failed:
        return JSONResponse({"status": "ready", **({"checks": checks} if named else {})})
    error = NotReady("; ".join(f"{name}: {checks[name]}" for name in failed) if named else None)
    body = {**error.body(), "status": "not_ready", **({"checks": checks} if named else {})}
    return JSONResponse(body, status_code=error.status, headers=error.headers)
