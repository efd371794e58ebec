"""Ingress: the FastAPI app from app/ as a Ray Serve deployment, with handles to every engine.

Settings and services are built in the replica's constructor (never at import), and the ASGI app is
created late through `__serve_build_asgi_app__`.
"""

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from app import log_context
from app.admin_listener import AdminListener
from app.bootstrap import build_services
from app.budgets.factory import make_budgets
from app.dependency_noise import quiet_dependencies
from app.limits.factory import LimiterConfig, make_limiter
from app.main import Routes, create_app
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from deployments.client_gone import ClientGone
from deployments.engine.interface import DEFAULT_MAX_NUM_SEQS
from deployments.metering import ServeMeteringSink
from deployments.serve_engine_client import ServeEngineClient


@serve.ingress()
class Ingress:
    def __init__(
        self,
        engines: dict[str, DeploymentHandle[Any]],
        models: dict[str, dict[str, Any]],
        rate_limiter: dict[str, Any] | None = None,
        metering: DeploymentHandle[Any] | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        """`settings`: the config's ingress_settings, over this node's LORAPLEX_* environment."""
        log_context.route_to_serve()
        quiet_dependencies()  # before this replica imports the ML stack
        self.settings = Settings(**(settings or {}))
        specs = {
            name: BaseModelSpec(
                model_dir=Path(spec["model"]),
                max_model_len=spec.get("max_model_len"),
                max_lora_rank=spec["max_lora_rank"],
                lora_targets=tuple(spec["lora_target_modules"]),
                max_num_seqs=spec.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS),
            )
            for name, spec in models.items()
        }
        limiter_config = LimiterConfig(**(rate_limiter or {}))
        self.services = build_services(
            self.settings,
            ServeEngineClient(engines),
            specs,
            limiter=make_limiter(limiter_config),
            limiter_fail_open=limiter_config.fail_open,
            budgets=make_budgets(limiter_config),  # beside the limiter, of its kind (issue 29)
            metering=None if metering is None else ServeMeteringSink(metering),
        )
        self.admin_listener: AdminListener | None = None
        if self.settings.admin_listen:  # /admin on its own address; the tenant port then serves no /admin
            admin_app = create_app(self.services, routes="admin")
            self.admin_listener = AdminListener(admin_app, self.settings.admin_listen).start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        routes: Routes = "tenant" if self.admin_listener is not None else "all"
        app = create_app(self.services, behind_serve_proxy=True, routes=routes)
        app.add_middleware(ClientGone)  # outermost: Serve's receive is what it wraps
        return app

    def __del__(self) -> None:
        listener = getattr(self, "admin_listener", None)
        if listener is not None:
            listener.stop()
