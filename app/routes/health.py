"""GET /healthz: the process is up and serving HTTP. GET /readyz: it can serve requests now (the models
are loaded, the database and the rate limiter answer); 503 in the OpenAI error shape otherwise."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from app.deps import ServicesDep
from app.errors import NotReady
from app.readiness import OK, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
async def readyz(request: Request, services: ServicesDep) -> JSONResponse:
    readiness: Readiness | None = getattr(request.app.state, "readiness", None)
    if readiness is None:  # one per app: it remembers a database probe that is still running
        readiness = request.app.state.readiness = Readiness(services)
    checks = await readiness.check()
    failed = [name for name, result in checks.items() if result != OK]
    if not failed:
        return JSONResponse({"status": "ready", "checks": checks})
    details = "; ".join(f"{name}: {checks[name]}" for name in failed)
    error = NotReady(details)
    body = {**error.body(), "status": "not_ready", "checks": checks}
    return JSONResponse(body, status_code=error.status, headers=error.headers)
