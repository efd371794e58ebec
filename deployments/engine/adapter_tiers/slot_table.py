"""SlotTable: which adapter version sits in which device slot, who is using it, and what may be evicted.

Slots in use by running sequences are never overwritten. When every slot is in use and other adapters are
waiting, slots are marked draining: a draining slot takes no new sequences, and once its last sequence
finishes it goes to a waiter. That bounds a cold adapter's wait (no starvation when active adapters
outnumber slots) without evicting anything mid-request. Which slot to evict or drain is the caller's
choice (`claim`'s and `drain`'s `score`: the adapter manager ranks by queued demand). Pinned adapters are
never evicted or drained.

Device adapter memory is `num_slots` pages (lora_layers.py): an adapter takes a run of consecutive pages
as wide as its rank needs, and its slot is the run's first page. A claim takes the narrowest free run
that fits; failing that, the window of pages whose idle occupants are cheapest to evict (lowest score,
then least recently used, then fewest pages to clear). Runs instead of scattered pages keep the kernels
reading one page per segment and round; the price is fragmentation, which evicting a window resolves.
"""

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from adapters.ref import AdapterRef


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots  # pages: an adapter's slot is the first page of its run
        self._ref: list[AdapterRef | None] = [None] * num_slots
        self._pages = [0] * num_slots  # run length at each occupied slot
        self._owner = [-1] * num_slots  # the slot whose run covers each page; -1: free
        self._users = [0] * num_slots
        self.claimed_at = [0.0] * num_slots  # time.monotonic() of each slot's latest load
        self._slot_of: dict[AdapterRef, int] = {}
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # occupied, unused slots; least recently used first
        self._draining: set[int] = set()
        self._removed: set[int] = set()  # draining because their adapter was deleted: never taken back
        self.pinned: set[AdapterRef] = set()
        self.loads = 0
        self.evictions = 0

    def lookup(self, ref: AdapterRef) -> int | None:
        """The slot holding `ref`, if it may take new sequences."""
        slot = self._slot_of.get(ref)
        return None if slot is None or slot in self._draining else slot

    def holds(self, ref: AdapterRef) -> bool:
        return ref in self._slot_of

    def acquire(self, slot: int) -> None:
        if self._users[slot] == 0:
            self._idle.pop(slot, None)
        self._users[slot] += 1

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        if self._users[slot] == 0:
            if slot in self._draining:
                self._evict(slot)
            else:
                self._idle[slot] = None

    def claim(
        self,
        ref: AdapterRef,
        score: Callable[[AdapterRef], int] | None = None,
        keep: Callable[[int], bool] | None = None,
        pages: int = 1,
    ) -> int | None:
        """The first page of a run of `pages` to load `ref` into (free, or idle ones evicted), or None if no
        such run can be had now. Idle victims have the lowest `score` of their adapter (least recently used
        among equals); idle slots for which `keep(slot)` holds are not evicted. The caller writes the
        weights, then acquires."""
        assert ref not in self._slot_of, f"{ref} is already resident"
        slot = self._free_run(pages)
        if slot is None:
            slot = self._evictable_window(pages, score, keep)
            if slot is None:
                return None
            for victim in sorted({self._owner[p] for p in range(slot, slot + pages)} - {-1}):
                self._evict(victim)
        for page in range(slot, slot + pages):
            self._owner[page] = slot
        self._ref[slot] = ref
        self._pages[slot] = pages
        self._slot_of[ref] = slot
        self._idle[slot] = None
        self.claimed_at[slot] = time.monotonic()
        self.loads += 1
        return slot

    def can_claim(self, pages: int, keep: Callable[[int], bool] | None = None) -> bool:
        """Whether a claim of `pages` would find a run now (free pages, or idle ones not kept): `pages`
        consecutive pages, each free or held by an idle, unpinned, unkept adapter. The plan asks at every
        step, so this is a scan, not `_evictable_window`'s ranking of every window."""
        if pages > self.num_slots:
            return False
        open_slots = {s for s in self._idle if self._evictable(s, keep)}
        run = 0
        for owner in self._owner:
            run = run + 1 if owner < 0 or owner in open_slots else 0
            if run >= pages:
                return True
        return pages <= 0

    def _evictable(self, idle_slot: int, keep: Callable[[int], bool] | None) -> bool:
        """Whether an idle slot's adapter may be evicted for a claim: not pinned, not kept by the caller."""
        return self._ref_at(idle_slot) not in self.pinned and not (keep is not None and keep(idle_slot))

    def _free_run(self, pages: int) -> int | None:
        """The start of the narrowest run of free pages at least `pages` long (the lowest such start)."""
        best: tuple[int, int] | None = None  # (run length, start)
        start = -1
        for page in range(self.num_slots + 1):
            free = page < self.num_slots and self._owner[page] < 0
            if free and start < 0:
                start = page
            elif not free and start >= 0:
                if page - start >= pages and (best is None or page - start < best[0]):
                    best = (page - start, start)
                start = -1
        return None if best is None else best[1]

    def _evictable_window(
        self, pages: int, score: Callable[[AdapterRef], int] | None, keep: Callable[[int], bool] | None
    ) -> int | None:
        """The start of the `pages`-long window whose pages are all free or held by idle, unpinned, unkept
        adapters, evicting the cheapest: lowest worst score, then the least recently used, then the fewest
        occupied pages."""
        if pages > self.num_slots:
            return None
        blocked = np.ones(self.num_slots, dtype=np.int64)
        worst = np.zeros(self.num_slots, dtype=np.int64)  # the occupant's score
        recency = np.full(self.num_slots, -1, dtype=np.int64)  # the occupant's place in LRU order
        for order, slot in enumerate(self._idle):
            if not self._evictable(slot, keep):
                continue
            run, ref = slice(slot, slot + self._pages[slot]), self._ref_at(slot)
            blocked[run], worst[run], recency[run] = 0, 0 if score is None else score(ref), order
        occupied = np.array([owner >= 0 for owner in self._owner], dtype=np.int64)
        blocked[occupied == 0] = 0
        # Every window's largest blocked count, score and recency, and its occupied pages.
        views = [np.lib.stride_tricks.sliding_window_view(v, pages) for v in (blocked, worst, recency)]
        stuck, cost, recent = (v.max(axis=1) for v in views)
        filled = np.lib.stride_tricks.sliding_window_view(occupied, pages).sum(axis=1)
        starts = np.flatnonzero(stuck == 0)
        if starts.size == 0:
            return None
        order = np.lexsort((filled[starts], recent[starts], cost[starts]))
        return int(starts[order[0]])

    def busy_window(
        self,
        pages: int,
        busy: set[int],
        cost: Callable[[int], tuple[int, ...]],
        keep: Callable[[int], bool] | None = None,
    ) -> list[int] | None:
        """The busy slots to drain so that a run of `pages` frees: the cheapest window of `pages` pages whose
        every page is free, idle (unpinned, not kept) or held by one of `busy`, and which holds at least one
        of `busy`. A window's cost is its busy slots' `cost`s added element by element, then how many there
        are. None if no window qualifies."""
        usable = np.zeros(self.num_slots, dtype=bool)
        for page, owner in enumerate(self._owner):
            if owner < 0 or owner in busy:
                usable[page] = True
            elif owner in self._idle:
                usable[page] = self._evictable(owner, keep)
        best: tuple[tuple[int, ...], list[int]] | None = None
        for start in range(self.num_slots - pages + 1):
            if not usable[start : start + pages].all():
                continue
            victims = sorted({self._owner[p] for p in range(start, start + pages)} & busy)
            if not victims:
                continue
            costs = [cost(s) for s in victims]
            key = (*map(sum, zip(*costs, strict=True)), len(victims))
            if best is None or key < best[0]:
                best = (key, victims)
        return None if best is None else best[1]

    def discard(self, slot: int) -> None:
        """Free a slot just claimed whose adapter could not be written into it (it has no users yet)."""
        assert self._users[slot] == 0, f"slot {slot} is in use"
        self._evict(slot)

    def pages_at(self, slot: int) -> int:
        """Pages of the run that starts at `slot` (0 if none does)."""
        return self._pages[slot]

    def drainable(self) -> list[int]:
        """Busy, unpinned slots not draining yet."""
        return [
            s
            for s in range(self.num_slots)
            if self._users[s] > 0
            and self._ref[s] is not None
            and self._ref[s] not in self.pinned
            and s not in self._draining
        ]

    def draining(self) -> list[int]:
        return sorted(self._draining)

    def start_draining(self, slot: int) -> None:
        assert slot in self.drainable(), f"slot {slot} cannot drain"
        self._draining.add(slot)

    def stop_draining(self, slot: int) -> bool:
        """Take new users again (an interactive request wants the adapter it holds); False for a slot whose
        adapter was removed."""
        if slot in self._removed:
            return False
        self._draining.discard(slot)
        return True

    @property
    def free_pages(self) -> int:
        return self._owner.count(-1)

    @property
    def draining_pages(self) -> int:
        return sum(self._pages[s] for s in self._draining)

    def drain_one(self) -> bool:
        """Mark the busy, unpinned slot with the fewest users as draining (unless one already drains)."""
        if self._draining:
            return True
        candidates = self.drainable()
        if not candidates:
            return False
        self._draining.add(min(candidates, key=lambda s: self._users[s]))
        return True

    @property
    def num_draining(self) -> int:
        return len(self._draining)

    def ref_at(self, slot: int) -> AdapterRef | None:
        return self._ref[slot]

    def _ref_at(self, slot: int) -> AdapterRef:
        ref = self._ref[slot]
        assert ref is not None
        return ref

    def remove(self, adapter_id: str) -> list[AdapterRef]:
        """Forget every version of an adapter: idle slots free now, busy ones when their sequences end."""
        self.pinned = {ref for ref in self.pinned if ref.adapter_id != adapter_id}
        removed = [ref for ref in self._slot_of if ref.adapter_id == adapter_id]
        for ref in removed:
            slot = self._slot_of[ref]
            if self._users[slot] == 0:
                self._evict(slot)
            else:
                self._draining.add(slot)
                self._removed.add(slot)
        return removed

    def resident(self) -> dict[AdapterRef, int]:
        return dict(self._slot_of)

    def users(self, slot: int) -> int:
        return self._users[slot]

    def idle(self) -> list[int]:
        """Occupied, unused, unpinned slots: a new adapter may evict one."""
        return [s for s in self._idle if self._ref[s] not in self.pinned]

    @property
    def num_free(self) -> int:
        """Pages new adapters could take now without waiting: free, or held by idle unpinned ones."""
        idle = sum(self._pages[s] for s in self._idle if self._ref[s] not in self.pinned)
        return self.free_pages + idle

    def _evict(self, slot: int) -> None:
        ref = self._ref[slot]
        if ref is not None:
            del self._slot_of[ref]
            self.evictions += 1
        self._ref[slot] = None
        self._idle.pop(slot, None)
        self._draining.discard(slot)
        self._removed.discard(slot)
        for page in range(slot, slot + self._pages[slot]):
            self._owner[page] = -1
        self._pages[slot] = 0
