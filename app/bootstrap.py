"""build_services: wire settings, database, catalog and an engine client into Services."""

from pathlib import Path

from app.authenticator import Authenticator
from app.catalog import ModelCatalog
from app.engine_client import EngineClient
from app.services import Services
from app.settings import Settings
from billing.db import make_engine, make_session_factory


def build_services(
    settings: Settings, engine: EngineClient, models: dict[str, tuple[Path, int | None]]
) -> Services:
    """`models`: base model name -> (model directory, max_model_len or None for the model's own)."""
    session_factory = make_session_factory(make_engine(settings.resolved_database_url()))
    secret = settings.resolved_key_secret()
    return Services(
        settings=settings,
        key_secret=secret,
        session_factory=session_factory,
        authenticator=Authenticator(session_factory, secret, ttl=settings.auth_cache_ttl_s),
        catalog=ModelCatalog.from_dirs(models),
        engine=engine,
    )
