"""RegisteredDigest: what the registry recorded of a version at upload, the reference for every copy.

A manifest travels with the files it describes, in the store and in a node's cache: whoever can change
the files there can change their manifest to match. The registry (billing's database) is written only by
the ingress that validated the upload, so a node checks each version's manifest against it before it
trusts the manifest with checking the files.
"""

from dataclasses import dataclass
from typing import Protocol

from adapters.ref import AdapterRef


@dataclass(frozen=True, slots=True)
class RegisteredDigest:
    weights_sha256: str  # of adapter_model.safetensors
    size_bytes: int  # adapter_config.json and adapter_model.safetensors together


class DigestSource(Protocol):
    """The registry's digests (billing/adapter_digests.py)."""

    def registered(self, ref: AdapterRef) -> RegisteredDigest | None:
        """What was recorded for `ref`; None if the registry has no such version. Raises
        AdapterStoreUnavailable if it cannot be asked."""
        ...
