"""Adapter domain errors. app/errors.py alone turns them into HTTP responses."""

from collections.abc import Sequence


class AdapterError(Exception):
    """Base class for adapter errors."""


class AdapterNotFound(AdapterError):
    def __init__(self, name: str) -> None:
        super().__init__(f"adapter {name!r} does not exist")
        self.name = name


class AdapterInvalid(AdapterError):
    """An adapter cannot be served. Every problem found is listed, not just the first."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class UnsupportedAdapter(AdapterInvalid):
    """A well-formed adapter that uses an option this platform does not serve (DoRA, embeddings, ...)."""


class AdapterLoadFailed(AdapterError):
    """An adapter passed its checks but could not be read into memory (corrupt or vanished files)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"adapter {name} could not be loaded: {reason}")
        self.name = name


class AdapterRankTooLarge(AdapterInvalid):
    def __init__(self, rank: int, max_rank: int) -> None:
        super().__init__([f"adapter rank {rank} exceeds max_lora_rank {max_rank}"])
        self.rank = rank
        self.max_rank = max_rank
