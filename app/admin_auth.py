"""The admin key check: Authorization: Bearer LORAPLEX_ADMIN_KEY, compared in constant time."""

import hmac

from app.errors import AdminAuthFailed
from app.settings import Settings


def check_admin_key(settings: Settings, authorization: str | None) -> None:
    expected = settings.admin_key.get_secret_value()
    if not expected:
        raise AdminAuthFailed("The admin API is disabled: set LORAPLEX_ADMIN_KEY.")
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise AdminAuthFailed("Invalid admin key.")
