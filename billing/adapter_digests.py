"""RegistryDigests: the registry's digest of each adapter version, for a node checking its copies.

Versions are immutable, so the node cache asks once per version and process (adapters/node_cache.py
keeps the answer); a registry that cannot be reached is the store being unavailable, not a wrong copy.
"""

from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from adapters.errors import AdapterStoreUnavailable
from adapters.ref import AdapterRef
from adapters.registered_digest import RegisteredDigest
from billing import adapter_registry


class RegistryDigests:
    def __init__(self, session_factory: Callable[[], Session]) -> None:
        self._sessions = session_factory

    def registered(self, ref: AdapterRef) -> RegisteredDigest | None:
        try:
            with self._sessions() as session:
                return adapter_registry.registered_digest(session, ref=ref)
        except SQLAlchemyError as error:
            raise AdapterStoreUnavailable(
                "registry", f"reading the digest of {ref} failed: {error}"
            ) from error
