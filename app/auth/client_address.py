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


def client_of(request: Request) -> str | None:
    """client_address with the header this listener trusts (app.state.client_ip_header, set by create_app:
    none on the admin listener, which is reached directly, so a caller there cannot name its address)."""
    header: str = request.app.state.client_ip_header
    return client_address(request, header)
