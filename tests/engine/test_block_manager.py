"""BlockManager: block allocation, the chained prefix cache and its scoping, eviction (LRU within a scope,
the scope holding the most first), ref counts."""

import random
from collections import Counter
from itertools import count

import pytest

from adapters.ref import AdapterRef
from deployments.engine.block_manager import BlockManager
from deployments.engine.sampling_params import SamplingParams
from deployments.engine.sequence import Sequence

BS = 4  # block size used throughout
_ids = count()


def make_seq(
    prompt: list[int] | range, adapter: AdapterRef | None = None, cache_salt: str | None = None
) -> Sequence:
    return Sequence(
        request_id=f"r{next(_ids)}",
        prompt_ids=list(prompt),
        params=SamplingParams(),
        adapter=adapter,
        max_tokens=16,
        cache_salt=cache_salt,
    )


def check_invariants(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Every block is in exactly one state and every counter agrees with the block tables."""
    free = list(bm._free)
    free_set = set(free)
    evictable = {block for blocks in bm._evictable.values() for block in blocks}
    for scope, blocks in bm._evictable.items():
        assert blocks, f"scope {scope!r} has an empty evictable list"
        assert all(bm._scope[block] == scope for block in blocks), f"a block of scope {scope!r} is misfiled"
    assert len(free_set) == len(free), "a block is twice on the free list"
    refs: Counter[int] = Counter()
    for seq in seqs:
        assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} holds a block twice"
        refs.update(seq.block_table)
    for block in range(bm.num_blocks):
        states = (block in free_set, block in evictable, bm._ref_count[block] > 0)
        assert sum(states) == 1, f"block {block}: free/evictable/referenced = {states}"
        assert bm._ref_count[block] == refs[block], f"block {block}: ref count vs block tables"
        if block in free_set:
            assert bm._key[block] is None, f"free block {block} still carries a cache key"
        if block in evictable:
            assert bm._key[block] is not None, f"evictable block {block} has no cache key"
        key = bm._key[block]
        if key is not None:
            assert bm._cached.get(key) == block, f"block {block}: key not registered to it"
    for key, block in bm._cached.items():
        assert bm._key[block] == key
    assert bm.num_free_blocks == len(free) + len(evictable) == sum(1 for r in bm._ref_count if r == 0)
    assert bm.usage == pytest.approx(1.0 - bm.num_free_blocks / bm.num_blocks)
    assert 0.0 <= bm.usage <= 1.0


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the model computed tokens up to `upto` (default: all of them), then commit."""
    seq.num_computed = len(seq.token_ids) if upto is None else upto
    assert seq.num_computed <= len(seq.block_table) * bm.block_size
    bm.commit(seq)


def run_to_completion(bm: BlockManager, seq: Sequence) -> int:
    """Admit (prefix match + allocate) and compute the whole prompt; returns the reused token count."""
    reused = bm.match_prefix(seq)
    assert bm.allocate(seq, len(seq.token_ids))
    compute(bm, seq)
    return reused


# -- allocation ---------------------------------------------------------------------------------------


def test_blocks_needed_rounds_up_and_counts_what_is_already_held() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(10))
    assert bm.blocks_needed(seq, 0) == 0
    assert bm.blocks_needed(seq, 1) == 1
    assert bm.blocks_needed(seq, 4) == 1
    assert bm.blocks_needed(seq, 5) == 2
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3
    assert bm.blocks_needed(seq, 12) == 0
    assert bm.blocks_needed(seq, 5) == 0  # never negative
    assert bm.blocks_needed(seq, 13) == 1
    assert bm.allocate(seq, 13)
    assert len(seq.block_table) == 4
    check_invariants(bm, [seq])


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a, b = make_seq(range(10)), make_seq(range(100, 110))
    assert bm.allocate(a, 10)
    assert bm.num_free_blocks == 1
    assert not bm.allocate(b, 10)  # needs 3, only 1 free: takes none
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    assert bm.allocate(b, 4)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(b, 5)
    assert len(b.block_table) == 1
    assert bm.usage == 1.0
    check_invariants(bm, [a, b])


