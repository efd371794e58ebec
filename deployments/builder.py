"""build_app: the Ray Serve application graph, from the `args` of serve_config.yaml.

One engine deployment per base model (each with its own engine settings and replicas), one ingress
deployment holding a handle to each. Engine replicas get the platform's secrets blanked (ENGINE_BLANKED):
they never check an admin key or hash an API key, so a process that runs models and tenants' adapters
holds neither, even on a node whose environment has them.
"""

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from adapters.store import absolute_location
from app.limits.factory import LimiterConfig
from app.settings import Settings
from deployments.engine.interface import EngineConfig
from deployments.engine_replica import EngineReplica
from deployments.ingress import Ingress
from deployments.metering import Metering

# Secrets only the ingress needs, set empty in each engine replica's environment (over its node's).
ENGINE_BLANKED = ("LORAPLEX_ADMIN_KEY", "LORAPLEX_KEY_SECRET")
# Settings that ingress_settings may not carry: the config is readable by whoever reaches the dashboard.
SECRET_SETTINGS = frozenset({"admin_key", "key_secret", "database_url"})


class ModelDeployment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The base model's public name (the `model` field clients send).")
    engine: dict[str, Any] = Field(description="EngineConfig fields for this model's engine.")
    num_replicas: int = Field(default=1, ge=1, description="Engine replicas (ignored with autoscaling).")
    max_ongoing_requests: int = Field(default=256, ge=1, description="Streams one replica accepts at once.")
    autoscaling: dict[str, Any] | None = Field(
        default=None,
        description="Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, "
        "...): replicas follow the number of ongoing requests.",
    )
    router: Literal["adapter_aware", "default"] = Field(
        default="adapter_aware", description="adapter_aware: by adapter residency and load; default: Serve's."
    )
    spill_factor: float = Field(
        default=1.5,
        gt=0,
        description="A replica is overloaded at running+waiting >= spill_factor*max_num_seqs.",
    )
    drain_timeout_s: float = Field(
        default=300.0, ge=0, description="On scale-down, how long a replica may finish its running requests."
    )
    report_interval_s: float = Field(
        default=15.0,
        gt=0,
        description="How often each replica writes its busy time and routing counters to the database.",
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray actor options of each engine replica, over the defaults (num_cpus 0, num_gpus 1 on "
        "CUDA): e.g. resources: {engine_node: 1} places replicas on nodes that offer that resource.",
    )


class AppArgs(BaseModel):
    # A refusal never echoes the config: a secret put in ingress_settings by mistake stays out of the log.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    rate_limiter: LimiterConfig = Field(default_factory=LimiterConfig)
    models: list[ModelDeployment] = Field(min_length=1, description="Base models, each its own deployment.")
    ingress_replicas: int = Field(default=1, ge=1, description="Ingress (HTTP) replicas.")
    ingress_max_ongoing_requests: int = Field(default=1024, ge=1)
    rollup_interval_s: float = Field(
        default=300.0, gt=0, description="How often the Metering deployment refreshes rollups (and exports)."
    )
    ingress_ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="Ray actor options of each ingress replica, over num_cpus 0."
    )
    metering_ray_actor_options: dict[str, Any] = Field(
        default_factory=dict, description="Ray actor options of the metering replica, over num_cpus 0."
    )
    ingress_settings: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Settings of every ingress replica (app/settings.py field names: admin_listen, "
            "client_ip_header, public_docs, ...), over its node's LORAPLEX_* environment. Never secrets "
            "(admin_key, key_secret, database_url): those stay in the environment."
        ),
    )

    @model_validator(mode="after")
    def _no_secrets(self) -> "AppArgs":
        unknown = sorted(set(self.ingress_settings) - set(Settings.model_fields))
        if unknown:
            raise ValueError(f"ingress_settings: unknown settings {unknown}")
        secret = sorted(SECRET_SETTINGS & set(self.ingress_settings))
        if secret:
            raise ValueError(f"ingress_settings: {secret} must come from the environment, not the config")
        return self

    @model_validator(mode="after")
    def _unique(self) -> "AppArgs":
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return self


