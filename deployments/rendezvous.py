"""Rendezvous (highest random weight) hashing: each adapter's preferred order of engine replicas.

The router and every replica's registry watcher compute it alike, with no coordination: the router sends
an adapter to its home replica, and only that replica prefetches a newly uploaded version. When replicas
come and go, only the adapters whose home left move.
"""

import hashlib


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """`replica_ids` (Serve's unique replica ids) in the order `key` prefers them."""

    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(f"{key}|{replica_id}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)
