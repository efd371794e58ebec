"""Adapter domain errors. app/errors.py alone turns them into HTTP responses."""

from collections.abc import Sequence
from typing import Any


def _rebuild(cls: type[BaseException], message: str, state: dict[str, Any]) -> BaseException:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class DomainError(Exception):
    """Base of the platform's named errors. They cross process boundaries (Ray Serve replicas pickle the
    exceptions they raise), and pickle rebuilds an exception by calling its class with `self.args`, which
    breaks for any custom __init__; this rebuilds it from its message and attributes instead."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class AdapterError(DomainError):
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


class AdapterStoreUnavailable(AdapterError):
    """The adapter store cannot be reached or refused the request (network, credentials, missing bucket).
    Uploads fail with it; versions already in a node's cache keep serving without the store."""

    def __init__(self, store: str, reason: str) -> None:
        super().__init__(f"adapter store {store} is unavailable: {reason}")
        self.store = store
        self.reason = reason


class AdapterStoreUnsafe(AdapterStoreUnavailable):
    """The store cannot take uploads safely: it does not refuse a second create of one object, so two
    writers could take one version number and overwrite each other's files. Uploads are refused until
    the operator points the platform at a store that does; reading is unaffected."""