def _engine_config(model: ModelDeployment, settings: Settings) -> EngineConfig:
    """Validated now (a bad config fails `serve run` at once), with paths made absolute for workers."""
    fields = {
        "adapter_store": settings.resolved_adapter_store(),
        **model.engine,
        "served_model_name": model.name,
    }
    config = EngineConfig(**fields)
    # The adapter cache is a node's: unless the model names one, each engine replica takes its own node's
    # (deployments/engine_replica.py), not the value of the node this builder happens to run on.
    update = {"model": Path(config.model).resolve(), "adapter_store": absolute_location(config.adapter_store)}
    if config.adapter_cache_dir is not None:
        update["adapter_cache_dir"] = config.adapter_cache_dir.resolve()
    return config.model_copy(update=update)


def _engine_actor_options(config: EngineConfig, own: dict[str, Any]) -> dict[str, Any]:
    """The model's ray_actor_options over the defaults; the blanked secrets over any env_vars it sets."""
    runtime_env = dict(own.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **dict.fromkeys(ENGINE_BLANKED, "")}
    # CPU engines take no Ray CPU: on small machines the ingress and engines must share cores.
    return {"num_cpus": 0, "num_gpus": 1 if _wants_gpu(config) else 0, **own, "runtime_env": runtime_env}


def _wants_gpu(config: EngineConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def build_app(args: dict[str, Any]) -> Application:
    parsed = AppArgs(**args)
    settings = Settings(**parsed.ingress_settings)  # refused now if invalid (a short admin key among them)
    handles = {}
    models = {}
    for model in parsed.models:
        config = _engine_config(model, settings)
        scaling: dict[str, Any] = (
            {"autoscaling_config": model.autoscaling}
            if model.autoscaling
            else {"num_replicas": model.num_replicas}
        )
        if model.router == "adapter_aware":
            router: dict[str, Any] = {
                "request_router_class": "deployments.router.AdapterAwareRouter",
                # max_num_seqs too: a replica's capacity before its first routing stats arrive.
                "request_router_kwargs": {
                    "spill_factor": model.spill_factor,
                    "max_num_seqs": config.max_num_seqs,
                },
                "request_routing_stats_period_s": 1.0,  # residency changes quickly: refresh often
            }
            scaling["request_router_config"] = RequestRouterConfig(**router)
        deployment = serve.deployment(
            name=f"engine-{model.name}",
            max_ongoing_requests=model.max_ongoing_requests,
            # Scale-down drains: a stopping replica finishes its running requests first.
            graceful_shutdown_timeout_s=model.drain_timeout_s,
            graceful_shutdown_wait_loop_s=1.0,
            **scaling,
            ray_actor_options=_engine_actor_options(config, model.ray_actor_options),
            health_check_period_s=10,
        )(EngineReplica)
        handles[model.name] = deployment.bind(
            config.model_dump(mode="json", exclude_unset=True), report_interval_s=model.report_interval_s
        )
        models[model.name] = {
            "model": str(config.model),
            "max_model_len": config.max_model_len,
            "max_lora_rank": config.max_lora_rank,
            "lora_target_modules": list(config.lora_target_modules),
            "max_num_seqs": config.max_num_seqs,
        }
    metering = serve.deployment(
        name="metering",
        num_replicas=1,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 0, **parsed.metering_ray_actor_options},
    )(Metering).bind(rollup_interval_s=parsed.rollup_interval_s)
    ingress = serve.deployment(
        name="ingress",
        num_replicas=parsed.ingress_replicas,
        max_ongoing_requests=parsed.ingress_max_ongoing_requests,
        # An ingress replica being replaced (any change to `args` rolls every replica) holds its clients'
        # streams: it drains as long as the engines do, rather than Serve's 20 s, which would cut them.
        graceful_shutdown_timeout_s=max(m.drain_timeout_s for m in parsed.models),
        graceful_shutdown_wait_loop_s=1.0,
        ray_actor_options={"num_cpus": 0, **parsed.ingress_ray_actor_options},
    )(Ingress)
    app: Application = ingress.bind(
        handles, models, parsed.rate_limiter.model_dump(), metering, settings=parsed.ingress_settings
    )
    return app
