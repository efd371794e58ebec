"""The Redis limiter's Lua scripts (app/limits/lua/*.lua), read from the package's data files once.

Each script sent to Redis is the shared prelude, then its own body, with the bounds Python and Lua must
agree on filled in: MAX_LIMIT_VALUE, MAX_TOKENS_VALUE and the error prefix the backend recognises.
"""

from functools import cache
from pathlib import Path

from app.limits.protocol import MAX_TOKENS

MAX_LIMIT = 10**15  # a limit above this is no limit that could bind; sent clamped, as Lua integers stay exact
INVALID = "loraplex invalid argument"  # the scripts' error replies for arguments they refuse


def _read(name: str) -> str:
    return (Path(__file__).with_name("lua") / f"{name}.lua").read_text(encoding="utf-8")


@cache
def lua_script(name: str) -> str:
    """Script `name` (admit, release, renew, deliver, leave_queue, peek): the prelude, then its body, with the
    bounds filled in."""
    script = _read("prelude") + _read(name)
    for placeholder, value in (("MAX_LIMIT_VALUE", MAX_LIMIT), ("MAX_TOKENS_VALUE", MAX_TOKENS)):
        script = script.replace(placeholder, str(value))
    return script.replace("INVALID_ARGUMENT_PREFIX", INVALID)
