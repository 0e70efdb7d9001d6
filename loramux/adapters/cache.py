"""AdapterCache: where each adapter identity lives — disk, host memory, or a device slot. Policy only, no torch.

Keys are adapter identities (AdapterRef: one per load, never reused), so two loads under one name are two
entries that never share a slot or a host copy. Tiers (each an LRU, oldest first):
  known  every identity the store holds; its source stays even when its weights leave memory (disk tier)
  host   identities whose weights are in host memory, at most max_cpu_loras (and max_cpu_bytes)
  slots  identities copied into a device slot, at most max_loras; always a subset of host
The policy is vLLM's LRUCacheLoRAModelManager's: adding or activating an identity touches it in every tier;
when a tier is full its least recently used evictable entry goes (leaving host memory takes its slot too).
Never evicted: a pinned identity and one that running requests reference (`acquire`: slot and host). Kept
in host memory (its slot may go): one that started requests hold (`hold`: a preempted request resumes on
the weights it started with, which its files may no longer hold), and one with no disk copy. An identity
referenced or held is never removed. When nothing can make room the caller gets CacheFullError, never a
silent eviction: CacheBusyError (a kind of it) when room is only held by requests in use now (it frees up as
they finish: callers wait), plain CacheFullError when pins, adapters with no disk copy or the budget itself
leave none (waiting would not help). `register` records an identity on disk only (a load that found no room
in host memory now: it is read back when its requests need it). Mutators return a Changes record; the store
carries it out.
"""
from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

Key = Hashable  # an adapter identity (AdapterRef); it prints as the adapter's name


class CacheFullError(RuntimeError):
    """Every adapter that could make room is pinned or in use."""


class CacheBusyError(CacheFullError):
    """Requests in use hold the room: there will be some once they finish."""


class AdapterInUseError(RuntimeError):
    """The adapter is referenced by in-flight requests."""


class AdapterPinnedError(RuntimeError):
    """The adapter is pinned, and the operation would take its slot."""


class Readiness(enum.Enum):
    """Where an identity a waiting request needs stands (the engine's AdapterLoader answers; the scheduler
    admits on READY and holds new work back for the head of its queue on NO_ROOM)."""

    READY = "in host memory"
    READING = "being read from disk"
    NO_ROOM = "read, waiting for room in host memory that requests in use hold"


@dataclass(frozen=True)
class SlotUpdate:
    slot: int
    adapter: Key | None  # None: clear the slot


@dataclass
class Changes:
    slots: list[SlotUpdate] = field(default_factory=list)  # apply in order
    dropped: list[Key] = field(default_factory=list)  # free these host copies; reload from disk on use

    def extend(self, other: Changes) -> None:
        self.slots += other.slots
        self.dropped += other.dropped


