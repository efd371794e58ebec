"""AdapterRef: the key that names one immutable version of an adapter everywhere below the registry."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, order=True)
class AdapterRef:
    """One version of one adapter in the store. Versions are immutable, so a ref never changes meaning."""

    adapter_id: str
    version: int

    def __str__(self) -> str:
        return f"{self.adapter_id}@v{self.version}"
