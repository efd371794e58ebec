"""create_app: the FastAPI application, from settings and services built by the caller.

`routes` picks what one listener serves: everything (the default), the tenant API alone, or the admin API
alone, for operators who keep /admin on a listener of its own (Settings.admin_listen) behind a firewall.
The tenant-facing listeners ("all", "tenant") show the API docs and name /readyz's checks only where the
settings say so (`public_docs`, `public_readiness_checks`); the admin listener, private, always does, and
trusts no client-address header (it is reached directly).
"""

import contextlib
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import FastAPI

from app.body_limit import BodyLimitMiddleware
from app.errors import install_error_handlers
from app.middleware import RequestContextMiddleware
from app.responses import routes as responses
from app.routes import (
    admin,
    admin_adapters,
    admin_budgets,
    completions,
    health,
    limits,
    models,
    routing,
    usage,
    usage_page,
)
from app.services import Services

Routes = Literal["all", "tenant", "admin"]


def create_app(services: Services, *, behind_serve_proxy: bool = False, routes: Routes = "all") -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if routes == "admin":  # the tenant listener runs the usage delivery; one per process
            yield
            return
        services.delivery.start()  # usage records: outbox -> metering, in the background
        yield
        await services.delivery.stop()

    settings = services.settings
    private = routes == "admin"
    docs = private or settings.public_docs
    app = FastAPI(
        title="loraplex",
        description="OpenAI-compatible multi-tenant LoRA serving.",
        version="0.1.0",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.services = services
    app.state.client_ip_header = "" if private else settings.client_ip_header
    app.state.readiness_checks = private or settings.public_readiness_checks
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_kb * 1024,
        max_upload_bytes=settings.max_upload_mb * 2**20,
    )
    app.add_middleware(RequestContextMiddleware, emit_header=not behind_serve_proxy)  # the outer one
    tenant = (
        completions.router,
        responses.router,
        models.router,
        usage.router,
        limits.router,
        usage_page.router,
    )
    admin_api = (
        admin.router,
        admin_budgets.router,
        admin_adapters.router,
        usage.admin_router,
        routing.router,
    )
    routers = {"all": (*tenant, *admin_api), "tenant": tenant, "admin": admin_api}[routes]
    for router in (*routers, health.router):
        app.include_router(router)
    return app
