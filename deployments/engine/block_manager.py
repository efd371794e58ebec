"""BlockManager: paged KV-cache bookkeeping and the prefix cache.

Blocks hold `block_size` tokens of K/V. A sequence owns a block table (logical block i -> physical block).
Full, computed blocks are registered under a digest chained over (parent digest, adapter, cache salt,
tokens), so the same tokens under two adapters never share K/V, and tenants with different salts never see
each other's prefixes (not even through `cached_tokens`). The digest is cryptographic: a crafted collision
would otherwise hand one tenant another's K/V. Unreferenced cached blocks stay until reused or evicted.

Eviction is fair across cache scopes (the salt: the ingress passes the tenant id): a block is taken from
the scope that holds the most unreferenced cached blocks, its least recently freed first. So one tenant's
flood of new prompts evicts its own old prefixes before anyone else's; under pressure every scope keeps an
equal share of the evictable cache (max-min), and a scope below its share loses nothing.
"""

import hashlib
from array import array
from collections import OrderedDict

from deployments.engine.sequence import Sequence

BlockKey = bytes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_count = [0] * num_blocks
        self._key: list[BlockKey | None] = [None] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # stack; pops block 0 first
        # Cached, unreferenced blocks per scope (the chain's cache salt), oldest first; and how many in all.
        self._evictable: dict[str | None, OrderedDict[int, None]] = {}
        self._num_evictable = 0
        self._scope: list[str | None] = [None] * num_blocks  # the salt of a cached block's chain
        self._cached: dict[BlockKey, int] = {}
        self.prefix_hits = 0  # blocks served from the prefix cache, for stats
        self.prefix_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that `num_tokens` tokens of `seq` fit."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> int:
        """On first admission, attach cached blocks for the longest cached prefix. Returns tokens reused.

        At least one prompt token is always left to compute, so the step produces logits for it.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return 0
        full_blocks = (len(seq.token_ids) - 1) // self.block_size
        parent: BlockKey | None = None
        matched: list[int] = []
        for i in range(full_blocks):
            key = self._block_key(seq, i, parent)
            block = self._cached.get(key)
            self.prefix_queries += 1
            if block is None:
                break
            self._take(block)
            matched.append(block)
            seq.block_hashes.append(key)
            parent = key
        self.prefix_hits += len(matched)
        seq.block_table = matched
        seq.num_computed = len(matched) * self.block_size
        return seq.num_computed

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table so `num_tokens` tokens fit; all or nothing."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            seq.block_table.append(self._pop_free())
        return True

    def commit(self, seq: Sequence) -> None:
        """Register blocks that became full and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), full):
            key = self._block_key(seq, i, parent)
            block = seq.block_table[i]
            if key not in self._cached:  # a twin computed in the same step may have registered first
                self._cached[key] = block
                self._key[block] = key
                self._scope[block] = seq.cache_salt
            seq.block_hashes.append(key)
            parent = key

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Tail blocks become evictable first: prefixes are worth more."""
        for block in reversed(seq.block_table):
            self._ref_count[block] -= 1
            if self._ref_count[block] == 0:
                if self._key[block] is not None:
                    self._evictable.setdefault(self._scope[block], OrderedDict())[block] = None
                    self._num_evictable += 1
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0

    def _block_key(self, seq: Sequence, index: int, parent: BlockKey | None) -> BlockKey:
        start = index * self.block_size
        digest = hashlib.blake2b(digest_size=16)
        if parent is None:  # the root block carries what scopes the whole chain
            digest.update(repr((seq.adapter, seq.cache_salt)).encode())  # repr: None and "None" differ
        else:
            digest.update(parent)
        digest.update(array("q", seq.token_ids[start : start + self.block_size]).tobytes())
        return digest.digest()

    def _take(self, block: int) -> None:
        if self._ref_count[block] == 0:
            self._unevictable(block)
        self._ref_count[block] += 1

    def _unevictable(self, block: int) -> None:
        scope = self._scope[block]
        blocks = self._evictable.get(scope)
        if blocks is None or block not in blocks:
            return
        del blocks[block]
        self._num_evictable -= 1
        if not blocks:
            del self._evictable[scope]

    def _victim(self) -> int:
        """The block to evict: the oldest of the scope holding the most evictable blocks (ties: the scope
        that became evictable first). O(scopes with evictable blocks) per eviction."""
        scope = max(self._evictable, key=lambda s: len(self._evictable[s]))
        return next(iter(self._evictable[scope]))

    def _pop_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block = self._victim()
            self._unevictable(block)
            key = self._key[block]
            if key is not None and self._cached.get(key) == block:
                del self._cached[key]
            self._key[block] = None
            self._scope[block] = None
        self._ref_count[block] = 1
        return block
