"""client_address: who is calling, for per-client throttles: the peer, or what a trusted proxy says."""

from starlette.requests import Request


def client_address(request: Request, header: str) -> str | None:
    """The last entry of `header` (the one the proxy in front of us appended) when configured and sent,
    else the connection's peer address. Earlier entries are the client's own claims: never trusted."""
    if header:
        value = request.headers.get(header, "")
        last = value.rsplit(",", 1)[-1].strip()
        if last:
            return last
    return request.client.host if request.client else None
