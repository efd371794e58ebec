"""What the application graph hands each deployment beyond placement: the config's ingress_settings reach
the ingress (and never carry a secret), and engine replicas get the platform's secrets blanked."""

from typing import Any

import pytest
from pydantic import ValidationError
from ray.serve import Application

from deployments.builder import build_app

MODEL = {"name": "m", "engine": {"model": "/models/m", "device": "cpu"}}


def _ingress_and_engine(app: Application) -> tuple[Any, Any]:
    ingress = app._bound_deployment
    return ingress, ingress.init_args[0]["m"]._bound_deployment  # Ingress(handles, models, limiter, metering)


def test_engine_replicas_hold_neither_the_admin_key_nor_the_key_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", "k" * 40)  # the builder's node has them; its engines must not
    monkeypatch.setenv("LORAPLEX_KEY_SECRET", "secret")
    _, engine = _ingress_and_engine(build_app({"models": [MODEL]}))
    blank = {"LORAPLEX_ADMIN_KEY": "", "LORAPLEX_KEY_SECRET": ""}
    assert engine.ray_actor_options["runtime_env"] == {"env_vars": blank}
    # A model's own runtime_env keeps its other fields and variables; the blanks win over its own.
    env_vars = {"HF_HOME": "/hf", "LORAPLEX_ADMIN_KEY": "k" * 40}
    own = {"runtime_env": {"env_vars": env_vars, "working_dir": "."}}
    _, engine = _ingress_and_engine(build_app({"models": [{**MODEL, "ray_actor_options": own}]}))
    expected = {"env_vars": {"HF_HOME": "/hf", **blank}, "working_dir": "."}
    assert engine.ray_actor_options["runtime_env"] == expected


def test_ingress_settings_reach_every_ingress_replica() -> None:
    settings = {"admin_listen": "127.0.0.1:8001", "public_docs": False, "client_ip_header": "x-forwarded-for"}
    ingress, _ = _ingress_and_engine(build_app({"models": [MODEL], "ingress_settings": settings}))
    assert ingress.init_kwargs == {"settings": settings}


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"admin_key": "k" * 40}, "must come from the environment"),
        ({"key_secret": "s"}, "must come from the environment"),
        ({"database_url": "postgresql://u:p@db/x"}, "must come from the environment"),
        ({"public_doc": False}, "unknown settings"),
        ({"admin_auth_failure_limit": 0}, "greater than or equal to 1"),
    ],
)
def test_ingress_settings_are_checked_when_the_app_is_built(settings: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ValidationError, match=refusal) as refused:
        build_app({"models": [MODEL], "ingress_settings": settings})
    assert "postgresql://u:p" not in str(refused.value)
