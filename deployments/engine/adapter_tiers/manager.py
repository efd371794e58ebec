"""AdapterManager: the engine's view of adapters across tiers (device slots <- CPU memory <- disk store).

The scheduler asks `acquire(ref)` for each waiting request: it answers with a device slot, or None while
the adapter is still loading or waiting for a slot (only that request waits; others keep running).

Before each admission pass the scheduler tells the manager what the queue holds (`plan`): the adapters next
in the scheduler's rotation (the order in which adapters without a slot get one), then the other queued
ones, start loading into CPU memory ahead of need (overlapping the store read with steps) and are kept
there; a slot to evict or drain is chosen by queued demand, so a popular adapter is not thrown out for a
cold one while others would do. Several slots may drain at once when several cold adapters wait, but a
slot whose adapter has requests queued drains only when no other slot is draining and only once it has
been resident `min_residency_s`, and an idle slot with requests queued is not evicted before that either:
that keeps the one-drain progress guarantee without thrashing hot adapters, and bounds how fast many
waiting adapters can trade slots. The batch class never takes a slot from interactive work: while the cold
adapters are wanted by batch sequences only, slots of adapters interactive sequences use (or used lately:
`plan`'s `interactive`) are neither drained nor evicted for them.

Nothing here that runs on the engine loop thread touches the store: `check` (a version's config, read once
and cached by AdapterSpecs) runs before a request is queued, on a thread of its own, and weights are read
by the CPU tier's loader threads. A store that is slow or down stalls only the requests that need it.
"""

import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from adapters.errors import (
    AdapterError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterNotFound,
    AdapterRankTooLarge,
)
from adapters.ref import AdapterRef
from adapters.spec import AdapterSpec, read_adapter_config
from adapters.store import AdapterStore
from adapters.weights import AdapterWeights, load_adapter_weights
from deployments.engine.adapter_tiers.cpu_cache import CpuAdapterCache
from deployments.engine.adapter_tiers.slot_table import SlotTable
from deployments.engine.adapter_tiers.spec_cache import AdapterSpecs
from deployments.engine.model.lora_layers import (
    MultiLoRALinear,
    load_adapter_into_slot,
    pages_for_rank,
    prepare_pages,
)

log = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        store: AdapterStore,
        lora_modules: dict[str, MultiLoRALinear],
        *,
        lora_pages: int,
        max_cpu_loras: int,
        max_rank: int,
        page_rank: int | None = None,
        dtype: torch.dtype,
        device: torch.device,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
        min_residency_s: float = 0.0,
        read_wait_s: float = 0.0,
    ) -> None:
        self.store = store
        self._modules = lora_modules
        self._targets = {path.rsplit(".", 1)[-1] for path in lora_modules}
        self.max_rank = max_rank
        self.page_rank = page_rank or max_rank  # rank units per page of device adapter memory
        self.min_residency_s = min_residency_s
        self.read_wait_s = read_wait_s
        self._dtype = dtype
        self._device = device
        self.specs = AdapterSpecs(self._read_spec)
        self.slots = SlotTable(lora_pages)
        self.cpu = CpuAdapterCache(
            self._load, capacity=max_cpu_loras, retry_s=retry_s, retry_max_s=retry_max_s
        )
        self.on_loaded: Callable[[], None] = lambda: None  # the engine loop's wake-up
        self.activation_seconds = 0.0  # time spent writing adapters into slots
        self.disk_loads: Counter[str] = Counter()  # ref -> store reads (a ref read twice was evicted between)
        self._demand: Counter[AdapterRef] = Counter()  # queued (not running) requests per adapter
        self._remaining: dict[int, int] = {}  # slot -> most tokens one of its users may still generate
        self._cold: set[AdapterRef] = set()  # queued adapters with no slot yet
        self._lookahead: frozenset[AdapterRef] | None = None  # what the CPU tier should hold next (plan)
        self._interactive: frozenset[AdapterRef] = frozenset()  # adapters interactive work uses (plan)
        self._interactive_queued: frozenset[AdapterRef] | None = None  # those it waits for (plan)
        self._interactive_now: frozenset[AdapterRef] | None = None  # those it runs or waits for (plan)
        self._fresh: dict[AdapterRef, Future[AdapterWeights]] = {}  # reads started since the last wait
        self.read_waits = 0  # reads waited for (wait_for_reads)

    def check(self, ref: AdapterRef) -> AdapterSpec:
        """Raise a named error if `ref` cannot be served here (missing, unreadable, rank too large,
        unsupported). Reads the store the first time: never call it on the engine loop thread."""
        spec = self.specs.read(ref)
        self.check_spec(spec)
        return spec

    def check_spec(self, spec: AdapterSpec) -> None:
        """Whether this engine can serve an adapter of this config (no I/O)."""
        if spec.max_rank > self.max_rank:
            raise AdapterRankTooLarge(spec.max_rank, self.max_rank)
        unknown = sorted(set(spec.target_modules) - self._targets)
        if unknown:
            raise AdapterInvalid([f"target modules {unknown} are not LoRA targets of this engine"])

    def _read_spec(self, ref: AdapterRef) -> AdapterSpec:
        """A version's config from the store (AdapterSpecs' reader: on its threads). The store's own
        answers pass through (not found, unavailable); a stored config that cannot be read is the stored
        files' fault (uploads validated it), while a config that reads but that this engine cannot serve
        is the adapter's (AdapterInvalid)."""
        if not self.store.exists(ref):
            raise AdapterNotFound(str(ref))
        try:
            config = read_adapter_config(self.store.config_dir(ref))
        except AdapterInvalid as error:  # missing, or not JSON: the stored version is damaged
            raise AdapterLoadFailed(str(ref), f"its stored config is unreadable: {error}") from None
        except AdapterError:
            raise
        except Exception as error:  # an OS error reading the files (permissions, a vanished mount)
            raise AdapterLoadFailed(str(ref), f"its stored config is unreadable: {error!r}") from error
        return AdapterSpec.from_config_dict(config)

    def acquire(self, ref: AdapterRef, *, batch: bool = False) -> int | None:
        """A device slot holding `ref` (its user count raised), or None if the caller must wait. For a
        batch-class caller (`batch`), a slot interactive work uses is not evicted."""
        slot = self.slots.lookup(ref)
        if slot is not None:
            self.slots.acquire(slot)
            return slot
        if self.slots.holds(ref):  # resident but draining: wait until it frees, never load it twice
            slot = self.slots.resident()[ref]
            # An interactive request keeps its adapter's slot from a drain for the batch class (every cold
            # adapter is the batch class's), or one the drain can move from to a slot only the batch class
            # uses: the drain stops, and the next plan drains another. Waiting instead meant waiting for
            # the slot's batch users at the class's capped rate and then a reload (250-400 ms beside a
            # batch). A drain for an interactive adapter with nowhere else to go stays: taking it back at
            # every arrival would starve the cold adapter.
            if batch or not (self._cold.isdisjoint(self._interactive) or self._batch_slot_besides(slot)):
                return None
            if not self.slots.stop_draining(slot):
                return None  # its adapter was removed: the request fails once its weights are gone
            self.slots.acquire(slot)
            return slot
        weights = self.cpu.get(ref)  # raises if the load failed
        if weights is None:
            if self._lookahead is None or ref in self._lookahead:
                self._prefetch(ref)  # beyond the planned lookahead a load would only evict a nearer need
            return None
        keep = self._keep_for(batch)
        pages = self._pages_of(weights)
        slot = self.slots.claim(ref, score=lambda held: self._demand[held], keep=keep, pages=pages)
        if slot is None:
            self._cold.add(ref)
            self._drain()
            return None
        start = time.perf_counter()
        try:
            load_adapter_into_slot(self._modules, slot, pages, weights)
        except Exception as error:  # the slot holds a half-written adapter: free it, fail this version
            self.slots.discard(slot)
            failed = AdapterLoadFailed(str(ref), f"writing it into a device slot failed: {error!r}")
            self.cpu.fail(ref, failed)
            raise failed from error
        self.activation_seconds += time.perf_counter() - start
        self.slots.acquire(slot)
        return slot

    def _batch_slot_besides(self, slot: int) -> bool:
        """Another busy slot, at least as wide, that no interactive request runs on or waits for now: a
        drain can move there (used by interactive work lately is no reason to keep a current request
        waiting; the drain's own choice, _drain, takes such slots first too)."""
        pages = self.slots.pages_at(slot)
        return any(
            s != slot and not self._interactive_uses_now(s) and self.slots.pages_at(s) >= pages
            for s in self.slots.drainable()
        )

    def _interactive_uses_now(self, slot: int) -> bool:
        now = self._interactive if self._interactive_now is None else self._interactive_now
        return self.slots.ref_at(slot) in now

    def _pages_of(self, weights: AdapterWeights) -> int:
        return pages_for_rank(
            max((w.a.shape[0] for w in weights.modules.values()), default=1), self.page_rank
        )

    def _keep_for(self, batch: bool) -> Callable[[int], bool]:
        """Idle slots a claim may not evict: for the batch class, settling ones and those interactive work
        wants; for interactive work, settling ones interactive requests wait for. An idle slot whose queue
        is batch lines held back by the class's share of a step kept interactive requests waiting for its
        minimum residency beside free rows (the bench's TTFT tail)."""
        if batch:
            return lambda s: self._settling(s) or self._for_interactive(s)
        wanted = self._interactive_queued
        if wanted is None:
            return self._settling
        return lambda s: self._settling(s) and self.slots.ref_at(s) in wanted

    def _settling(self, slot: int) -> bool:
        """Whether the slot's adapter has requests queued and was loaded less than min_residency_s ago: such
        a slot is neither evicted nor drained for another adapter yet. (Its running users are never cut
        short by a drain; a slot with nothing queued drains at once, as no one waits for it.)"""
        young = time.monotonic() - self.slots.claimed_at[slot] < self.min_residency_s
        return young and self._demand_of(slot) > 0

    def _for_interactive(self, slot: int) -> bool:
        return self.slots.ref_at(slot) in self._interactive

    def _interactive_rank(self, slot: int) -> tuple[bool, bool]:
        """A drain's order: slots interactive requests use now last, those they used lately before them."""
        return self._interactive_uses_now(slot), self._for_interactive(slot)

    def claimable(self) -> int:
        """Pages adapters without a slot could be loaded into now: free, or idle and not settling."""
        settling = sum(self.slots.pages_at(s) for s in self.slots.idle() if self._settling(s))
        return self.slots.num_free - settling

    def pages_for(self, ref: AdapterRef) -> int:
        """Pages `ref` takes on the device (those of max_lora_rank while its config is unread)."""
        spec = self.specs.cached(ref)
        return pages_for_rank(self.max_rank if spec is None else spec.max_rank, self.page_rank)

    def claimable_count(self, refs: list[AdapterRef]) -> int:
        """How many of `refs`, in order, fit in the claimable pages (fragmentation aside)."""
        left, count = self.claimable(), 0
        for ref in refs:
            left -= self.pages_for(ref)
            if left < 0:
                break
            count += 1
        return count

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    def raise_if_failed(self, ref: AdapterRef) -> None:
        """Raise the error of `ref`'s last load while its backoff lasts (no load is started)."""
        self.cpu.raise_if_failed(ref)

    def plan(
        self,
        queued: list[AdapterRef],
        remaining: dict[int, int],
        rotation: list[AdapterRef] | None = None,
        interactive: frozenset[AdapterRef] = frozenset(),
        interactive_queued: frozenset[AdapterRef] | None = None,
        interactive_now: frozenset[AdapterRef] | None = None,
    ) -> None:
        """Before an admission pass: `queued` are the adapters of waiting requests in queue order (repeats
        included), `remaining` the most tokens any running user of each slot may still generate, `rotation`
        the adapters without a usable slot in the order they get one (None: queue order), `interactive` the
        adapters interactive sequences run, wait for, or used lately (the others are the batch class's),
        `interactive_queued` those interactive sequences wait for (None: any queued request counts),
        `interactive_now` those they run or wait for (None: `interactive`)."""
        self._demand = Counter(queued)
        self._interactive = interactive
        self._interactive_queued = interactive_queued
        self._interactive_now = interactive_now
        self._remaining = remaining
        lookahead: list[AdapterRef] = []  # distinct, rotation then queue order: what the CPU tier holds next
        for ref in dict.fromkeys([*(rotation or []), *self._demand]):  # a Counter keeps first-seen order
            if len(lookahead) >= max(1, self.cpu.capacity // 2):
                break
            lookahead.append(ref)
        self._lookahead = frozenset(lookahead)
        self.cpu.want(self._lookahead)
        for ref in lookahead:
            if not self.slots.holds(ref) and self.cpu.needs_load(ref):
                self._prefetch(ref)
        # Start freeing slots for the queue's cold adapters now, not when they reach the batch: the users of
        # a draining slot are still decoding, so the wait overlaps with work.
        cold: list[AdapterRef] = []
        pages = 0
        for ref in lookahead:
            if self.slots.holds(ref):
                continue
            pages += self.pages_for(ref)
            if pages > self.slots.num_slots:
                break
            cold.append(ref)
        self._cold = set(cold)
        self._drain()

    def _drain(self) -> None:
        """Mark slots draining for the cold adapters that want one beyond the free slots (at most half the
        slots at once): slots no queued request wants and past their minimum residency, the one whose users
        finish soonest first; if none drains then, the least wanted slot past its minimum residency."""
        wanted = min(sum(map(self.pages_for, self._cold)) - self.claimable(), self.slots.num_slots // 2)
        # Cold adapters only the batch class wants never drain a slot interactive work uses.
        spared = self._for_interactive if self._cold.isdisjoint(self._interactive) else lambda s: False
        while self.slots.draining_pages < wanted:
            unwanted = [
                s
                for s in self.slots.drainable()
                if not self._demand_of(s) and not self._settling(s) and not spared(s)
            ]
            if not unwanted:
                break
            # Slots only the batch class uses first: their users are the ones preempted first anyway.
            self.slots.start_draining(
                min(unwanted, key=lambda s: (*self._interactive_rank(s), self._remaining.get(s, 0)))
            )
        busy = [s for s in self.slots.drainable() if not self._settling(s) and not spared(s)]
        narrowest = min(map(self.pages_for, self._cold), default=0)
        stuck = self._cold and not self.slots.can_claim(narrowest, keep=self._settling)
        if stuck and self.slots.num_draining == 0 and busy:
            # No cold adapter finds a run (every busy slot has queued requests, or the free pages lie between
            # busy runs): drain the least wanted anyway, so nobody starves (the head of the rotation gets it,
            # whether or not a row is free for it yet).
            self.slots.start_draining(
                min(
                    busy,
                    key=lambda s: (*self._interactive_rank(s), self._demand_of(s), self._remaining.get(s, 0)),
                )
            )

    def slots_to_free(
        self, ref: AdapterRef, *, min_age_s: float, among: set[int] | None = None, batch: bool = False
    ) -> list[int]:
        """For a request overdue for a slot: the busy slots whose users should give them up, marked draining
        so each frees with its last user. They are the cheapest window that frees a run as wide as `ref`
        needs (one slot for an adapter of one page; several narrow ones for a wide adapter, all at once,
        not one a step): least wanted, then fewest users and remaining tokens. Only slots loaded at least
        `min_age_s` ago qualify, so two adapters trade a slot no faster than that. Empty if `ref`'s weights
        are not in CPU memory yet (preempting would not help) or no window qualifies. `among`: only these
        slots may be chosen; for a batch-class request (`batch`), none interactive work uses."""
        weights = self.cpu.get(ref) if self.cpu.is_ready(ref) else None
        if weights is None:
            return []
        now = time.monotonic()
        candidates = {
            s
            for s in self.slots.drainable() + self.slots.draining()
            if now - self.slots.claimed_at[s] >= min_age_s
            and (among is None or s in among)
            and not (batch and self._for_interactive(s))
        }
        victims = (
            self.slots.busy_window(
                self._pages_of(weights),
                candidates,
                cost=lambda s: (self._demand_of(s), self.slots.users(s), self._remaining.get(s, 0)),
                keep=self._keep_for(batch),
            )
            or []
        )
        drainable = set(self.slots.drainable())
        for victim in victims:
            if victim in drainable:
                self.slots.start_draining(victim)
        return victims

    def _demand_of(self, slot: int) -> int:
        ref = self.slots.ref_at(slot)
        return 0 if ref is None else self._demand[ref]

    def prefetch(self, ref: AdapterRef) -> Future[AdapterWeights] | None:
        """Start loading `ref` into CPU memory; returns the pending load (None if already resident, or if
        its last load failed and its backoff lasts). The load checks the version on its own thread: the
        future raises what `check` would."""
        return self._prefetch(ref)

    def pin(self, ref: AdapterRef) -> None:
        """Keep `ref` in a device slot for good; it is loaded by the next request or acquire (a version
        that fails to load is unpinned by `load_pinned`, and the registry watcher pins it again)."""
        widest = pages_for_rank(self.max_rank, self.page_rank)
        held = sum(map(self.pages_for, self.slots.pinned - {ref}))
        if held + self.pages_for(ref) + widest > self.slots.num_slots:
            raise AdapterInvalid(
                [
                    f"cannot pin {ref}: pinned adapters must leave room for one adapter of max_lora_rank "
                    f"({held} of {self.slots.num_slots} adapter pages pinned)"
                ]
            )
        self.slots.pinned.add(ref)
        self.cpu.pin(ref)
        self._prefetch(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self.slots.pinned.discard(ref)
        self.cpu.unpin(ref)

    def remove(self, adapter_id: str) -> None:
        """Drop every version from memory; running requests finish on the version they hold."""
        self.slots.remove(adapter_id)
        self.cpu.remove(adapter_id)
        self.specs.forget(adapter_id)

    def load_pinned(self) -> None:
        """Bring pinned adapters whose weights are ready into slots (called between steps)."""
        for ref in list(self.slots.pinned):
            if self.slots.holds(ref):
                continue
            try:
                slot = self.acquire(ref)
            except AdapterError as error:  # gone or broken since it was pinned: stop trying
                log.warning("unpinning %s: %s", ref, error)
                self.unpin(ref)
                continue
            if slot is not None:
                self.slots.release(slot)

    def reconcile(self, *, live: set[str], pinned: set[AdapterRef], prefetch: list[AdapterRef]) -> None:
        """Bring the tiers in line with the registry: every adapter this manager knows whose id is not
        `live` is dropped (running requests finish on what they hold), exactly `pinned` is pinned, and
        `prefetch` starts loading. A ref that cannot be pinned or loaded any more is logged and skipped."""
        known = self.held() | self.slots.pinned | self.specs.known()
        for adapter_id in {ref.adapter_id for ref in known} - live:
            log.info("adapter %s is gone from the registry: dropping it", adapter_id)
            self.remove(adapter_id)
        for ref in self.slots.pinned - pinned:
            self.unpin(ref)
        for ref in prefetch:
            self._try("prefetch", self.prefetch, ref)
        for ref in pinned - self.slots.pinned:
            self._try("pin", self.pin, ref)

    @staticmethod
    def _try(what: str, action: Callable[[AdapterRef], object], ref: AdapterRef) -> None:
        try:
            action(ref)
        except AdapterError as error:
            log.warning("%s %s failed: %s", what, ref, error)

    def held(self) -> set[AdapterRef]:
        """Every version this engine has in a slot, in CPU memory, or loading."""
        return set(self.slots.resident()) | set(self.cpu.resident()) | set(self.cpu.loading())

    def close(self) -> None:
        self.cpu.close()
        self.specs.close()

    def _prefetch(self, ref: AdapterRef) -> Future[AdapterWeights] | None:
        starts = self.cpu.needs_load(ref)
        future = self.cpu.prefetch(ref)
        if future is not None:
            future.add_done_callback(lambda _: self.on_loaded())
            if starts:
                self._fresh[ref] = future
        return future

    def wait_for_reads(self, refs: list[AdapterRef]) -> None:
        """Before admission: wait for the reads started since the last call for `refs` (the adapters about
        to take a slot) that interactive work wants, within `read_wait_s` in all, when this store's recent
        reads took no longer than that. A read from a local disk is often shorter than a step, so its request
        starts in this step rather than the next one (a cold adapter's TTFT is then one step plus the read,
        not two), while the running requests wait that read once. Each read is waited for at most once, and a
        slower store (an object store) not at all: it stalls only the requests that need it."""
        fresh, self._fresh = self._fresh, {}
        if self.read_wait_s <= 0 or self.cpu.recent_load_s > self.read_wait_s:
            return
        pending = [fresh[r] for r in refs if r in fresh and r in self._interactive and not fresh[r].done()]
        if pending:
            self.read_waits += len(pending)
            wait(pending, timeout=self.read_wait_s)

    def _load(self, ref: AdapterRef) -> AdapterWeights:
        spec = self.check(ref)
        try:
            weights = load_adapter_weights(self.store.path(ref), spec, dtype=self._dtype)
        except AdapterError:
            raise
        except Exception as error:  # corrupt or vanished files: fail the requests, not the engine
            raise AdapterLoadFailed(str(ref), str(error)) from error
        problems = []
        for path, w in weights.modules.items():
            module = self._modules.get(path)
            if module is None:
                problems.append(f"{path} is not a LoRA target of this engine")
            elif w.a.shape[1] != module.in_features or w.b.shape[0] != module.out_features:
                problems.append(
                    f"{path}: adapter shapes A{tuple(w.a.shape)} B{tuple(w.b.shape)} do not fit the base "
                    f"layer ({module.in_features} -> {module.out_features})"
                )
        if problems:
            raise AdapterInvalid(problems)
        cuda = self._device.type == "cuda"
        if cuda:  # pinned host memory makes the slot copy asynchronous
            for w in weights.modules.values():
                w.a, w.b = w.a.pin_memory(), w.b.pin_memory()
        # Here, on the loader's thread, so that a load on the engine's thread is one copy call.
        prepare_pages(weights, self.page_rank, pin=cuda)
        self.disk_loads[str(ref)] += 1
        log.info("adapter %s loaded into CPU memory (%.1f MiB)", ref, weights.nbytes / 2**20)
        return weights
