"""AdapterCache: where each adapter lives — disk, host memory, or a device slot. Policy only, no torch.

Tiers (each an LRU, oldest first):
  known  every adapter registered by name; its path stays even when its weights leave memory (disk tier)
  host   adapters whose weights are in host memory, at most max_cpu_loras
  slots  adapters copied into a device slot, at most max_loras; always a subset of host
An adapter is never evicted while pinned or while in-flight requests hold a reference on it; when
nothing can be evicted the caller gets CacheFullError, never a silent eviction. Mutators return a
Changes record; the LoRAManager carries it out (copy into / clear slots, free host tensors).
Semantics follow vLLM's LRUCacheLoRAModelManager: adding a known adapter touches it, activating into
full slots evicts the least recently used unpinned one, pinning an unknown adapter is an error.

Versions: the tiers hold adapter *keys*. A name's first version has the name as its key; reloading a name
in place (new weights, same name) adds a new version (key "name\x00<n>", never a valid name) and makes it
the one new requests resolve to (`current`), while the replaced version retires: it stays, in host memory
(its files may hold the new weights by now), until nothing uses it (`retire`). So a running request never
sees its weights change, and new requests never get the old ones.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

VERSION_SEP = "\x00"


def name_of(key: str) -> str:
    """The adapter name a key is a version of."""
    return key.split(VERSION_SEP, 1)[0]


class CacheFullError(RuntimeError):
    """Every adapter that could make room is pinned or in use."""


class AdapterInUseError(RuntimeError):
    """The adapter is referenced by in-flight requests."""


class AdapterPinnedError(RuntimeError):
    """The adapter is pinned, and the operation would take its slot."""


@dataclass(frozen=True)
class SlotUpdate:
    slot: int
    adapter: str | None  # None: clear the slot


@dataclass
class Changes:
    slots: list[SlotUpdate] = field(default_factory=list)  # apply in order
    dropped: list[str] = field(default_factory=list)  # free these host copies; reload from disk on use


class AdapterCache:
    def __init__(self, max_loras: int, max_cpu_loras: int, max_cpu_bytes: int | None = None):
        """max_cpu_bytes: the host tier's budget in bytes too (None: counted only): adapters differ in size by
        orders of magnitude (q/v at rank 8 against every expert of an MoE model and a saved head)."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_cpu_bytes = max_cpu_bytes
        self._sizes: dict[str, int] = {}  # adapter -> bytes its weights take in host memory
        self._known: OrderedDict[str, None] = OrderedDict()
        self._host: OrderedDict[str, None] = OrderedDict()
        self._slots: OrderedDict[str, int] = OrderedDict()
        self._free_slots = list(range(max_loras))
        self._pinned: set[str] = set()
        self._refs: Counter[str] = Counter()
        self._memory_only: set[str] = set()  # no disk copy: never dropped from host
        self._current: dict[str, str] = {}  # name -> the key new requests for it resolve to
        self._retiring: set[str] = set()  # replaced versions, removed once nothing uses them
        self._versions = itertools.count(2)

    # ---- queries -------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._known

    @property
    def names(self) -> list[str]:
        """The adapter names requests can use (current versions), in the order they were first loaded."""
        return list(self._current)

    def current(self, name: str) -> str | None:
        """The key of the version of `name` that new requests get; None if no adapter has that name."""
        return self._current.get(name)

    @property
    def active(self) -> dict[str, int]:
        return dict(self._slots)

    @property
    def pinned(self) -> set[str]:
        return set(self._pinned)

    def in_host(self, name: str) -> bool:
        return name in self._host

    def slot_of(self, name: str) -> int | None:
        return self._slots.get(name)

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned

    def refs(self, name: str) -> int:
        return self._refs[name]

    def can_activate(self, name: str) -> bool:
        """Whether `activate(name)` would succeed now (check/act pair for the scheduler)."""
        return name in self._slots or bool(self._free_slots) or self._slot_victim() is not None

    # ---- host tier -----------------------------------------------------------------------
    @property
    def host_bytes(self) -> int:
        return sum(self._sizes.get(n, 0) for n in self._host)

    def add(self, name: str, on_disk: bool = True, nbytes: int = 0) -> Changes:
        """Register `name` (or touch it) and mark its weights (`nbytes`) host-resident; evict the LRU until it
        fits both budgets. If it cannot fit, CacheFullError and nothing changes.

        An adapter with no disk copy (`on_disk=False`) cannot be reloaded, so it is never dropped; nor is the
        version a new version of the same name replaces (until `publish`, requests resume on it)."""
        if self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes:
            raise CacheFullError(f"adapter {name_of(name)!r} takes {nbytes} bytes, more than max_cpu_lora_bytes="
                                 f"{self.max_cpu_bytes}")
        size = nbytes or self._sizes.get(name, 0)
        victims = [] if name in self._host else self._host_victims(name, size)
        changes = Changes()
        for victim in victims:
            self._drop_from_host(victim, changes)
        self._sizes[name] = size
        self._touch(name, self._known)
        self._touch(name, self._host)
        if not on_disk:
            self._memory_only.add(name)
        if VERSION_SEP not in name:
            self._current.setdefault(name, name)  # a first version: its key is its name
        return changes

    def new_version(self, name: str) -> str:
        """A fresh key for a new version of `name`; `add` it, then `publish` it."""
        return f"{name}{VERSION_SEP}{next(self._versions)}"

    def publish(self, key: str) -> None:
        """New requests for this key's name get this version from now on; the one it replaces retires (and is
        kept in host memory until it is removed: a reload from disk could read the new files)."""
        self._require_known(key)
        name = name_of(key)
        old = self._current.get(name)
        self._current[name] = key
        if old is not None and old != key:
            self._retiring.add(old)
            self._memory_only.add(old)
            self._pinned.discard(old)

    def retire(self, in_use: set[str]) -> Changes:
        """Remove the replaced versions that no request holds (refs) or still needs (`in_use`: keys of waiting
        requests, e.g. preempted ones that resume on their version)."""
        changes = Changes()
        for key in [k for k in self._retiring if not self._refs[k] and k not in in_use]:
            other = self.remove(key)
            changes.slots += other.slots
            changes.dropped += other.dropped
        return changes

    @property
    def retiring(self) -> set[str]:
        return set(self._retiring)

    def remove(self, name: str) -> Changes:
        """Forget the key `name` entirely (unload; a current version's name goes with it). Refused while
        requests use it."""
        self._require_known(name)
        if self._refs[name]:
            raise AdapterInUseError(f"adapter {name_of(name)!r} is used by {self._refs[name]} running request(s)")
        changes = Changes()
        if name in self._host:
            self._drop_from_host(name, changes)
        self._pinned.discard(name)
        self._memory_only.discard(name)
        self._retiring.discard(name)
        self._sizes.pop(name, None)
        if self._current.get(name_of(name)) == name:
            del self._current[name_of(name)]
        del self._known[name]
        return changes

    # ---- slot tier -----------------------------------------------------------------------
    def activate(self, name: str) -> tuple[int, Changes]:
        """Give `name` a device slot (touching it if it has one). Its weights must be host-resident."""
        self._require_known(name)
        if name not in self._host:
            raise KeyError(f"adapter {name!r} is not in host memory; load it before activating")
        self._touch(name, self._known)
        self._touch(name, self._host)
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name], Changes()
        changes = Changes()
        if not self._free_slots:
            victim = self._slot_victim()
            if victim is None:
                raise CacheFullError(
                    f"cannot activate adapter {name!r}: all max_loras={self.max_loras} slots hold pinned or "
                    f"in-use adapters ({', '.join(self._slots)})"
                )
            changes.slots.append(self._free_slot_of(victim))
        slot = self._free_slots.pop(0)
        self._slots[name] = slot
        changes.slots.append(SlotUpdate(slot, name))
        return slot, changes

    def deactivate(self, name: str) -> Changes:
        """Take `name` out of its slot (it stays in host memory). Refused while requests use it or while it
        is pinned (a pin promises a slot: unpin first)."""
        self._require_known(name)
        if self._refs[name]:
            raise AdapterInUseError(f"adapter {name!r} is used by {self._refs[name]} running request(s)")
        if name in self._pinned:
            raise AdapterPinnedError(f"adapter {name!r} is pinned; unpin it before deactivating it")
        if name not in self._slots:
            return Changes()
        return Changes(slots=[self._free_slot_of(name)])

    # ---- pins and references ---------------------------------------------------------------
    def pin(self, name: str) -> Changes:
        """Keep `name` in host memory and in a slot until unpinned or unloaded (activates it)."""
        if name not in self._known:
            raise KeyError(f"cannot pin adapter {name!r}: it is not loaded")
        if name not in self._slots and sum(n in self._pinned for n in self._slots) >= self.max_loras:
            raise CacheFullError(f"cannot pin adapter {name!r}: all max_loras={self.max_loras} slots are pinned")
        _, changes = self.activate(name)
        self._pinned.add(name)
        return changes

    def unpin(self, name: str) -> None:
        self._require_known(name)
        self._pinned.discard(name)

    def acquire(self, name: str) -> None:
        """A request starts using `name`: it is not evicted until the matching release."""
        self._require_known(name)
        self._refs[name] += 1

    def release(self, name: str) -> None:
        if self._refs[name] <= 0:
            raise RuntimeError(f"adapter {name!r} released more often than acquired")
        self._refs[name] -= 1
        if not self._refs[name]:
            del self._refs[name]

    # ---- internals ---------------------------------------------------------------------------
    def _over(self, count: int, nbytes: int) -> bool:
        """Whether `count` adapters of `nbytes` in all pass a host-tier budget."""
        return count > self.max_cpu_loras or (self.max_cpu_bytes is not None and nbytes > self.max_cpu_bytes)

    def _host_victims(self, name: str, nbytes: int) -> list[str]:
        """The adapters to drop, in order, for `name` (nbytes) to fit; CacheFullError if even all that may go
        would not make room. Unslotted ones first (dropping a slotted one empties its slot too), LRU first."""
        keep = self._current.get(name_of(name))  # the version `name` replaces: requests may still resume on it
        candidates = [n for n in self._host if self._evictable(n) and n not in self._memory_only and n != keep]
        order = [n for n in candidates if n not in self._slots] + [n for n in candidates if n in self._slots]
        count, used, victims = len(self._host) + 1, self.host_bytes + nbytes, []
        for victim in order:
            if not self._over(count, used):
                break
            victims.append(victim)
            count, used = count - 1, used - self._sizes.get(victim, 0)
        if self._over(count, used):
            kept = [n for n in self._host if n not in victims]
            limits = f"max_cpu_loras={self.max_cpu_loras}" + (
                f", max_cpu_lora_bytes={self.max_cpu_bytes} ({self.host_bytes} bytes held, {nbytes} more needed)"
                if self.max_cpu_bytes is not None else "")
            raise CacheFullError(
                f"cannot keep adapter {name_of(name)!r} in host memory within {limits}: the adapters there that "
                f"cannot be evicted now ({', '.join(name_of(n) for n in kept)}) are pinned, in use, replaced by a "
                "new version or have no disk copy; unpin or unload some, or raise the limits")
        return victims

    def _evictable(self, name: str) -> bool:
        return name not in self._pinned and not self._refs[name]

    def _slot_victim(self) -> str | None:
        return next((n for n in self._slots if self._evictable(n)), None)

    def _drop_from_host(self, name: str, changes: Changes) -> None:
        if name in self._slots:
            changes.slots.append(self._free_slot_of(name))
        del self._host[name]
        changes.dropped.append(name)

    def _free_slot_of(self, name: str) -> SlotUpdate:
        slot = self._slots.pop(name)
        self._free_slots.append(slot)
        self._free_slots.sort()
        return SlotUpdate(slot, None)

    def _require_known(self, name: str) -> None:
        if name not in self._known:
            raise KeyError(f"adapter {name!r} is not loaded")

    @staticmethod
    def _touch(name: str, lru: OrderedDict[str, None]) -> None:
        lru[name] = None
        lru.move_to_end(name)
