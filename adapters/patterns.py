"""ModulePatterns: PEFT's rules for matching module paths, run in time linear in the path.

PEFT matches target_modules, exclude_modules, rank_pattern/alpha_pattern keys and layers_pattern as Python
`re` regexes. Those backtrack: `(.+)+z` against a 30-character module path runs for minutes while holding
the GIL, so one uploaded config could freeze the whole ingress. The same rules run here on RE2
(google-re2), which has no backtracking. Patterns RE2 cannot run (backreferences, lookarounds), overlong
patterns and too many pattern keys are refused as invalid instead. Module paths are ASCII without newlines,
where RE2's `$`, `\\d` and `.` mean what Python's do.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import re2

MAX_PATTERN_CHARS = 256  # real patterns are module names or short alternations
MAX_PATTERN_KEYS = 512  # one rank_pattern key per module of a 70B Llama (80 layers x 7) still fits
_MAX_PROGRAM_MEMORY = 1 << 20  # RE2's budget per regex, its lazily built DFA included
# Instructions of one compiled pattern: bounds the work per character matched and the memory cached.
# A plain 256-character name compiles to about 260; `[a-z]{1000}` alone to 1000.
_MAX_PROGRAM_SIZE = 4096
_SHOWN_CHARS = 120
_DEFAULT_LAYER = r".*?\.[^.]*\.(?P<idx>\d+)\."  # PEFT's layer index rule without layers_pattern


class PatternError(ValueError):
    """A pattern that cannot be matched safely; the message says why."""


@lru_cache(maxsize=2048)  # above 2 x MAX_PATTERN_KEYS: a full rank_pattern and alpha_pattern never thrash
def _compile(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False  # refusals are reported to the uploader, not logged by RE2 on stderr
    options.max_mem = _MAX_PROGRAM_MEMORY
    try:
        regex = re2.compile(pattern, options)
    except re2.error as exc:
        detail = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        detail = str(detail)[:_SHOWN_CHARS]  # RE2 quotes the whole pattern: keep the refusal short
        raise PatternError(  # from None: RE2's own traceback adds nothing to the uploader's message
            f"cannot be matched safely (RE2 syntax only, no lookarounds/backreferences): {detail}"
        ) from None
    if regex.programsize > _MAX_PROGRAM_SIZE:
        raise PatternError(
            f"is too complex: {regex.programsize} RE2 instructions, at most {_MAX_PROGRAM_SIZE}"
        )
    return regex


def _key_regex(key: str) -> str:
    return rf"(.*\.)?({key})$"  # peft.utils.other.get_pattern_key, matched from the start


def _layer_regex(layers_pattern: str) -> str:
    return rf"(?:^|.*?\.){layers_pattern}\.(?P<idx>\d+)\."  # PEFT's check_target_module_exists


def check_pattern(pattern: str, *, as_key: bool = False, as_layers: bool = False) -> None:
    """Raise PatternError unless `pattern` can be matched safely in the form PEFT uses it."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"is longer than {MAX_PATTERN_CHARS} characters")
    _compile(pattern)
    if as_key:
        _compile(_key_regex(pattern))
    if as_layers:
        _compile(_layer_regex(pattern))


def check_keys(keys: Sequence[str]) -> None:
    if len(keys) > MAX_PATTERN_KEYS:
        raise PatternError(f"has {len(keys)} keys, more than {MAX_PATTERN_KEYS}")


def fullmatch(pattern: str, module_path: str) -> bool:
    return _compile(pattern).fullmatch(module_path) is not None


# Asked per module by validation and again by weight folding. An entry holds a tuple of references to the
# spec's own key strings: at most 4096 x MAX_PATTERN_KEYS pointers.
@lru_cache(maxsize=4096)
def pattern_key(keys: tuple[str, ...], module_path: str) -> str | None:
    """The first key whose pattern matches the path's tail (PEFT's get_pattern_key); None if none does."""
    return next((key for key in keys if _compile(_key_regex(key)).match(module_path) is not None), None)


@dataclass(frozen=True)
class TargetRule:
    """The LoraConfig fields that decide whether PEFT puts the adapter on a module."""

    target_modules: frozenset[str] | str
    exclude_modules: frozenset[str] | str | None = None
    layers_to_transform: Sequence[int] | None = None
    layers_pattern: Sequence[str] | None = None

    def targets(self, module_path: str) -> bool:
        """peft.tuners.tuners_utils.check_target_module_exists, for configs without modules_to_save."""
        if self._excluded(module_path):
            return False
        if isinstance(self.target_modules, str):
            return fullmatch(self.target_modules, module_path)
        if not _named(self.target_modules, module_path):
            return False
        if module_path in self.target_modules or not self.layers_to_transform:
            return True  # PEFT applies the layer filter only to suffix matches
        index = self._layer_index(module_path)
        return index is not None and index in self.layers_to_transform

    def _excluded(self, module_path: str) -> bool:
        if not self.exclude_modules:
            return False
        if isinstance(self.exclude_modules, str):
            return fullmatch(self.exclude_modules, module_path)
        return _named(self.exclude_modules, module_path)

    def _layer_index(self, module_path: str) -> int | None:
        patterns = [_layer_regex(p) for p in self.layers_pattern] if self.layers_pattern else [_DEFAULT_LAYER]
        for pattern in patterns:
            match = _compile(pattern).match(module_path)
            if match is not None:
                return int(match.group("idx"))
        return None


def _named(names: frozenset[str], module_path: str) -> bool:
    return module_path in names or any(module_path.endswith(f".{name}") for name in names)


def pattern_value(patterns: Mapping[str, Any], module_path: str, default: Any) -> Any:
    key = pattern_key(tuple(patterns), module_path) if patterns else None
    return default if key is None else patterns[key]
