"""SlotTable: which adapter version sits in which device slot, who is using it, and what may be evicted.

Slots in use by running sequences are never overwritten. When every slot is in use and other adapters are
waiting, slots are marked draining: a draining slot takes no new sequences, and once its last sequence
finishes it goes to a waiter. That bounds a cold adapter's wait (no starvation when active adapters
outnumber slots) without evicting anything mid-request. Which slot to evict or drain is the caller's
choice (`claim`'s and `drain`'s `score`: the adapter manager ranks by queued demand). Pinned adapters are
never evicted or drained.
"""

import time
from collections import OrderedDict
from collections.abc import Callable

from adapters.ref import AdapterRef


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._ref: list[AdapterRef | None] = [None] * num_slots
        self._users = [0] * num_slots
        self.claimed_at = [0.0] * num_slots  # time.monotonic() of each slot's latest load
        self._slot_of: dict[AdapterRef, int] = {}
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # occupied, unused slots; least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
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
    ) -> int | None:
        """A slot to load `ref` into (free, or an idle one evicted), or None if all are busy. The idle victim
        has the lowest `score` of its adapter (least recently used among equals); idle slots for which
        `keep(slot)` holds are not evicted. The caller writes the weights, then acquires."""
        assert ref not in self._slot_of, f"{ref} is already resident"
        if self._free:
            slot = self._free.pop()
        else:
            idle = [  # least recently used first
                s for s in self._idle if self._ref[s] not in self.pinned and (keep is None or not keep(s))
            ]
            if not idle:
                return None
            victim = idle[0] if score is None else min(idle, key=lambda s: score(self._ref_at(s)))
            self._evict(victim)
            slot = self._free.pop()
        self._ref[slot] = ref
        self._slot_of[ref] = slot
        self._idle[slot] = None
        self.claimed_at[slot] = time.monotonic()
        self.loads += 1
        return slot

    def discard(self, slot: int) -> None:
        """Free a slot just claimed whose adapter could not be written into it (it has no users yet)."""
        assert self._users[slot] == 0, f"slot {slot} is in use"
        self._evict(slot)

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
        """Slots a new adapter could take now without waiting."""
        return len(self._free) + sum(1 for s in self._idle if self._ref[s] not in self.pinned)

    def _evict(self, slot: int) -> None:
        ref = self._ref[slot]
        if ref is not None:
            del self._slot_of[ref]
            self.evictions += 1
        self._ref[slot] = None
        self._idle.pop(slot, None)
        self._draining.discard(slot)
        self._removed.discard(slot)
        self._free.append(slot)
