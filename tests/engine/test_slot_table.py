"""SlotTable: adapter slots (runs of pages), their users, LRU eviction, draining, pinning and removal."""

import random

import pytest

from adapters.ref import AdapterRef
from deployments.engine.adapter_tiers.slot_table import SlotTable

A, B, C, D = (AdapterRef(name, 1) for name in "abcd")


def check_invariants(table: SlotTable) -> None:
    refs = [r for r in table._ref if r is not None]
    assert len(refs) == len(set(refs)), "a ref sits in two slots"
    assert table.resident() == {r: s for s, r in enumerate(table._ref) if r is not None}
    free = {page for page in range(table.num_slots) if table._owner[page] < 0}
    assert table.free_pages == len(free)
    for slot in range(table.num_slots):
        users = table.users(slot)
        assert users >= 0, f"slot {slot} has {users} users"
        if slot in free:
            assert table._ref[slot] is None
            assert users == 0
            assert slot not in table._idle
            assert slot not in table._draining
        else:
            assert table._ref[slot] is not None, f"slot {slot} is neither free nor occupied"
            assert (slot in table._idle) == (users == 0), f"slot {slot}: idle vs {users} users"
        if slot in table._draining:
            assert users > 0, f"draining slot {slot} has no user left to release it: it would never free"
    assert table.num_free == len(free) + sum(1 for s in table._idle if table._ref[s] not in table.pinned)


def check_runs(table: SlotTable) -> None:
    """Every page is free or covered by exactly the run of one resident adapter."""
    covered: dict[int, int] = {}
    for ref, slot in table.resident().items():
        width = table.pages_at(slot)
        assert width >= 1, f"{ref} at {slot} has no pages"
        for page in range(slot, slot + width):
            assert page not in covered, f"page {page} is in the runs of slots {covered[page]} and {slot}"
            covered[page] = slot
    free = [page for page in range(table.num_slots) if table._owner[page] < 0]
    assert free == sorted(set(range(table.num_slots)) - set(covered)), "free pages"
    assert [table._owner[p] for p in range(table.num_slots)] == [
        covered.get(p, -1) for p in range(table.num_slots)
    ]
    idle_pages = sum(table.pages_at(s) for s in table._idle if table._ref[s] not in table.pinned)
    assert table.num_free == len(free) + idle_pages


def loaded(table: SlotTable, ref: AdapterRef, users: int = 0, pages: int = 1) -> int:
    """Claim a slot for `ref` and give it `users` users."""
    slot = table.claim(ref, pages=pages)
    assert slot is not None
    for _ in range(users):
        table.acquire(slot)
    return slot


# -- claim --------------------------------------------------------------------------------------------


def test_claim_evicts_the_idle_adapter_with_the_lowest_score_first() -> None:
    table = SlotTable(2)
    a, b = loaded(table, A), loaded(table, B)  # both idle, A least recently used
    demand = {A: 3, B: 0, C: 0}
    assert table.claim(C, score=lambda ref: demand[ref]) == b  # A has queued requests: B goes
    assert table.resident() == {A: a, C: b}
    demand[C] = 1
    assert table.claim(D, score=lambda ref: demand[ref]) == b  # C wanted less than A
    check_invariants(table)


def test_start_draining_takes_only_busy_unpinned_slots() -> None:
    table = SlotTable(3)
    a, b = loaded(table, A, users=1), loaded(table, B, users=2)
    loaded(table, C)  # idle
    table.pinned.add(A)
    assert table.drainable() == [b]
    table.start_draining(b)
    assert table.num_draining == 1 and table.drainable() == []
    assert table.lookup(B) is None  # takes no new sequences
    table.release(b)
    table.release(b)
    assert not table.holds(B) and table.num_draining == 0  # freed with its last user
    assert table.users(a) == 1
    check_invariants(table)


def test_claim_takes_free_slots_first() -> None:
    table = SlotTable(3)
    assert table.num_free == 3
    assert [table.claim(r) for r in (A, B, C)] == [0, 1, 2]
    assert table.resident() == {A: 0, B: 1, C: 2}
    assert (table.loads, table.evictions) == (3, 0)
    assert table.num_free == 3  # loaded but unused: each could still be evicted for a newcomer
    assert [table.lookup(r) for r in (A, B, C)] == [0, 1, 2]
    check_invariants(table)


