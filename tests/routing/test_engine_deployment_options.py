"""serve_config.yaml's per-model routing options reach the engine deployment Serve builds: autoscaling,
the adapter-aware router (or Serve's), drain on scale-down, the report interval."""

from typing import Any

from ray.serve.deployment import Deployment

from deployments.builder import build_app


def engine_deployment(model: dict[str, Any]) -> Deployment:
    app = build_app({"models": [{"name": "m", "engine": {"model": "/models/m"}, **model}]})
    ingress = app._bound_deployment
    handles = ingress.init_args[0]  # Ingress(handles, models, limiter, metering)
    deployment: Deployment = handles["m"]._bound_deployment
    return deployment


def test_autoscaling_router_and_drain() -> None:
    deployment = engine_deployment(
        {"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4},
         "drain_timeout_s": 7, "spill_factor": 2.5, "report_interval_s": 0.5}
    )  # fmt: skip
    config = deployment._deployment_config
    assert config.autoscaling_config is not None
    assert (config.autoscaling_config.min_replicas, config.autoscaling_config.max_replicas) == (1, 3)
    assert config.graceful_shutdown_timeout_s == 7
    router = config.request_router_config
    assert router.request_router_class == "deployments.router.AdapterAwareRouter"
    assert router.request_router_kwargs == {"spill_factor": 2.5, "max_num_seqs": 64}  # the engine default
    # Ray annotates Deployment.init_kwargs as Tuple[Any]; it is the kwargs dict given to bind().
    assert deployment.init_kwargs == {"report_interval_s": 0.5}  # type: ignore[comparison-overlap]


def test_fixed_replicas_and_serves_own_router() -> None:
    deployment = engine_deployment({"num_replicas": 3, "router": "default"})
    config = deployment._deployment_config
    assert config.autoscaling_config is None and deployment.num_replicas == 3
    assert "AdapterAwareRouter" not in str(config.request_router_config.request_router_class)
