"""AdapterStore: adapter names, their load identities, and the weights behind them.

A name points to its current identity (AdapterRef); every load — the first, a reload in place, a load after
an unload — is a new identity, never reused. Requests resolve a name once, when they start, and keep that
identity to the end: a reload in place or an unload only moves the name, and the identity it left
(`retiring`) is removed once no request runs on it or will resume on it. The store reads and checks
adapters (under the rules each was loaded with), keeps their host copies, asks the AdapterCache where each
identity should live and carries out its answers through AdapterSlots. Every load / unload / pin answers a
LoRAResult whose message says why, for users.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace as replaced
from typing import NamedTuple

import torch

from loramux.adapters.cache import AdapterCache, CacheBusyError, CacheFullError, Changes
from loramux.adapters.checkpoint import AdapterWeights, build_adapter
from loramux.adapters.files import AdapterPathError, Signature, digest_adapter, read_adapter, signature, unchanged
from loramux.adapters.names import AdapterRef, split_revision
from loramux.adapters.peft_config import InvalidAdapterError
from loramux.adapters.slots import AdapterSlots
from loramux.adapters.spill import SpillFile
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import LoRAConfig

logger = logging.getLogger(__name__)
MAX_FOUND = 4096  # lookup() answers kept at most


@dataclass(frozen=True)
class Source:
    """Where an identity's weights come from, and the rules they were read under: a reload from disk (after
    host eviction) reads them again under the same rules."""

    path: str
    allow_pickle: bool
    allowed_dirs: tuple[str, ...] = ()
    lora_alpha: float | None = None  # a lone .safetensors file's, from the caller (files.read_adapter_file)

    def same_place(self, other: Source) -> bool:
        """The same weights: the same files, and for a lone file the same alpha (it changes the math)."""
        return os.path.realpath(self.path) == os.path.realpath(other.path) and self.lora_alpha == other.lora_alpha


class _Look(NamedTuple):
    """How an identity's files looked when they were found to hold what was loaded (None: changing)."""

    signature: Signature | None


class AdapterChangedError(RuntimeError):
    """An identity's files no longer hold what was loaded from them; `weights`: what they hold now."""

    def __init__(self, ref: AdapterRef, weights: AdapterWeights):
        super().__init__(f"adapter {ref.name!r} changed on disk since it was loaded")
        self.ref, self.weights = ref, weights


def refusal(name: str, error: Exception) -> LoRAResult:
    """Why a load failed, as a LoRAResult: a broken adapter must never take the caller down."""
    if isinstance(error, CacheBusyError):
        return LoRAResult(LoRAStatus.LOAD_BUSY, str(error))
    if isinstance(error, AdapterPathError):
        return LoRAResult(LoRAStatus.LOAD_INVALID_PATH, str(error))
    if isinstance(error, InvalidAdapterError):
        return LoRAResult(LoRAStatus.LOAD_INVALID_ADAPTER, str(error))
    if isinstance(error, CacheFullError):
        return LoRAResult(LoRAStatus.LOAD_ERROR, str(error))
    logger.error("loading adapter %r failed: %s: %s", name, type(error).__name__, error)
    return LoRAResult(LoRAStatus.LOAD_ERROR, f"loading adapter {name!r} failed: {type(error).__name__}: {error}")