def test_claim_evicts_the_least_recently_used_idle_slot() -> None:
    table = SlotTable(3)
    slots = {ref: loaded(table, ref, users=1) for ref in (A, B, C)}
    for ref in (B, C, A):  # released in this order: B is the least recently used
        table.release(slots[ref])
    slot = table.claim(D)
    assert slot == slots[B]
    assert not table.holds(B)
    assert table.lookup(B) is None
    assert table.lookup(D) == slot
    assert (table.loads, table.evictions) == (4, 1)
    check_invariants(table)
    table.acquire(slots[C])  # use C again: A is now the oldest idle slot
    table.release(slots[C])
    assert table.claim(B) == slots[A]
    check_invariants(table)


def test_a_fresh_claim_counts_as_recently_used() -> None:
    table = SlotTable(2)
    a = loaded(table, A, users=1)
    table.release(a)
    b = loaded(table, B)  # claimed, not yet acquired: newer than A
    assert table.claim(C) == a
    assert table.holds(B)
    assert table.lookup(B) == b


def test_claim_never_evicts_a_slot_in_use() -> None:
    table = SlotTable(2)
    a = loaded(table, A, users=1)  # claimed first, so oldest, but busy
    b = loaded(table, B, users=1)
    table.release(b)
    assert table.claim(C) == b
    assert table.holds(A)
    assert table.users(a) == 1
    table.acquire(b)
    assert table.claim(D) is None  # both busy now
    assert table.users(a) == 1
    check_invariants(table)


def test_claim_returns_none_when_every_slot_is_busy() -> None:
    table = SlotTable(2)
    loaded(table, A, users=1)
    loaded(table, B, users=2)
    assert table.num_free == 0
    assert table.claim(C) is None
    assert (table.loads, table.evictions) == (2, 0)
    assert table.resident() == {A: 0, B: 1}
    check_invariants(table)


def test_claim_returns_none_when_idle_slots_are_all_pinned() -> None:
    table = SlotTable(2)
    table.pinned.add(A)
    loaded(table, A)  # pinned and idle
    loaded(table, B, users=1)
    assert table.num_free == 0
    assert table.claim(C) is None
    assert table.holds(A)
    check_invariants(table)


def test_pinned_idle_slots_are_skipped_for_newer_unpinned_ones() -> None:
    table = SlotTable(3)
    table.pinned.add(A)
    a = loaded(table, A)  # the oldest idle slot, but pinned
    b = loaded(table, B)
    loaded(table, C)
    assert table.num_free == 2
    assert table.claim(D) == b
    assert table.lookup(A) == a
    table.pinned.discard(A)  # unpinned: it becomes an ordinary LRU candidate again
    assert table.claim(B) == a
    check_invariants(table)


def test_claiming_a_resident_ref_is_a_programming_error() -> None:
    table = SlotTable(2)
    loaded(table, A)
    with pytest.raises(AssertionError, match="already resident"):
        table.claim(A)


# -- acquire / release --------------------------------------------------------------------------------


def test_acquire_and_release_count_users() -> None:
    table = SlotTable(2)
    slot = loaded(table, A)
    assert table.users(slot) == 0
    assert table.num_free == 2
    table.acquire(slot)
    table.acquire(slot)
    assert table.users(slot) == 2
    assert table.num_free == 1
    table.release(slot)
    assert table.users(slot) == 1
    assert table.num_free == 1
    table.release(slot)
    assert table.users(slot) == 0
    assert table.num_free == 2
    assert table.lookup(A) == slot  # stays resident when idle
    check_invariants(table)


# -- draining -----------------------------------------------------------------------------------------


def test_drain_one_marks_the_busy_unpinned_slot_with_the_fewest_users() -> None:
    table = SlotTable(3)
    a = loaded(table, A, users=3)
    b = loaded(table, B, users=1)
    c = loaded(table, C, users=2)
    assert table.claim(D) is None
    assert table.drain_one()
    assert table.lookup(B) is None  # takes no new sequences ...
    assert table.holds(B)  # ... but is still resident, so nobody loads it twice
    assert table.users(b) == 1
    assert (table.lookup(A), table.lookup(C)) == (a, c)
    assert table.drain_one()  # one already drains: nothing more is marked
    assert (table.lookup(A), table.lookup(C)) == (a, c)
    assert table.num_free == 0
    check_invariants(table)
    table.release(b)  # its last user: the slot frees
    assert not table.holds(B)
    assert table.num_free == 1
    assert table.evictions == 1
    assert table.claim(D) == b
    check_invariants(table)


