"""Where an admin request came from, as the credit ledger records it beside the caller's own `actor`: the
CLI names itself in its User-Agent; anything else is the admin API. Both hold the admin key, so this says
which tool wrote an entry, not who may: the request id ties it to the access log."""

from typing import Literal

Surface = Literal["admin_api", "cli"]  # billing.models.SURFACES
CLI_USER_AGENT = "loraplex-cli"


def surface_of(user_agent: str) -> Surface:
    return "cli" if user_agent.split("/", 1)[0] == CLI_USER_AGENT else "admin_api"