def test_allocation_of_zero_new_blocks_succeeds_even_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    seq = make_seq(range(8))
    assert bm.allocate(seq, 8)
    assert bm.num_free_blocks == 0
    assert bm.allocate(seq, 8)
    assert bm.allocate(seq, 3)
    assert len(seq.block_table) == 2


def test_free_returns_every_block_and_resets_the_sequence() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    seq = make_seq(range(10))
    run_to_completion(bm, seq)
    assert bm.num_free_blocks == 3
    bm.free(seq)
    assert (seq.block_table, seq.block_hashes, seq.num_computed) == ([], [], 0)
    assert bm.num_free_blocks == 6
    assert bm.usage == 0.0
    check_invariants(bm, [])


# -- prefix matching ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "expected"),
    [
        (1, 0),
        (4, 0),  # one full block, but the last token must be computed: nothing reused
        (5, 4),
        (8, 4),  # exact multiple: one block less than the prompt holds
        (9, 8),
        (10, 8),
        (12, 8),
        (13, 12),
    ],
)
def test_match_prefix_reuses_full_blocks_and_leaves_a_token_to_compute(
    prompt_len: int, expected: int
) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(range(prompt_len))
    assert run_to_completion(bm, first) == 0
    second = make_seq(range(prompt_len))
    reused = bm.match_prefix(second)
    assert reused == expected
    assert second.num_computed == expected
    assert second.num_uncomputed >= 1
    assert second.block_table == first.block_table[: expected // BS]
    assert len(second.block_hashes) == expected // BS
    check_invariants(bm, [first, second])


def test_match_prefix_returns_reused_tokens_and_allocate_adds_only_the_rest() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(range(10))
    run_to_completion(bm, first)
    second = make_seq([*range(10), 50, 51, 52, 53, 54])  # 15 tokens, shares 10
    assert bm.match_prefix(second) == 8
    assert bm.blocks_needed(second, len(second.token_ids)) == 2
    free_before = bm.num_free_blocks
    assert bm.allocate(second, len(second.token_ids))
    assert bm.num_free_blocks == free_before - 2
    assert second.block_table[:2] == first.block_table[:2]
    assert not set(second.block_table[2:]) & set(first.block_table)
    check_invariants(bm, [first, second])


def test_only_committed_full_blocks_are_hit() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(range(12))
    bm.match_prefix(first)
    assert bm.allocate(first, 12)
    # Nothing computed yet: nothing to hit.
    assert bm.match_prefix(make_seq(range(12))) == 0
    compute(bm, first, upto=6)  # one full block computed, the second only half
    probe = make_seq(range(12))
    assert bm.match_prefix(probe) == 4
    bm.free(probe)
    compute(bm, first, upto=12)
    probe = make_seq(range(13))
    assert bm.match_prefix(probe) == 12
    check_invariants(bm, [first, probe])


def test_uncommitted_computation_is_not_visible() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(range(9))
    bm.match_prefix(first)
    assert bm.allocate(first, 9)
    first.num_computed = 9  # computed but not committed
    assert bm.match_prefix(make_seq(range(9))) == 0


def test_commit_is_incremental_across_decode_steps() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = make_seq(range(6))
    run_to_completion(bm, seq)
    assert len(seq.block_hashes) == 1
    for token in (6, 7, 8):  # decode three tokens; the second block fills at token 7
        seq.token_ids.append(token)
        assert bm.allocate(seq, len(seq.token_ids))
        compute(bm, seq)
    assert len(seq.block_hashes) == 2
    probe = make_seq(range(9))  # the prompt plus generated tokens of the first sequence
    assert bm.match_prefix(probe) == 8
    assert probe.block_table == seq.block_table[:2]
    check_invariants(bm, [seq, probe])


def test_commit_and_match_are_noops_without_prefix_caching() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    first = make_seq(range(9))
    assert run_to_completion(bm, first) == 0
    assert first.block_hashes == []
    second = make_seq(range(9))
    assert bm.match_prefix(second) == 0
    assert second.block_table == []
    bm.free(first)
    assert bm.num_free_blocks == 8
    assert len(bm._evictable) == 0  # never cached, so straight back to the free list
    check_invariants(bm, [second])


def test_match_prefix_does_nothing_for_a_sequence_that_already_holds_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    run_to_completion(bm, make_seq(range(9)))
    seq = make_seq(range(9))
    assert bm.allocate(seq, 1)
    assert bm.match_prefix(seq) == 0
    assert len(seq.block_table) == 1


def test_hit_and_query_counters() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_to_completion(bm, make_seq(range(12)))
    assert (bm.prefix_hits, bm.prefix_queries) == (0, 1)  # the first block missed: lookup stops there
    bm.match_prefix(make_seq([*range(8), 99, 99, 99, 99, 99]))
    assert (bm.prefix_hits, bm.prefix_queries) == (2, 4)  # hit, hit, miss


A1 = AdapterRef("a", 1)


@pytest.mark.parametrize(
    ("scope", "other"),
    [
        ((A1, None), (AdapterRef("b", 1), None)),  # another adapter
        ((A1, None), (AdapterRef("a", 2), None)),  # another version of the same adapter
        ((A1, None), (AdapterRef("a", 11), None)),  # a version whose digits extend the first
        ((None, None), (A1, None)),  # base model vs adapter
        ((A1, None), (None, None)),  # adapter vs base model
        ((None, "tenant-1"), (None, "tenant-2")),  # another salt
        ((None, "tenant-1"), (None, None)),  # salted vs unsalted
        ((A1, "tenant-1"), (A1, "tenant-2")),
        ((A1, "tenant-1"), (None, "tenant-1")),
        ((None, ""), (None, None)),  # empty salt vs no salt
    ],
)
def test_no_hit_across_adapters_versions_or_salts(scope, other) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(range(13), *scope)
    run_to_completion(bm, first)
    assert bm.match_prefix(make_seq(range(13), *other)) == 0
    same = make_seq(range(13), *scope)
    assert bm.match_prefix(same) == 12  # the control: the same scope does hit
    assert same.block_table == first.block_table[:3]


def test_no_hit_between_no_salt_and_the_string_none() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_to_completion(bm, make_seq(range(9), None, None))
    assert bm.match_prefix(make_seq(range(9), None, "None")) == 0


@pytest.mark.parametrize(
    ("diverge_at", "expected"),
    [(0, 0), (3, 0), (4, 4), (6, 4), (8, 8), (11, 8), (12, 12)],
)
def test_partial_prefix_hits_up_to_the_first_differing_block(diverge_at: int, expected: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    first = make_seq(range(16))
    run_to_completion(bm, first)
    tokens = list(range(16))
    tokens[diverge_at] = 1000
    probe = make_seq(tokens)
    assert bm.match_prefix(probe) == expected
    assert probe.block_table == first.block_table[: expected // BS]
    check_invariants(bm, [first, probe])


def test_keys_are_chained_so_equal_blocks_under_another_parent_do_not_hit() -> None:
    p, q, r, s_, q2 = ([t] * BS for t in (1, 2, 3, 4, 5))
    bm = BlockManager(num_blocks=16, block_size=BS)
    run_to_completion(bm, make_seq(p + q + r + [9]))  # registers P, PQ, PQR
    run_to_completion(bm, make_seq(s_ + q2 + [9]))  # registers S, SQ2
    # Block-by-block, Q2 and R are both cached, but not after P -> Q2: only P may hit.
    probe = make_seq(p + q2 + r + [9])
    assert bm.match_prefix(probe) == 4


# -- caching of freed blocks and eviction -------------------------------------------------------------


def test_freed_cached_blocks_stay_reusable() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(range(10))
    run_to_completion(bm, first)
    table = list(first.block_table)
    bm.free(first)
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    check_invariants(bm, [])
    second = make_seq(range(10))
    assert bm.match_prefix(second) == 8
    assert second.block_table == table[:2]
    assert bm.num_free_blocks == 6
    check_invariants(bm, [second])


def test_fresh_blocks_are_used_before_cached_ones_are_evicted() -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    first = make_seq(range(9))
    run_to_completion(bm, first)
    bm.free(first)
    other = make_seq(range(100, 112))  # 3 blocks: exactly the never-cached ones
    assert bm.allocate(other, 12)
    assert not set(other.block_table) & set(bm._evictable)
    assert bm.match_prefix(make_seq(range(9))) == 8


def test_tail_blocks_are_evicted_before_head_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    first = make_seq(range(13))  # 4 blocks, 3 full and cached
    run_to_completion(bm, first)
    head, middle, tail, partial = first.block_table
    bm.free(first)
    assert bm.num_free_blocks == 4
    filler = make_seq(range(100, 108))
    assert bm.allocate(filler, 8)  # the uncached partial block, then the tail block is evicted
    assert set(filler.block_table) == {partial, tail}
    probe = make_seq(range(13))
    assert bm.match_prefix(probe) == 8  # head and middle survived
    assert probe.block_table == [head, middle]
    bm.free(probe)
    assert bm.allocate(filler, 12)  # one more: the middle block goes before the head
    assert filler.block_table[-1] == middle
    probe = make_seq(range(13))
    assert bm.match_prefix(probe) == 4
    assert probe.block_table == [head]
    check_invariants(bm, [filler, probe])


def test_least_recently_freed_sequence_is_evicted_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a, b, c = make_seq(range(5)), make_seq(range(10, 15)), make_seq(range(20, 25))
    for seq in (a, b, c):
        assert bm.match_prefix(seq) == 0
        assert bm.allocate(seq, 4)  # one block each, computed: 4 of the 5 tokens
        compute(bm, seq, upto=4)
    a_block, b_block, c_block = a.block_table[0], b.block_table[0], c.block_table[0]
    bm.free(b)
    bm.free(a)
    bm.free(c)  # freed b, a, c: evicted in that order
    assert bm.num_free_blocks == 3
    x = make_seq(range(100, 105))
    assert bm.allocate(x, 4)
    assert x.block_table == [b_block]
    assert bm.match_prefix(make_seq(range(10, 15))) == 0
    assert bm.allocate(x, 8)
    assert x.block_table == [b_block, a_block]
    probe = make_seq(range(20, 25))
    assert bm.match_prefix(probe) == 4
    assert probe.block_table == [c_block]
    check_invariants(bm, [x, probe])


def test_a_hit_refreshes_a_cached_block() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    a, b = make_seq(range(5)), make_seq(range(10, 15))
    for seq in (a, b):
        bm.match_prefix(seq)
        assert bm.allocate(seq, 4)
        compute(bm, seq, upto=4)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    again = make_seq(range(5))
    assert bm.match_prefix(again) == 4  # a's block taken out of the LRU ...
    bm.free(again)  # ... and put back as the most recent
    x = make_seq(range(100, 105))
    assert bm.allocate(x, 4)
    assert x.block_table == [b_block]
    assert bm.match_prefix(make_seq(range(5))) == 4
    assert a_block not in x.block_table


def test_eviction_removes_the_cache_entry() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    first = make_seq(range(5))
    bm.match_prefix(first)
    assert bm.allocate(first, 4)
    compute(bm, first, upto=4)
    cached_block = first.block_table[0]
    bm.free(first)
    other = make_seq(range(100, 109))
    assert bm.allocate(other, 8)  # needs both blocks: the cached one is evicted and reused
    assert cached_block in other.block_table
    assert bm._key[cached_block] is None
    # The block now belongs to other tokens (not yet computed): the old prefix must miss, not alias it.
    probe = make_seq(range(5))
    assert bm.match_prefix(probe) == 0
    assert probe.block_table == []
    compute(bm, other, upto=8)  # and once the block holds the new tokens, they are what hits
    bm.free(other)
    assert bm.match_prefix(make_seq(range(5))) == 0
    hit = make_seq(range(100, 109))
    assert bm.match_prefix(hit) == 8
    check_invariants(bm, [hit])


# -- sharing and ref counts ---------------------------------------------------------------------------


def test_shared_block_is_freed_only_when_both_sequences_free_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    first = make_seq(range(10))
    run_to_completion(bm, first)  # blocks f0, f1, f2
    second = make_seq(range(10))
    assert run_to_completion(bm, second) == 8  # shares f0, f1; its own third block
    shared = first.block_table[:2]
    assert [bm._ref_count[b] for b in shared] == [2, 2]
    assert bm.num_free_blocks == 4
    check_invariants(bm, [first, second])
    bm.free(first)
    assert bm.num_free_blocks == 5  # only first's own third block
    assert [bm._ref_count[b] for b in shared] == [1, 1]
    assert not set(shared) & (set(bm._free) | set(bm._evictable))
    # The shared blocks cannot be handed out while second still uses them.
    filler = make_seq(range(100, 120))
    assert bm.allocate(filler, 20)
    assert not set(filler.block_table) & set(second.block_table)
    assert bm.num_free_blocks == 0
    assert not bm.allocate(make_seq(range(4)), 1)
    check_invariants(bm, [second, filler])
    bm.free(second)
    bm.free(filler)
    assert bm.num_free_blocks == 8
    check_invariants(bm, [])


def test_twins_computed_in_the_same_step_both_commit_and_free_cleanly() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(10)), make_seq(range(10))
    for seq in (a, b):  # both admitted before either committed: no hit, separate blocks
        assert bm.match_prefix(seq) == 0
        assert bm.allocate(seq, 10)
    assert not set(a.block_table) & set(b.block_table)
    a.num_computed = b.num_computed = 10
    bm.commit(a)
    bm.commit(b)  # same keys: must not crash nor steal a's registration
    assert a.block_hashes == b.block_hashes
    assert len(a.block_hashes) == 2
    check_invariants(bm, [a, b])
    probe = make_seq(range(10))
    assert bm.match_prefix(probe) == 8
    assert probe.block_table == a.block_table[:2]  # the first to commit is the one registered
    bm.free(probe)
    bm.free(b)
    check_invariants(bm, [a])
    bm.free(a)
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    check_invariants(bm, [])
    probe = make_seq(range(10))
    assert bm.match_prefix(probe) == 8  # still cached after everyone freed


@pytest.mark.parametrize("a_first", [True, False])
def test_twins_free_in_either_order(a_first: bool) -> None:
    bm = BlockManager(num_blocks=6, block_size=BS)
    a, b = make_seq(range(9)), make_seq(range(9))
    for seq in (a, b):
        bm.match_prefix(seq)
        assert bm.allocate(seq, 9)
    for seq in (a, b):
        seq.num_computed = 9
        bm.commit(seq)
    for seq in (a, b) if a_first else (b, a):
        bm.free(seq)
        check_invariants(bm, [s for s in (a, b) if s.block_table])
    assert bm.num_free_blocks == 6
    # Twin b's duplicate blocks were never registered, so they went back to the free list.
    assert bm._num_evictable == 2
    assert len(bm._free) == 4


# -- randomized invariants ----------------------------------------------------------------------------

SCOPES = [(None, None), (AdapterRef("a", 1), None), (AdapterRef("a", 2), None), (None, "t1"), (A1, "t2")]
STEMS = [list(range(0, 12)), list(range(50, 62)), [7] * 12]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_books_consistent(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=20, block_size=BS)
    seqs: list[Sequence] = []
    # What each physical block was last computed to hold: (scope, all tokens up to its end).
    contents: dict[int, tuple[object, tuple[int, ...]]] = {}

    def scope(seq: Sequence) -> object:
        return (seq.adapter, seq.cache_salt)

    def record(seq: Sequence, start: int, end: int) -> None:
        for i in range(start // BS, end // BS):
            contents[seq.block_table[i]] = (scope(seq), tuple(seq.token_ids[: (i + 1) * BS]))

    for _ in range(300):
        op = rng.choice(["add", "add", "admit", "admit", "compute", "compute", "decode", "free"])
        admitted = [s for s in seqs if s.block_table]
        waiting = [s for s in seqs if not s.block_table]
        if op == "add" or not seqs:
            stem = rng.choice(STEMS)[: rng.randint(0, 12)]
            tail = [rng.randrange(100, 104) for _ in range(rng.randint(1, 8))]
            seqs.append(make_seq(stem + tail, *rng.choice(SCOPES)))
        elif op == "admit" and waiting:
            seq = rng.choice(waiting)
            reused = bm.match_prefix(seq)
            assert reused == seq.num_computed == len(seq.block_table) * BS
            assert reused < len(seq.token_ids)
            for i, block in enumerate(seq.block_table):  # a hit is exactly what was computed there
                assert contents[block] == (scope(seq), tuple(seq.token_ids[: (i + 1) * BS]))
            if not bm.allocate(seq, len(seq.token_ids)):
                bm.free(seq)  # out of blocks: give back the hit, as the scheduler does
                assert seq.block_table == []
        elif op == "compute" and admitted:
            seq = rng.choice(admitted)
            room = min(len(seq.token_ids), len(seq.block_table) * BS)
            if seq.num_computed < room:
                upto = rng.randint(seq.num_computed + 1, room)
                record(seq, seq.num_computed, upto)
                compute(bm, seq, upto)
        elif op == "decode" and admitted:
            seq = rng.choice(admitted)
            if seq.num_computed == len(seq.token_ids) and bm.allocate(seq, len(seq.token_ids) + 1):
                seq.token_ids.append(rng.randrange(100, 104))
                record(seq, seq.num_computed, len(seq.token_ids))
                compute(bm, seq)
        elif op == "free" and seqs:
            seq = rng.choice(seqs)
            bm.free(seq)
            seqs.remove(seq)
        check_invariants(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.prefix_hits > 0  # the workload did exercise the cache


def test_a_scope_flooding_the_cache_evicts_its_own_blocks_before_another_scopes() -> None:
    # quiet caches a 3-block prefix and goes idle; flood then streams distinct prompts through the whole
    # cache. Plain LRU would evict quiet's blocks first (the oldest); the fair order takes flood's own.
    bm = BlockManager(num_blocks=12, block_size=BS)
    quiet = make_seq(range(100, 113), cache_salt="quiet")  # 3 full blocks + 1 token
    bm.allocate(quiet, len(quiet.token_ids))
    compute(bm, quiet)
    bm.free(quiet)
    for i in range(10):
        flood = make_seq(range(1000 + 40 * i, 1013 + 40 * i), cache_salt="flood")
        bm.match_prefix(flood)
        assert bm.allocate(flood, len(flood.token_ids))
        compute(bm, flood)
        bm.free(flood)
        check_invariants(bm, [])
    again = make_seq(range(100, 113), cache_salt="quiet")
    assert bm.match_prefix(again) == 3 * BS  # every block of its prefix survived the flood


def test_under_pressure_every_scope_keeps_an_equal_share() -> None:
    bm = BlockManager(num_blocks=12, block_size=BS)
    for i, scope in enumerate(("a", "b", "c")):  # 3 cached blocks each (and a partial one, freed)
        seq = make_seq(range(100 * i, 100 * i + 13), cache_salt=scope)
        bm.allocate(seq, len(seq.token_ids))
        compute(bm, seq)
        bm.free(seq)
    assert {s: len(b) for s, b in bm._evictable.items()} == {"a": 3, "b": 3, "c": 3}
    taker = make_seq(range(2000, 2024), cache_salt="d")  # 6 blocks: the 3 free, then 1 from each scope
    assert bm.allocate(taker, len(taker.token_ids))
    assert {s: len(b) for s, b in bm._evictable.items()} == {"a": 2, "b": 2, "c": 2}
    check_invariants(bm, [taker])
