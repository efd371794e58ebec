"""create_app: the FastAPI application, from settings and services built by the caller."""

from fastapi import FastAPI

from app.errors import install_error_handlers
from app.middleware import RequestContextMiddleware
from app.routes import admin, admin_adapters, completions, health, models
from app.services import Services


def create_app(services: Services, *, behind_serve_proxy: bool = False) -> FastAPI:
    app = FastAPI(
        title="loraplex",
        description="OpenAI-compatible multi-tenant LoRA serving.",
        version="0.1.0",
    )
    app.state.services = services
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, emit_header=not behind_serve_proxy)
    for router in (completions.router, models.router, admin.router, admin_adapters.router, health.router):
        app.include_router(router)
    return app