def test_a_draining_slot_frees_only_at_its_last_release() -> None:
    table = SlotTable(2)
    a = loaded(table, A, users=2)
    loaded(table, B, users=3)
    assert table.drain_one()
    assert table.lookup(A) is None
    table.release(a)
    assert table.holds(A)
    assert table.lookup(A) is None
    assert table.evictions == 0
    table.release(a)
    assert not table.holds(A)
    assert table.evictions == 1
    check_invariants(table)
    assert not table._draining
    assert table.drain_one()  # with nothing draining, the next call marks a slot again
    assert table.lookup(B) is None


def test_drain_one_never_picks_a_pinned_slot() -> None:
    table = SlotTable(3)
    table.pinned.add(A)
    loaded(table, A, users=1)  # fewest users, but pinned
    b = loaded(table, B, users=2)
    c = loaded(table, C, users=3)
    assert table.drain_one()
    assert table.lookup(A) is not None
    assert table.lookup(B) is None
    assert table.lookup(C) == c
    table.release(b)
    table.release(b)
    assert table.claim(D) == b
    check_invariants(table)


def test_drain_one_fails_when_every_resident_slot_is_pinned() -> None:
    table = SlotTable(2)
    table.pinned.update({A, B})
    loaded(table, A, users=1)
    loaded(table, B, users=1)
    assert not table.drain_one()
    assert table.lookup(A) is not None
    assert table.lookup(B) is not None
    assert not SlotTable(2).drain_one()  # nothing resident at all


def test_drain_one_prefers_a_busy_slot_over_an_idle_one() -> None:
    table = SlotTable(3)
    a = loaded(table, A, users=2)
    b = loaded(table, B, users=1)
    c = loaded(table, C)  # idle: evictable by claim, nothing to drain
    assert table.drain_one()
    assert table.lookup(C) == c
    assert table.lookup(B) is None
    assert table.lookup(A) == a
    table.release(b)
    assert not table.holds(B)


# -- runs of pages ------------------------------------------------------------------------------------


def test_a_wide_adapter_takes_the_narrowest_free_run_that_fits() -> None:
    table = SlotTable(8)
    a, b, c = loaded(table, A, users=1), loaded(table, B, users=1, pages=3), loaded(table, C, users=1)
    assert (a, b, c) == (0, 1, 4)
    table.release(b)
    table.remove("b")  # pages 1-3 free again; 5-7 free too
    d = loaded(table, D, pages=2)
    assert d == 1  # both free runs fit; the first of the narrowest
    assert table.pages_at(d) == 2 and table.pages_at(a) == 1
    check_runs(table)


def test_a_wide_claim_evicts_the_cheapest_window_of_idle_adapters() -> None:
    table = SlotTable(6)
    narrow = [loaded(table, AdapterRef(f"n{i}", 1)) for i in range(4)]  # pages 0-3, idle
    busy = loaded(table, B, users=1, pages=2)  # pages 4-5
    assert narrow == [0, 1, 2, 3] and busy == 4
    demand = {AdapterRef(f"n{i}", 1): d for i, d in enumerate([5, 0, 0, 5])}
    wide = table.claim(C, score=lambda ref: demand.get(ref, 0), pages=2)
    assert wide == 1  # n1 and n2, nobody queued for them; not n0 or n3, nor the busy run
    assert set(table.resident()) == {AdapterRef("n0", 1), AdapterRef("n3", 1), B, C}
    assert table.evictions == 2
    check_runs(table)
    assert wide is not None
    table.acquire(wide)
    assert table.claim(D, pages=3) is None  # every 3-page window holds a page of C's or B's busy runs
    table.pinned.add(AdapterRef("n0", 1))
    assert table.claim(D, pages=2) is None  # n0 pinned, n3 between C and B: no 2-page window
    assert table.claim(D, pages=1) == 3  # n3 (idle, unpinned) goes
    check_runs(table)


