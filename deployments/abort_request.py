"""AbortRequest: the call that stops one request on the engine replica running it.

The adapter-aware router sends it to that replica alone (an abort anywhere else finds nothing to stop).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    replica: str  # the replica's Serve unique id, as its `accepted` output named it
