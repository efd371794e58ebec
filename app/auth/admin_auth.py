"""AdminAuth: Authorization: Bearer LORAPLEX_ADMIN_KEY, compared in constant time, with failures throttled.

The key is at least 32 bytes (Settings refuses a shorter one), so guessing it is hopeless; the throttle
keeps a scanner from costing anything either: past `admin_auth_failure_limit` failed checks in a window, a
client address gets 429 for every admin call, the right key included, until the window ends (a guess that
could still succeed would leave the throttle nothing to protect). Kept per ingress replica.
"""

import hmac
import time

from app.auth.failures import FailureWindows
from app.errors import AdminAuthFailed, TooManyFailedAuthentications
from app.settings import Settings


class AdminAuth:
    def __init__(self, settings: Settings) -> None:
        self._expected = settings.admin_key.get_secret_value().encode()
        self._failures = FailureWindows(
            limit=settings.admin_auth_failure_limit, window_s=settings.auth_failure_window_s
        )

    def check(self, authorization: str | None, client: str | None) -> None:
        """`client`: the caller's address, which failed checks are counted against."""
        if not self._expected:
            raise AdminAuthFailed("The admin API is disabled: set LORAPLEX_ADMIN_KEY.")
        now = time.monotonic()
        if client is not None and (wait := self._failures.retry_after(client, now)) is not None:
            raise TooManyFailedAuthentications(wait, credential="admin keys")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._expected):
            if client is not None:
                self._failures.failed(client, now)
            raise AdminAuthFailed("Invalid admin key.")