def test_free_pages_between_busy_runs_are_no_run_for_a_wide_adapter() -> None:
    table = SlotTable(5)
    runs = [loaded(table, AdapterRef(f"n{i}", 1), users=1) for i in range(5)]
    for slot in (runs[1], runs[3]):  # pages 1 and 3 free, between busy ones: 2 pages free, no run of 2
        table.release(slot)
        table.remove(table._ref_at(slot).adapter_id)
    assert table.num_free == 2
    assert table.can_claim(1) and not table.can_claim(2)
    assert table.claim(A, pages=2) is None
    table.release(runs[2])  # idle now: a window of pages 1-3 opens by evicting it
    assert table.can_claim(3) and not table.can_claim(3, keep=lambda s: s == runs[2])
    assert table.claim(A, pages=3) == 1
    check_runs(table)


def test_the_busy_window_for_a_wide_adapter_drains_every_run_in_it_at_once() -> None:
    table = SlotTable(6)
    a, b = loaded(table, A, users=1), loaded(table, B, users=2)  # pages 0 and 1
    c = loaded(table, C, users=1, pages=2)  # pages 2-3
    pinned = loaded(table, D)  # page 4, idle and pinned; page 5 free
    table.pinned.add(D)
    assert (a, b, c, pinned) == (0, 1, 2, 4)
    demand = {a: 0, b: 0, c: 3}
    cost = lambda s: (demand[s], table.users(s))  # noqa: E731
    busy = {a, b, c}
    # Two pages: A with B (nobody queued for either) beats C's run (3 queued) and B with C.
    assert table.busy_window(2, busy, cost) == [a, b]
    demand[c] = 0
    assert table.busy_window(2, busy, cost) == [c]  # now C alone: one run, one user
    # Four pages: only pages 0-3 qualify (page 4 is pinned): every run in them, at once.
    assert table.busy_window(4, busy, cost) == [a, b, c]
    assert table.busy_window(4, {a, c}, cost) is None  # B may not be drained: no window
    assert table.busy_window(5, busy, cost) is None  # every 5-page window holds the pinned page
    table.pinned.clear()
    assert table.busy_window(6, busy, cost) == [a, b, c]  # the idle run and the free page come along
    assert table.busy_window(6, busy, cost, keep=lambda s: s == pinned) is None  # unless it is kept
    assert table.busy_window(1, set(), cost) is None  # nothing busy may go


def test_a_drained_run_frees_all_its_pages() -> None:
    table = SlotTable(4)
    a = loaded(table, A, users=1, pages=3)
    table.start_draining(a)
    assert table.draining_pages == 3
    assert table.claim(B, pages=2) is None
    table.release(a)
    assert table.claim(B, pages=2) == 0
    check_runs(table)


# -- remove -------------------------------------------------------------------------------------------


def test_remove_frees_idle_slots_at_once_and_busy_ones_at_their_last_release() -> None:
    table = SlotTable(4)
    a1 = loaded(table, AdapterRef("a", 1))  # idle
    a2 = loaded(table, AdapterRef("a", 2), users=2)  # busy
    b = loaded(table, B, users=1)
    a3 = loaded(table, AdapterRef("a", 3))  # idle
    removed = table.remove("a")
    assert sorted(removed) == [AdapterRef("a", 1), AdapterRef("a", 2), AdapterRef("a", 3)]
    assert not table.holds(AdapterRef("a", 1))
    assert not table.holds(AdapterRef("a", 3))
    assert table.holds(AdapterRef("a", 2))  # its sequences finish on the version they hold
    assert table.lookup(AdapterRef("a", 2)) is None  # but no new one joins
    assert table.users(a2) == 2
    assert table.lookup(B) == b
    assert table.num_free == 2
    assert [p for p in range(table.num_slots) if table._owner[p] < 0] == sorted([a1, a3])
    check_invariants(table)
    table.release(a2)
    assert table.holds(AdapterRef("a", 2))
    table.release(a2)
    assert not table.holds(AdapterRef("a", 2))
    assert table.resident() == {B: b}
    assert table.num_free == 3
    check_invariants(table)


def test_remove_unknown_adapter_is_a_noop() -> None:
    table = SlotTable(2)
    loaded(table, A, users=1)
    assert table.remove("nope") == []
    assert table.remove("a1") == []  # no prefix matching on ids
    assert table.resident() == {A: 0}