class AdapterCache:
    def __init__(self, max_loras: int, max_cpu_loras: int, max_cpu_bytes: int | None = None):
        """max_cpu_bytes: the host tier's budget in bytes too (None: counted only): adapters differ in size by
        orders of magnitude (q/v at rank 8 against every expert of an MoE model and a saved head)."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_cpu_bytes = max_cpu_bytes
        self._sizes: dict[Key, int] = {}  # identity -> bytes its weights take in host memory
        self._known: OrderedDict[Key, None] = OrderedDict()
        self._host: OrderedDict[Key, None] = OrderedDict()
        self._slots: OrderedDict[Key, int] = OrderedDict()
        self._free_slots = list(range(max_loras))
        self._pinned: set[Key] = set()
        self._refs: Counter[Key] = Counter()  # running requests: slot and host
        self._holds: Counter[Key] = Counter()  # started requests: host
        self._memory_only: set[Key] = set()  # never dropped from host: no disk copy to read it back from
        self._wanted: frozenset[Key] = frozenset()  # what the next waiting requests run on (want)

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self._known

    def __len__(self) -> int:
        return len(self._known)

    @property
    def active(self) -> dict[Key, int]:
        return dict(self._slots)

    @property
    def pinned(self) -> set[Key]:
        return set(self._pinned)

    @property
    def host(self) -> list[Key]:
        """The identities in host memory, least recently used first."""
        return list(self._host)

    def in_host(self, key: Key) -> bool:
        return key in self._host

    def slot_of(self, key: Key) -> int | None:
        return self._slots.get(key)

    def is_pinned(self, key: Key) -> bool:
        return key in self._pinned

    def refs(self, key: Key) -> int:
        return self._refs[key]

    def holds(self, key: Key) -> int:
        return self._holds[key]

    def in_use(self, key: Key) -> bool:
        """Requests run on `key` or will resume on it: it may not be removed."""
        return bool(self._refs[key] or self._holds[key])

    @property
    def host_bytes(self) -> int:
        return sum(self._sizes.get(k, 0) for k in self._host)

    # ---- host tier -----------------------------------------------------------------------
    def add(self, key: Key, on_disk: bool = True, nbytes: int = 0) -> Changes:
        """Register `key` (or touch it) and mark its weights (`nbytes`) host-resident; evict the LRU until it
        fits both budgets. If it cannot fit, CacheFullError and nothing changes. An identity with no disk copy
        (`on_disk=False`) cannot be read back, so it is never dropped."""
        if self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes:
            raise CacheFullError(f"adapter '{key}' takes {nbytes} bytes, more than max_cpu_lora_bytes="
                                 f"{self.max_cpu_bytes}")
        size = nbytes or self._sizes.get(key, 0)
        victims = [] if key in self._host else self._host_victims(key, size)
        changes = Changes()
        for victim in victims:
            self._drop_from_host(victim, changes)
        self._sizes[key] = size
        self._touch(key, self._known)
        self._touch(key, self._host)
        if key in self._slots:
            self._slots.move_to_end(key)
        if not on_disk:
            self._memory_only.add(key)
        return changes

    def register(self, key: Key, nbytes: int) -> None:
        """Know `key` (nbytes in host memory once there) without its weights in host memory: it has a disk copy,
        read back on use."""
        if self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes:
            raise CacheFullError(f"adapter '{key}' takes {nbytes} bytes, more than max_cpu_lora_bytes="
                                 f"{self.max_cpu_bytes}")
        self._sizes[key] = nbytes
        self._touch(key, self._known)

    def remove(self, key: Key) -> Changes:
        """Forget `key` entirely. Refused while requests reference or hold it."""
        self._require_known(key)
        if self.in_use(key):
            raise AdapterInUseError(f"adapter '{key}' is used by {max(self._refs[key], self._holds[key])} request(s)")
        changes = Changes()
        if key in self._host:
            self._drop_from_host(key, changes)
        self._pinned.discard(key)
        self._memory_only.discard(key)
        self._sizes.pop(key, None)
        del self._known[key]
        return changes

    def evict_oldest(self) -> Changes | None:
        """Drop the least recently used identity that may leave host memory (not pinned, used, held by a
        request, or without a disk copy), and its slot; None if none may."""
        victim = next((k for k in self._host if self._evictable(k) and not self._holds[k]
                       and k not in self._memory_only), None)
        if victim is None:
            return None
        changes = Changes()
        self._drop_from_host(victim, changes)
        return changes

    # ---- slot tier -----------------------------------------------------------------------
    def activate(self, key: Key) -> tuple[int, Changes]:
        """Give `key` a device slot (touching it if it has one). Its weights must be host-resident."""
        self._require_known(key)
        if key not in self._host:
            raise KeyError(f"adapter '{key}' is not in host memory; load it before activating")
        self._touch(key, self._known)
        self._touch(key, self._host)
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key], Changes()
        changes = Changes()
        if not self._free_slots:
            victim = self._slot_victim()
            if victim is None:
                error = CacheBusyError if any(k not in self._pinned for k in self._slots) else CacheFullError
                raise error(f"cannot activate adapter '{key}': all max_loras={self.max_loras} slots hold "
                            f"pinned or in-use adapters ({', '.join(map(str, self._slots))})")
            changes.slots.append(self._free_slot_of(victim))
        slot = self._free_slots.pop(0)
        self._slots[key] = slot
        changes.slots.append(SlotUpdate(slot, key))
        return slot, changes

    def deactivate(self, key: Key) -> Changes:
        """Take `key` out of its slot (it stays in host memory). Refused while requests use it or while it
        is pinned (a pin promises a slot: unpin first)."""
        self._require_known(key)
        if self._refs[key]:
            raise AdapterInUseError(f"adapter '{key}' is used by {self._refs[key]} running request(s)")
        if key in self._pinned:
            raise AdapterPinnedError(f"adapter '{key}' is pinned; unpin it before deactivating it")
        if key not in self._slots:
            return Changes()
        return Changes(slots=[self._free_slot_of(key)])

    def room_ahead(self, key: Key) -> bool:
        """Whether a read of `key` ahead of its request would find room in host memory without taking it from
        what the next waiting requests want (else the read would likely be evicted again, unused, by the next)."""
        if key in self._host:
            return True
        try:
            self._host_victims(key, self._sizes.get(key, 0), spare=self._wanted - {key})
        except CacheFullError:
            return False
        return True

    def want(self, keys: frozenset[Key]) -> None:
        """The identities the next waiting requests will run on (the scheduler says so every step): room is
        made from every other evictable entry first, least recently used first. (Plain LRU evicted adapters a
        read for the head of the queue had just passed over, only for the next requests to read them again.)"""
        self._wanted = keys

    # ---- pins and references ---------------------------------------------------------------
    def pin(self, key: Key) -> Changes:
        """Keep `key` in host memory and in a slot until unpinned or removed (activates it)."""
        self._require_known(key)
        if key not in self._slots and sum(k in self._pinned for k in self._slots) >= self.max_loras:
            raise CacheFullError(f"cannot pin adapter '{key}': all max_loras={self.max_loras} slots are pinned")
        _, changes = self.activate(key)
        self._pinned.add(key)
        return changes

    def unpin(self, key: Key) -> None:
        self._require_known(key)
        self._pinned.discard(key)

    def acquire(self, key: Key) -> None:
        """A request starts running on `key`: it is not evicted until the matching release."""
        self._require_known(key)
        self._refs[key] += 1

    def release(self, key: Key) -> None:
        self._decrement(self._refs, key, "released more often than acquired")

    def hold(self, key: Key) -> None:
        """A request started on `key` and will finish on it (through preemptions): kept in host memory, and
        never removed, until the matching unhold."""
        self._require_known(key)
        self._holds[key] += 1

    def unhold(self, key: Key) -> None:
        self._decrement(self._holds, key, "unheld more often than held")

    @staticmethod
    def _decrement(counter: Counter, key: Key, error: str) -> None:
        if counter[key] <= 0:
            raise RuntimeError(f"adapter '{key}' {error}")
        counter[key] -= 1
        if not counter[key]:
            del counter[key]

    # ---- internals ---------------------------------------------------------------------------
    def _over(self, count: int, nbytes: int) -> bool:
        """Whether `count` adapters of `nbytes` in all pass a host-tier budget."""
        return count > self.max_cpu_loras or (self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes)

    def _host_victims(self, key: Key, nbytes: int, spare: frozenset[Key] = frozenset()) -> list[Key]:
        """The identities to drop, least recently used first (those wanted last), for `key` (nbytes) to fit,
        never one in `spare`; CacheBusyError if only requests in use keep it from fitting, CacheFullError if
        waiting for them would not help."""
        candidates = sorted((k for k in self._host if self._evictable(k) and not self._holds[k]
                             and k not in self._memory_only and k not in spare),
                            key=lambda k: k in self._wanted)  # (stable: LRU within each)
        count, used, victims = len(self._host) + 1, self.host_bytes + nbytes, []
        for victim in candidates:
            if not self._over(count, used):
                break
            victims.append(victim)
            count, used = count - 1, used - self._sizes.get(victim, 0)
        if self._over(count, used):
            raise self._no_room(key, nbytes, victims)
        return victims

    def _no_room(self, key: Key, nbytes: int, victims: list[Key]) -> CacheFullError:
        kept = [k for k in self._host if k not in victims]
        limits = f"max_cpu_loras={self.max_cpu_loras}" + (
            f", max_cpu_lora_bytes={self.max_cpu_bytes} ({self.host_bytes} bytes held, {nbytes} more needed)"
            if self.max_cpu_bytes is not None else "")
        stuck = [k for k in self._host if k in self._pinned or k in self._memory_only]  # until an admin acts
        if not self._over(len(stuck) + 1, sum(self._sizes.get(k, 0) for k in stuck) + nbytes):
            in_use = [k for k in kept if k not in stuck]
            return CacheBusyError(f"adapter '{key}' waits for room in host memory ({limits}): requests are using "
                                  f"{', '.join(map(str, in_use))}")
        return CacheFullError(
            f"cannot keep adapter '{key}' in host memory within {limits}: the adapters there that cannot be "
            f"evicted ({', '.join(map(str, stuck))}) are pinned or have no disk copy; unpin or unload some, "
            "or raise the limits")

    def _evictable(self, key: Key) -> bool:
        return key not in self._pinned and not self._refs[key]

    def _slot_victim(self) -> Key | None:
        evictable = [k for k in self._slots if self._evictable(k)]
        return next((k for k in evictable if k not in self._wanted), next(iter(evictable), None))

    def _drop_from_host(self, key: Key, changes: Changes) -> None:
        if key in self._slots:
            changes.slots.append(self._free_slot_of(key))
        del self._host[key]
        changes.dropped.append(key)

    def _free_slot_of(self, key: Key) -> SlotUpdate:
        slot = self._slots.pop(key)
        self._free_slots.append(slot)
        self._free_slots.sort()
        return SlotUpdate(slot, None)

    def _require_known(self, key: Key) -> None:
        if key not in self._known:
            raise KeyError(f"adapter '{key}' is not loaded")

    @staticmethod
    def _touch(key: Key, lru: OrderedDict[Key, None]) -> None:
        lru[key] = None
        lru.move_to_end(key)
