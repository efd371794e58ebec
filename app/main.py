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

from app.batches import routes as batches
from app.batches.runner import BatchRunner
from app.body_limit import ADAPTER_UPLOAD_PATH, FILE_UPLOAD_PATH, BodyLimitMiddleware
from app.errors import install_error_handlers
from app.files import routes as files
from app.files.routes import MULTIPART_ALLOWANCE
from app.middleware import RequestContextMiddleware
from app.responses import routes as responses
from app.responses.store import ResponseStore
from app.routes import (
    admin,
    admin_adapters,
    admin_batches,
    admin_budgets,
    completions,
    engines,
    health,
    limits,
    models,
    routing,
    usage,
    usage_page,
)
from app.services import Services
from app.storage_billing import StorageBilling
from app.sweeper import Sweeper

Routes = Literal["all", "tenant", "admin"]


def create_app(services: Services, *, behind_serve_proxy: bool = False, routes: Routes = "all") -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(application: FastAPI) -> AsyncIterator[None]:
        if routes == "admin":  # the tenant listener runs the usage delivery; one per process
            yield
            return
        services.delivery.start()  # usage records: outbox -> metering, in the background
        responses_config, files_config = services.settings.responses, services.settings.files
        sweepers = (
            Sweeper(
                "stored responses",
                ResponseStore(services.session_factory, responses_config).sweep,
                responses_config.sweep_interval_s,
            ),
            Sweeper("files", services.file_store().sweep, files_config.sweep_interval_s),
            # Not a deletion, but the same bounded round on a timer: the hour that ended, charged once.
            Sweeper(
                "storage charges",
                StorageBilling(
                    services.session_factory,
                    spend=None if services.budget_guard is None else services.budget_guard.spend,
                ).charge,
                responses_config.sweep_interval_s,
            ),
        )
        for sweeper in sweepers:
            sweeper.start()  # what expired, of every tenant
        application.state.sweepers = sweepers
        runner = BatchRunner(services) if services.settings.batches.run_lines else None
        if runner is not None:
            runner.start()  # batch lines, claimed through the database with the other replicas
        application.state.batch_runner = runner
        yield
        if application.state.batch_runner is not None:  # a test may have put another in its place
            await application.state.batch_runner.stop()
        for sweeper in sweepers:
            await sweeper.stop()
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
        upload_limits={
            ADAPTER_UPLOAD_PATH: settings.max_upload_mb * 2**20,
            FILE_UPLOAD_PATH: settings.files.max_bytes + MULTIPART_ALLOWANCE,
        },
    )
    app.add_middleware(RequestContextMiddleware, emit_header=not behind_serve_proxy)  # the outer one
    tenant = (
        completions.router,
        responses.router,
        files.router,
        batches.router,
        models.router,
        usage.router,
        limits.router,
        usage_page.router,
    )
    admin_api = (
        admin.router,
        admin_budgets.router,
        admin_adapters.router,
        admin_batches.router,
        usage.admin_router,
        routing.router,
        engines.router,
    )
    routers = {"all": (*tenant, *admin_api), "tenant": tenant, "admin": admin_api}[routes]
    for router in (*routers, health.router):
        app.include_router(router)
    return app
