"""FailureThrottle: how many failed key lookups each client address caused, per fixed window.

A flood of random well-formed keys is a flood of database lookups (each unknown key is new to the negative
cache). Past `limit` failures in a window, the client's keys that would need a lookup get 429 until the
window ends; keys already cached as valid still work, so a tenant sharing the address is not locked out
while its key is cached. Kept per ingress replica: it protects this replica's share of the database.
"""

MAX_CLIENTS = 100_000


class FailureThrottle:
    def __init__(self, *, limit: int, window_s: float) -> None:
        self._limit = limit
        self._window_s = window_s
        self._windows: dict[str, tuple[float, int]] = {}  # client -> (window end, failures in it)

    def retry_after(self, client: str, now: float) -> float | None:
        """Seconds until `client` may cause lookups again; None when it may now."""
        window = self._windows.get(client)
        if window is None or window[0] <= now or window[1] < self._limit:
            return None
        return window[0] - now

    def failed(self, client: str, now: float) -> None:
        window = self._windows.get(client)
        if window is None or window[0] <= now:
            if len(self._windows) >= MAX_CLIENTS:  # bounded: forget finished windows, else everyone
                self._windows = {c: w for c, w in self._windows.items() if w[0] > now}
                if len(self._windows) >= MAX_CLIENTS:
                    self._windows.clear()
            self._windows[client] = (now + self._window_s, 1)
        else:
            self._windows[client] = (window[0], window[1] + 1)
