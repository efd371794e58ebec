"""create_app: the FastAPI application, from settings and services built by the caller."""

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from app.body_limit import BodyLimitMiddleware
from app.errors import install_error_handlers
from app.middleware import RequestContextMiddleware
from app.routes import admin, admin_adapters, completions, health, limits, models, routing, usage, usage_page
from app.services import Services


def create_app(services: Services, *, behind_serve_proxy: bool = False) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        services.delivery.start()  # usage records: outbox -> metering, in the background
        yield
        await services.delivery.stop()

    app = FastAPI(
        title="loraplex",
        description="OpenAI-compatible multi-tenant LoRA serving.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.services = services
    install_error_handlers(app)
    settings = services.settings
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=settings.max_body_kb * 1024,
        max_upload_bytes=settings.max_upload_mb * 2**20,
    )
    app.add_middleware(RequestContextMiddleware, emit_header=not behind_serve_proxy)  # the outer one
    routers = (
        completions.router,
        models.router,
        usage.router,
        limits.router,
        admin.router,
        admin_adapters.router,
        usage.admin_router,
        routing.router,
        health.router,
        usage_page.router,
    )
    for router in routers:
        app.include_router(router)
    return app