class AdapterStore:
    def __init__(self, cache: AdapterCache, slots: AdapterSlots, config: LoRAConfig):
        self.cache, self.slots, self.config = cache, slots, config
        self._current: dict[str, AdapterRef] = {}  # name -> the identity requests starting now get
        self._kept: dict[str, list[AdapterRef]] = {}  # name -> its earlier revisions still addressable, oldest first
        self._found: dict[str, AdapterRef | None] = {}  # lookup()'s answers since the names last changed
        self._retiring: set[AdapterRef] = set()  # no name points to them; removed once no request uses them
        self._weights: dict[AdapterRef, AdapterWeights] = {}  # the host tier
        self._sources: dict[AdapterRef, Source] = {}  # the disk tier (none for adapters built from tensors)
        self._modules: dict[AdapterRef, frozenset[str]] = {}  # module names each identity has weights for
        self._invocations: dict[AdapterRef, tuple[int, ...]] = {}  # aLoRA: the tokens that activate it (else ())
        self._copies_bytes: dict[AdapterRef, int] = {}  # bytes of each identity's whole-module copies, any tier
        self._digests: dict[AdapterRef, str] = {}  # what its files held when it was loaded (files.AdapterFiles)
        self._signatures: dict[AdapterRef, Signature | None] = {}  # how they looked then (files.signature)
        self.spill = SpillFile(config.spill_directory, config.max_spill_bytes, slots.device.type == "cuda")
        # Counters for metrics: disk reads (first loads and reloads), and adapters pushed out of a tier.
        self.stats = {"loads": 0, "host_evictions": 0, "slot_evictions": 0}

    # ---- names -----------------------------------------------------------------------------------
    def current(self, name: str) -> AdapterRef | None:
        return self._current.get(name)

    def lookup(self, model: str) -> AdapterRef | None:
        """The identity a request's `model` names: a loaded name's current one, or `name@rev`, a revision of
        it still kept (LoRAConfig.keep_revisions; the current one's rev too); None if neither. Answered once
        per name until the names change (a request is checked when added and resolved when admitted, and a
        waiting one is looked at every step: they all share the answer)."""
        if model not in self._found:
            if len(self._found) >= MAX_FOUND:  # (names clients made up: bounded)
                self._found.clear()
            self._found[model] = self._find(model)
        return self._found[model]

    def _find(self, model: str) -> AdapterRef | None:
        ref = self._current.get(model)
        revision = split_revision(model) if ref is None else None
        if revision is None:
            return ref
        name, rev = revision
        current = self._current.get(name)
        kept = self._kept.get(name, []) + ([current] if current is not None else [])
        return next((r for r in kept if r.rev == rev), None)

    def identity_for(self, model: str) -> AdapterRef:
        """lookup(), or LookupError saying the model does not exist."""
        ref = self.lookup(model)
        if ref is None:
            raise LookupError(f"The model `{model}` does not exist.")
        return ref

    def revisions(self, name: str) -> list[AdapterRef]:
        """The earlier revisions of `name` still addressable as name@rev, oldest first (not the current one)."""
        return list(self._kept.get(name, ()))

    @property
    def names(self) -> list[str]:
        """The adapter names requests can use, in the order they were first loaded."""
        return list(self._current)

    def __contains__(self, ref: AdapterRef) -> bool:
        """Whether the identity still exists (named, or retiring while requests use it)."""
        return ref in self.cache

    @property
    def retiring(self) -> set[AdapterRef]:
        return set(self._retiring)

    def source(self, ref: AdapterRef) -> Source | None:
        return self._sources.get(ref)

    def digest(self, ref: AdapterRef) -> str | None:
        """What the identity's files held when it was read (files.AdapterFiles.digest; None: no disk copy)."""
        return self._digests.get(ref)

    def weights_of(self, ref: AdapterRef) -> AdapterWeights:
        """The identity's host copy (read back from disk first if it left host memory)."""
        return self._weights[self._ensure_in_host(ref)]

    def invocation_of(self, ref: AdapterRef) -> tuple[int, ...]:
        """An aLoRA identity's invocation tokens (recorded at load, whichever tier it is in); () for any other."""
        return self._invocations.get(ref, ())

    def modules_of(self, ref: AdapterRef) -> frozenset[str]:
        """The module names `ref` has weights for (recorded at load: no disk read, whichever tier it is in)."""
        return self._modules[ref]

    # ---- loading ---------------------------------------------------------------------------------
    def load(self, name: str, source: Source, replace: bool = False, pinned: bool = False) -> LoRAResult:
        """Load a PEFT adapter directory as a new identity of `name` (read, then install, here). A loaded name
        from the same directory answers SUCCESS (as MAX: loading is idempotent; pinned pins it), from another
        LOAD_NAME_EXISTS unless `replace` (vLLM's load_inplace): then the new identity takes the name (and its
        pin) at once, and the old one retires. pinned: pin it too; if that fails, nothing is loaded or
        replaced."""
        if not self.needs_read(name, source, replace):
            return self.install(name, source, None, replace, pinned)
        return self.install_read(name, source, lambda: self.read(name, source), replace, pinned)

    def needs_read(self, name: str, source: Source, replace: bool) -> bool:
        """Whether loading `name` from `source` reads files: a new name, a reload in place, or the files it was
        loaded from again when they may have changed since (not: the same unchanged files again, a refusal)."""
        ref = self._current.get(name)
        if ref is None or replace:
            return True
        loaded = self._sources.get(ref)
        if loaded is None or not loaded.same_place(source):
            return False
        seen = self._signatures.get(ref)  # (a read-back, unlike this, also hashes racily clean files)
        return seen is None or signature(source.path).stats != seen.stats

    def read(self, name: str, source: Source, known: tuple[Signature | None, str] | None = None) -> AdapterWeights:
        """Read and check an adapter directory into host tensors. Touches nothing of the store's, so it runs on
        a loader thread, off the step loop. Raises the reason it is refused. known: the signature and digest of
        an earlier read of these files; while they look unchanged (files.unchanged) before and after the read,
        their bytes are not hashed again and the digest is that read's."""
        before = signature(source.path)
        trusted = known is not None and unchanged(before, known[0])
        files = read_adapter(source.path, source.allow_pickle, source.allowed_dirs, self.slots.max_weight_bytes(),
                             source.lora_alpha, digest=not trusted)
        after = signature(source.path)
        if trusted and not unchanged(after, known[0]):  # changed while it was read: once more, hashed
            return self.read(name, source)
        weights = self._build(name, files.config, files.tensors, source.path)
        seen = before if after.stats == before.stats else None  # changing: the next look reads them again
        return replaced(weights, digest=known[1] if trusted else files.digest, signature=seen)

    def install_read(self, name: str, source: Source, read: Callable[[], AdapterWeights], replace: bool = False,
                     pinned: bool = False) -> LoRAResult:
        """install() what `read` returns (here, or the result of a loader thread's read); what it raises is the
        refusal."""
        try:
            weights = read()
        except Exception as e:
            return refusal(name, e)
        return self.install(name, source, weights, replace, pinned)

    def install(self, name: str, source: Source, weights: AdapterWeights | None, replace: bool = False,
                pinned: bool = False, *, park_past_pins: bool = False, keep_old: bool = True) -> LoRAResult:
        """A read adapter becomes `name`'s new identity (between steps); weights None: nothing was read.
        park_past_pins: parked also when pinned adapters fill host memory (a version its requests wait for).
        keep_old: a replaced identity may stay addressable as an earlier revision (not when its files changed)."""
        old = self._current.get(name)
        if old is not None and not replace and weights is not None and self._changed(old, source, weights):
            logger.warning("adapter %r changed on disk since it was loaded (%s): loading it again as a new version",
                           name, source.path)
            replace, keep_old = True, False
        if old is not None and not replace:
            return self._load_again(old, source, pinned)
        ref = AdapterRef(name)
        pin = pinned or (old is not None and self.cache.is_pinned(old))
        result = self._guarded_install(ref, weights, source, park=not pin,  # a pin needs its host copy now
                                       past_pins=park_past_pins)
        if result and pin:
            result = self._pin_or_drop(ref, old)
        if not result:
            return result
        self._publish(ref, old, keep_old)
        if old is not None:
            result = LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} reloaded in place")
        return replaced(result, revision=ref.revision)

    def _changed(self, ref: AdapterRef, source: Source, weights: AdapterWeights) -> bool:
        """A load of `ref`'s own files read them again (they looked changed): whether they hold something else.
        If not, their new look is recorded."""
        loaded = self._sources.get(ref)
        if loaded is None or not loaded.same_place(source):
            return False
        if weights.digest != self._digests.get(ref):
            return True
        self._signatures[ref] = weights.signature
        return False

    def _load_again(self, ref: AdapterRef, source: Source, pinned: bool) -> LoRAResult:
        loaded = self._sources.get(ref)
        if loaded is None or not loaded.same_place(source):
            where = f"from {loaded.path!r}" if loaded else "from tensors"
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {ref.name!r} is already loaded {where}; "
                                                           "unload it first, or reload it in place (replace)")
        if pinned and not self.cache.is_pinned(ref):
            return self.pin(ref.name)
        if self.cache.in_host(ref):
            self.cache.add(ref)  # a use: it becomes the most recently used
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {ref.name!r} is already loaded from that path", ref.revision)

    def _pin_or_drop(self, ref: AdapterRef, old: AdapterRef | None) -> LoRAResult:
        """Pin a just-loaded identity (taking over the pin of the one it replaces), or remove it again and
        leave everything as it was."""
        old_pinned = old is not None and self.cache.is_pinned(old)
        if old_pinned:
            self.cache.unpin(old)  # its slot may go to the new identity (unless running requests hold it)
        try:
            self._apply(self.cache.pin(ref))
        except CacheFullError as e:
            self._remove(ref)
            if old_pinned:
                self._apply(self.cache.pin(old))  # still in its slot: nothing moves
            if isinstance(e, CacheBusyError):  # requests use the slots now: the load may wait for them
                return LoRAResult(LoRAStatus.LOAD_BUSY, f"cannot pin adapter {ref.name!r} yet: {e}")
            return LoRAResult(LoRAStatus.PIN_ERROR, f"cannot pin adapter {ref.name!r}: all max_loras="
                              f"{self.config.max_loras} device slots hold pinned adapters; it was not loaded")
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {ref.name!r} loaded and pinned")

    def add_tensors(self, name: str, tensors: dict[str, torch.Tensor], peft_config: dict,
                    replace: bool = False) -> LoRAResult:
        """Register an adapter from in-memory PEFT tensors and config (no I/O; it has no disk copy, so it stays
        in host memory). The weights are copied: the caller may change its tensors afterwards. replace: a loaded
        name takes these as a new identity (a reload in place: requests running on the old one finish on it)."""
        if name in self._current and not replace:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {name!r} is already loaded; replace "
                                                           "it in place to load new weights under its name")
        try:
            weights = self._build(name, peft_config, tensors, None)
        except Exception as e:
            return refusal(name, e)
        return self.install(name, None, weights, replace=True)

    def add_weights(self, weights: AdapterWeights) -> LoRAResult:
        """weights (already checked: a combination of loaded adapters) as its name's new identity, in host memory
        only, as add_tensors's."""
        return self.install(weights.name, None, self._on_host_for_device(weights), replace=True)

    def clone(self, name: str, new_name: str) -> LoRAResult:
        """`new_name` becomes an adapter of its own with `name`'s current weights: the same host tensors (no
        copy; the host tier's budget counts them for each name) and the same disk copy to read back from. From
        then on each name lives on its own: replacing or unloading one leaves the other."""
        ref = self._current.get(name)
        if ref is None:
            return LoRAResult(LoRAStatus.LOAD_ERROR, f"cannot clone adapter {name!r}: it is not loaded")
        if new_name in self._current:
            return LoRAResult(LoRAStatus.LOAD_NAME_EXISTS, f"an adapter named {new_name!r} is already loaded")
        try:
            weights = self.weights_of(ref)
        except Exception as e:
            return refusal(name, e)
        new = AdapterRef(new_name)
        result = self._guarded_install(new, weights, self._sources.get(ref))
        if not result:
            return result
        self._publish(new, None)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {new_name!r} loaded as a clone of {name!r}", new.revision)

    def _publish(self, ref: AdapterRef, old: AdapterRef | None, keep_old: bool = False) -> None:
        """`ref` becomes its name's current identity; `old`, the one it replaces, is kept as an earlier revision
        (up to keep_revisions - 1 of them, the oldest retiring first) or retires."""
        self._current[ref.name] = ref
        self._found.clear()
        if old is None:
            return
        kept = self._kept.setdefault(ref.name, [])
        if keep_old and self.config.keep_revisions > 1 and self._keepable(old, self._sources.get(ref)):
            self.cache.unpin(old)  # a pin belongs to the name
            kept.append(old)
        else:
            self._retire_later(old)
        while len(kept) > self.config.keep_revisions - 1:
            self._retire_later(kept.pop(0))
        if not kept:
            del self._kept[ref.name]

    def _keepable(self, old: AdapterRef, new_source: Source | None) -> bool:
        """Whether `old` can stay an earlier revision beside a new load from `new_source`. Reloaded from its own
        files, it has no disk copy left (they hold the new weights now): it stays only from host memory, and
        is never dropped from there (as a pushed adapter) until it leaves the kept revisions."""
        source = self._sources.get(old)
        if source is None or new_source is None or not source.same_place(new_source):
            return True
        if not self.cache.in_host(old):
            return False
        self.cache.add(old, on_disk=False)
        for record in (self._sources, self._digests, self._signatures):
            record.pop(old, None)
        return True

    def _guarded_install(self, ref: AdapterRef, weights: AdapterWeights, source: Source | None,
                         park: bool = True, past_pins: bool = False) -> LoRAResult:
        """Register one identity's weights; a refusal (the budgets) becomes a LoRAResult. With no room in host
        memory now (requests in use hold it; past_pins: or pinned adapters), an identity with a disk copy is
        parked: registered on disk only, read back when its requests need it, which they wait for (the
        scheduler's `ready`)."""
        parked = False
        try:
            self._check_copies_budget(ref.name, weights)
            self._apply(self.cache.add(ref, on_disk=source is not None, nbytes=weights.nbytes))
        except CacheFullError as e:
            if source is None or not park or not (past_pins or isinstance(e, CacheBusyError)):
                return refusal(ref.name, e)
            try:
                self.cache.register(ref, weights.nbytes)  # (larger than the whole budget: refused)
            except CacheFullError as too_big:
                return refusal(ref.name, too_big)
            parked = True
        except Exception as e:
            return refusal(ref.name, e)
        if not parked:
            self._weights[ref] = weights
        self._modules[ref] = frozenset(weights.modules)
        self._invocations[ref] = weights.spec.alora_invocation_tokens
        self._copies_bytes[ref] = weights.copies_nbytes
        self.stats["loads"] += 1
        if source is not None:
            self._sources[ref] = source
            self._digests[ref], self._signatures[ref] = weights.digest, weights.signature
        if parked:
            self.spill.hold(ref, weights)  # read back from there when its requests need it, not read and built again
            return LoRAResult(LoRAStatus.SUCCESS, f"adapter {ref.name!r} loaded (read into host memory when its "
                                                  "requests need it: requests in use hold the room now)")
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {ref.name!r} loaded")

    def _build(self, name, config, tensors, path) -> AdapterWeights:
        slots = self.slots
        copies = self.config.max_module_copies_bytes > 0  # (base copies of save_embedding_layers are checked anyway)
        weights = build_adapter(name, config, tensors, slots.module_shapes(), self.config.max_lora_rank,
                                dtype=slots.activation_dtype, path=path, all_linear=slots.all_linear,
                                base_weight=slots.base_weights.get, dora_scale=slots.dora_scale, whole_copies=copies,
                                experts=slots.expert_shapes(), unwrapped_experts=frozenset(slots.unwrapped_experts))
        return self._on_host_for_device(weights)

    def _on_host_for_device(self, weights: AdapterWeights) -> AdapterWeights:
        """The host copy as the slots' device wants it: page-locked for a GPU (slot writes as DMA copies)."""
        return weights.pinned() if self.slots.device.type == "cuda" else weights

    def _check_copies_budget(self, name: str, weights: AdapterWeights) -> None:
        """Every loaded adapter's whole-module copies, in host memory or evicted to disk, fit the budget together
        (checked when an adapter is loaded, not when an evicted one comes back). A name's other identities
        (the one a reload replaces) do not count, unless kept as earlier revisions: they go."""
        kept = self._kept.get(name, ())
        held = sum(nbytes for ref, nbytes in self._copies_bytes.items() if ref.name != name or ref in kept)
        if weights.copies and held + weights.copies_nbytes > self.config.max_module_copies_bytes:
            raise InvalidAdapterError(
                f"adapter {name!r} saves whole modules ({', '.join(weights.copies)}: {weights.copies_nbytes} bytes); "
                f"with the {held} bytes other adapters' copies take, that is over max_module_copies_bytes="
                f"{self.config.max_module_copies_bytes}")

    # ---- unloading -------------------------------------------------------------------------------
    def unload(self, name: str) -> LoRAResult:
        """The name goes at once (requests that have not started can no longer get it); its identity's
        memory goes once no request runs on it or will resume on it (`retire`)."""
        ref = self._current.pop(name, None)
        if ref is None:
            return LoRAResult(LoRAStatus.UNLOAD_NAME_NONEXISTENT, f"no adapter named {name!r} is loaded")
        self._found.clear()
        for earlier in self._kept.pop(name, []):
            self._retire_later(earlier)
        self._retire_later(ref)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unloaded")

    def _retire_later(self, ref: AdapterRef) -> None:
        self.cache.unpin(ref)  # a pin belongs to the name
        self._retiring.add(ref)
        self.retire()

    def retire(self) -> None:
        """Remove the identities no name points to that no request runs on or holds any more."""
        for ref in [r for r in self._retiring if not self.cache.in_use(r)]:
            self._retiring.discard(ref)
            self._remove(ref)

    def _remove(self, ref: AdapterRef) -> None:
        self._apply(self.cache.remove(ref))
        self.spill.forget(ref)
        for record in (self._sources, self._modules, self._invocations, self._copies_bytes, self._digests,
                       self._signatures):
            record.pop(ref, None)

    # ---- pins and tiers --------------------------------------------------------------------------
    def pin(self, name: str) -> LoRAResult:
        """Keep the adapter in host memory and in a device slot until it is unpinned or unloaded."""
        ref = self._current.get(name)
        if ref is None:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot pin adapter {name!r}: it is not loaded")
        try:
            ref = self._ensure_in_host(ref)  # a new identity, if its files had changed
            self._apply(self.cache.pin(ref))
        except CacheBusyError as e:  # requests use the room now: the same pin succeeds once they finish
            return LoRAResult(LoRAStatus.LOAD_BUSY, f"cannot pin adapter {name!r} yet: {e}")
        except (CacheFullError, InvalidAdapterError, AdapterPathError, AdapterChangedError) as e:
            return LoRAResult(LoRAStatus.PIN_ERROR, str(e))
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} pinned", ref.revision)

    def unpin(self, name: str) -> LoRAResult:
        """Let the adapter be evicted again (it stays loaded, and in its slot until the LRU needs it)."""
        ref = self._current.get(name)
        if ref is None:
            return LoRAResult(LoRAStatus.PIN_NAME_NONEXISTENT, f"cannot unpin adapter {name!r}: it is not loaded")
        self.cache.unpin(ref)
        return LoRAResult(LoRAStatus.SUCCESS, f"adapter {name!r} unpinned")

    def activate(self, ref: AdapterRef) -> int:
        """Put the identity in a device slot (reading it from disk if it left host memory); its slot.
        AdapterChangedError if its files changed since: that identity can no longer be read."""
        if self._ensure_in_host(ref) is not ref:
            raise AdapterChangedError(ref, self._weights[self._current[ref.name]])
        slot, changes = self.cache.activate(ref)
        self._apply(changes)
        return slot

    def deactivate(self, ref: AdapterRef) -> None:
        self._apply(self.cache.deactivate(ref))

    def evict_oldest(self) -> bool:
        """Drop the least recently used adapter that may go from host memory (its name stays: it is read back
        on next use); False if none may."""
        changes = self.cache.evict_oldest()
        if changes is not None:
            self._apply(changes)
        return changes is not None

    def _ensure_in_host(self, ref: AdapterRef) -> AdapterRef:
        """The identity now in host memory for `ref`: `ref` (read back first if it had left), or, if its files
        changed meanwhile, the new identity of its name they were loaded as (renew). AdapterChangedError if
        they changed and could not be loaded so."""
        if ref not in self.cache:
            raise KeyError(f"adapter {ref.name!r} is not loaded")
        if self.cache.in_host(ref):
            return ref
        try:
            self.restore(ref, self.read_back(ref))
            return ref
        except AdapterChangedError as e:
            renewed = self.renew(ref, e.weights)
            new = self._current.get(ref.name)
            if not renewed or new is None:
                raise AdapterChangedError(ref, e.weights) from None
            if not self.cache.in_host(new):  # parked: requests in use hold the room
                raise CacheBusyError(f"adapter {ref.name!r} changed on disk and was loaded again as a new version, "
                                     "which waits for room in host memory") from None
            return new

    def read_back(self, ref: AdapterRef) -> AdapterWeights:
        """Read an identity evicted from host memory from disk again, under the rules it was loaded with (a
        loader thread may run this; KeyError if it has no disk copy). AdapterChangedError if the files no
        longer hold what was loaded: never the old identity with new weights. While they still hold it, the
        copy built when it was loaded comes from the spill file instead, if it has one there."""
        source, known = self._sources[ref], self._signatures.get(ref)
        if ref in self.spill and (look := self._still_loaded(ref, source, known)) and \
                (weights := self.spill.read(ref)) is not None:
            return replaced(weights, signature=look.signature)
        weights = self.read(ref.name, source, (known, self._digests.get(ref)))
        if weights.digest != self._digests.get(ref):
            raise AdapterChangedError(ref, weights)
        return weights

    def _still_loaded(self, ref: AdapterRef, source: Source, known: Signature | None) -> _Look | None:
        """Whether `ref`'s files still hold what was loaded, without building them: they look unchanged, or
        (a look not to trust: files copied a moment before their load, say) their bytes hash to its digest.
        With the look to record (None: changing); None when they may hold something else."""
        before = signature(source.path)
        if unchanged(before, known):
            return _Look(before)
        try:
            digest = digest_adapter(source.path, source.allow_pickle, source.allowed_dirs,
                                    self.slots.max_weight_bytes())
        except Exception:  # gone or unreadable: the full read says why
            return None
        if digest != self._digests.get(ref):
            return None
        return _Look(before if signature(source.path).stats == before.stats else None)

    def renew(self, ref: AdapterRef, weights: AdapterWeights) -> LoRAResult:
        """`ref`'s files changed on disk: what they hold now becomes a new identity of its name (as a reload in
        place: requests that start from now run on it, with a cold prefix cache). Only while the name still
        points to `ref`; a refusal otherwise, or if the new files do not install."""
        if self._current.get(ref.name) is not ref:
            return LoRAResult(LoRAStatus.LOAD_ERROR, f"adapter {ref.name!r} changed on disk since it was loaded")
        logger.warning("adapter %r changed on disk since it was loaded (%s): loading it again as a new version",
                       ref.name, self._sources[ref].path)
        return self.install(ref.name, self._sources[ref], weights, replace=True, park_past_pins=True, keep_old=False)

    def restore(self, ref: AdapterRef, weights: AdapterWeights) -> None:
        """Put read-back weights in host memory (CacheFullError if nothing can make room now). A no-op if the
        identity is gone or back already."""
        if ref not in self.cache or self.cache.in_host(ref):
            return
        self._apply(self.cache.add(ref))
        self._weights[ref] = weights
        self._signatures[ref] = weights.signature  # the newest look at its files
        self.stats["loads"] += 1

    def _apply(self, changes: Changes) -> None:
        refilled = {u.slot for u in changes.slots if u.adapter is not None}
        self.stats["slot_evictions"] += sum(u.adapter is None and u.slot in refilled for u in changes.slots)
        self.stats["host_evictions"] += len(changes.dropped)
        for ref in changes.dropped:
            weights = self._weights.pop(ref)
            if ref in self._sources:  # (read back from there later: the built copy saves the build)
                self.spill.hold(ref, weights)
        for update in changes.slots:
            if update.adapter is None:
                self.slots.clear(update.slot)
            else:
                self.slots.write(update.slot, self._weights[update.adapter])
