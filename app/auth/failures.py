"""FailureThrottle: how many failed key lookups each client address caused, per fixed window.

A flood of random well-formed keys is a flood of database lookups (each unknown key is new to the negative
cache). Failures are counted twice: per (address, key prefix) and per address. Past `per_key_limit`
failures of one prefix from an address, that prefix gets 429 from there until the window ends. Past
`limit` failures from an address, its keys that would need a lookup get 429 too, except keys whose prefix
this replica has seen authenticate: so one client spraying keys behind a shared address (a NAT, an office)
does not lock out the tenants beside it, and keys already cached as valid work throughout. Kept per ingress
replica: it protects this replica's share of the database.
"""

MAX_CLIENTS = 100_000
MAX_KNOWN = 100_000


class FailureWindows:
    """Failures per key (an address, an address and prefix) in fixed windows; bounded in memory."""

    def __init__(self, *, limit: int, window_s: float) -> None:
        self._limit = limit
        self._window_s = window_s
        self._windows: dict[str, tuple[float, int]] = {}  # key -> (window end, failures in it)

    def retry_after(self, key: str, now: float) -> float | None:
        """Seconds until `key` may fail again; None when it may now."""
        window = self._windows.get(key)
        if window is None or window[0] <= now or window[1] < self._limit:
            return None
        return window[0] - now

    def failed(self, key: str, now: float) -> None:
        window = self._windows.get(key)
        if window is None or window[0] <= now:
            if len(self._windows) >= MAX_CLIENTS:  # bounded: forget finished windows, else everyone
                self._windows = {c: w for c, w in self._windows.items() if w[0] > now}
                if len(self._windows) >= MAX_CLIENTS:
                    self._windows.clear()
            self._windows[key] = (now + self._window_s, 1)
        else:
            self._windows[key] = (window[0], window[1] + 1)


class FailureThrottle:
    def __init__(self, *, limit: int, per_key_limit: int, window_s: float) -> None:
        self._by_address = FailureWindows(limit=limit, window_s=window_s)
        self._by_key = FailureWindows(limit=per_key_limit, window_s=window_s)
        self._known: set[str] = set()  # prefixes that authenticated here: names, not secrets

    def retry_after(self, client: str, prefix: str, now: float) -> float | None:
        """Seconds until `client` may cause lookups for `prefix` again; None when it may now."""
        waits = [self._by_key.retry_after(f"{client} {prefix}", now)]
        if prefix not in self._known:
            waits.append(self._by_address.retry_after(client, now))
        return max((w for w in waits if w is not None), default=None)

    def failed(self, client: str, prefix: str, now: float) -> None:
        self._by_key.failed(f"{client} {prefix}", now)
        self._by_address.failed(client, now)

    def succeeded(self, prefix: str) -> None:
        if len(self._known) >= MAX_KNOWN:  # bounded; a forgotten prefix is only throttled per address again
            self._known.clear()
        self._known.add(prefix)