def test_remove_drops_pins() -> None:
    table = SlotTable(2)
    pinned = AdapterRef("a", 1)
    table.pinned.update({pinned, B})
    loaded(table, pinned)
    assert table.remove("a") == [pinned]
    assert table.pinned == {B}
    assert not table.holds(pinned)
    assert table.num_free == 2
    check_invariants(table)


def test_remove_of_a_busy_pinned_ref_drains_it() -> None:
    table = SlotTable(2)
    table.pinned.add(A)
    a = loaded(table, A, users=1)
    table.remove("a")
    assert A not in table.pinned
    assert table.lookup(A) is None
    table.release(a)
    assert not table.holds(A)
    check_invariants(table)


def test_remove_drops_pins_of_versions_that_are_not_resident() -> None:
    table = SlotTable(2)
    table.pinned.add(AdapterRef("a", 1))  # pinned, its weights still loading: no slot yet
    table.remove("a")
    assert table.pinned == set()


# -- randomized invariants ----------------------------------------------------------------------------

REFS = [AdapterRef(name, version) for name in ("a", "b", "c", "d", "e") for version in (1, 2)]


@pytest.mark.parametrize(("seed", "widest"), [(0, 1), (1, 1), (2, 1), (3, 1), (4, 3), (5, 3), (6, 4)])
def test_random_operations_keep_the_table_consistent(seed: int, widest: int) -> None:
    """Drives the table the way AdapterManager does: lookup+acquire, else claim, else drain_one; adapters
    one to `widest` pages wide."""
    rng = random.Random(seed)
    table = SlotTable(4 * widest)
    width = {ref: rng.randint(1, widest) for ref in REFS}
    held: list[tuple[AdapterRef, int]] = []  # one entry per user we hold
    claims = drains = 0
    for _ in range(400):
        op = rng.choice(["use", "use", "use", "release", "release", "pin", "unpin", "remove"])
        if op == "use":
            ref = rng.choice(REFS)
            resident_pinned = {r: s for r, s in table.resident().items() if r in table.pinned}
            slot = table.lookup(ref)
            if slot is None and not table.holds(ref):
                slot = table.claim(ref, pages=width[ref])
                if slot is None:
                    before = set(table._draining)
                    drains += table.drain_one()
                    for s in table._draining - before:
                        assert table._ref[s] not in table.pinned
                        assert table.users(s) > 0
                else:
                    claims += 1
            if slot is not None:
                table.acquire(slot)
                held.append((ref, slot))
                assert table.resident()[ref] == slot
            for r, s in resident_pinned.items():  # pinned refs are never evicted
                assert table.resident().get(r) == s
        elif op == "release" and held:
            ref, slot = held.pop(rng.randrange(len(held)))
            assert table.resident().get(ref) == slot  # a slot with users is never taken away
            table.release(slot)
        elif op == "pin" and len(table.pinned) < table.num_slots - 1:
            table.pinned.add(rng.choice(REFS))
        elif op == "unpin" and table.pinned:
            table.pinned.discard(rng.choice(sorted(table.pinned)))
        elif op == "remove":
            adapter_id = rng.choice("abcde")
            table.remove(adapter_id)
            assert all(r.adapter_id != adapter_id for r in table.pinned if table.holds(r))
            for ref in table.resident():
                if ref.adapter_id == adapter_id:
                    assert table.lookup(ref) is None
        for slot in range(table.num_slots):
            assert table.users(slot) == sum(1 for _, s in held if s == slot)
        check_runs(table)
        if widest == 1:
            check_invariants(table)
        kept = set(rng.sample(range(table.num_slots), 2))
        for keep in (None, kept.__contains__):  # can_claim's scan finds a run exactly when the ranking does
            for pages in range(1, table.num_slots + 2):
                found = (
                    table._free_run(pages) is not None
                    or table._evictable_window(pages, None, keep) is not None
                )
                assert table.can_claim(pages, keep) == found
    while held:
        table.release(held.pop()[1])
        check_runs(table)
    assert all(table.users(s) == 0 for s in range(table.num_slots))
    assert not table._draining
    assert claims > 10
    assert drains > 0
    assert table.loads == claims
    assert table.evictions > 0
