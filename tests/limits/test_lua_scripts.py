"""The Redis limiter's Lua scripts: files of the package (shipped by a non-editable install too), each
read once and sent as the prelude plus its body with every bound filled in. What they do against a real
Redis is tests/limits/test_backends.py's."""

import fnmatch
import tomllib
from pathlib import Path

import pytest

from app.limits import lua_scripts
from app.limits.lua_scripts import INVALID, MAX_LIMIT, lua_script
from app.limits.protocol import MAX_TOKENS

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "app" / "limits" / "lua"
SCRIPTS = ("admit", "release", "renew", "deliver", "leave_queue", "peek")


def test_every_script_file_is_package_data() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = data["app.limits"]
    files = sorted(p.relative_to(LUA.parent).as_posix() for p in LUA.glob("*"))
    assert files and all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files), (files, globs)
    assert {p.stem for p in LUA.glob("*.lua")} == {"prelude", *SCRIPTS}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_is_the_prelude_then_its_body_with_the_bounds_filled_in(name: str) -> None:
    script = lua_script(name)
    values = {
        "MAX_LIMIT_VALUE": str(MAX_LIMIT),
        "MAX_TOKENS_VALUE": str(MAX_TOKENS),
        "INVALID_ARGUMENT_PREFIX": INVALID,
    }
    raw = ((LUA / "prelude.lua").read_text() + (LUA / f"{name}.lua").read_text()).splitlines()
    sent = script.splitlines()
    assert len(sent) == len(raw)
    for before, after in zip(raw, sent, strict=True):
        for placeholder, value in values.items():
            before = before.replace(placeholder, value)
        assert after == before
    assert INVALID in script  # the prelude's error replies, which RedisLimiter recognises


def test_each_script_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lua_script.cache_clear()
    reads: list[str] = []
    real = lua_scripts._read

    def counted(name: str) -> str:
        reads.append(name)
        return real(name)

    monkeypatch.setattr(lua_scripts, "_read", counted)
    first = lua_script("renew")
    assert lua_script("renew") is first
    assert reads == ["prelude", "renew"]
