"""SpillFile: host copies that left host memory, kept on disk as they were built, so that reading one back
skips the build.

Reading an adapter back from its own files means parsing them and building its host copy again (casts,
scaling folded into B, value checks, rank-major B's): ~10-14 ms of CPU for a rank-8 adapter of a 135M model,
and on a CPU that runs on the cores the steps compute on, slowing them by about twice as much. An identity's
built tensors never change, so the first time it leaves host memory (or is parked by a load that found no
room) they are written to one anonymous file (gone with the process), and a read-back whose files still hold
what was loaded (AdapterStore._still_loaded) reads them from there: one read and a view per tensor (~1 ms).
Files that hold something else are read as before.

The file holds at most max_bytes; the entries read least recently leave first (their identities are read
from their own files again). Extents are reused first fit. Threads: the step loop hands copies over and
drops identities (`hold`, `forget`); the adapter loader's thread writes them (`flush`) and reads them back
(`read`; the step loop too, where it reads an adapter back itself). An extent is rewritten only after its
entry is gone, so a read that finds its entry still there after reading has read it whole.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from dataclasses import replace as replaced
from typing import NamedTuple

import torch

from loramux.adapters.checkpoint import AdapterWeights, Structure
from loramux.adapters.names import AdapterRef

logger = logging.getLogger(__name__)
ALIGN = 4096  # extents start on a page
STORAGE_ALIGN = 64  # storages start on a cache line within an extent (and on any dtype's size)


class _Tensor(NamedTuple):
    start: int  # its storage's first byte, from the start of the entry
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, within its storage


class _Entry(NamedTuple):
    offset: int  # in the file
    nbytes: int  # the extent's (ALIGN-rounded)
    shell: AdapterWeights  # its fields but the tensors (no module, no copy)
    structure: Structure  # shared by the entries of adapters of one shape, as is
    tensors: tuple[_Tensor, ...]  # tensors()' own, as views of the bytes


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout(tensors: list[torch.Tensor]) -> tuple[list[torch.UntypedStorage], list[int], tuple[_Tensor, ...], int]:
    """The distinct storages under the tensors, where each starts in an entry, each tensor as a view of them, and
    the entry's size."""
    storages, starts, at, where = [], [], 0, {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in where:
            where[storage.data_ptr()] = at
            storages.append(storage)
            starts.append(at)
            at = _round(at + storage.nbytes(), STORAGE_ALIGN)
    layout = tuple(_Tensor(where[t.untyped_storage().data_ptr()], t.dtype, tuple(t.shape), t.stride(),
                           t.storage_offset()) for t in tensors)
    return storages, starts, layout, _round(max(at, 1), ALIGN)


class SpillFile:
    def __init__(self, directory: str, max_bytes: int, pin_memory: bool = False):
        """directory: where the anonymous file is made (created if missing; on a disk, not a tmpfs, or the copies
        stay in memory). max_bytes: 0 = nothing is kept. pin_memory: read copies into page-locked memory (the
        host copies of a GPU's slots are)."""
        self.directory, self.max_bytes, self.pin_memory = directory, max_bytes, pin_memory
        self._lock = threading.Lock()
        self._file = None
        self._entries: OrderedDict[AdapterRef, _Entry] = OrderedDict()  # least recently read first
        self._held: dict[AdapterRef, AdapterWeights] = {}  # handed over, not written yet
        self._writing: set[AdapterRef] = set()  # being written (forget() during that drops the result)
        self._shared: dict[tuple, list] = {}  # a structure or layout -> [it, entries using it]: one copy each
        self._free: list[tuple[int, int]] = []  # (offset, nbytes) of freed extents, by offset
        self._end = 0  # the file's size
        self._used = 0  # bytes the kept copies' extents take
        self._failed = False  # a write failed (disk full, ...): logged once

    # ---- the step loop's side --------------------------------------------------------------------
    def hold(self, ref: AdapterRef, weights: AdapterWeights) -> None:
        """`ref` left host memory: keep its copy until `flush` writes it (once an identity; nothing if off)."""
        if self.max_bytes <= 0:
            return
        with self._lock:
            if ref not in self._entries and ref not in self._writing:
                self._held[ref] = weights

    def forget(self, ref: AdapterRef) -> None:
        """`ref` is gone: its copy is dropped, written or not."""
        with self._lock:
            self._held.pop(ref, None)
            self._writing.discard(ref)
            entry = self._entries.pop(ref, None)
            if entry is not None:
                self._drop(entry)

    @property
    def pending(self) -> bool:
        """Copies held that `flush` has not written yet."""
        return bool(self._held)

    # ---- the loader thread's side ----------------------------------------------------------------
    def flush(self) -> None:
        """Write every copy held (on the loader thread)."""
        while True:
            with self._lock:
                if not self._held:
                    return
                ref, weights = self._held.popitem()
                self._writing.add(ref)
            self._write(ref, weights)

    def read(self, ref: AdapterRef) -> AdapterWeights | None:
        """`ref`'s copy as it was built (a held one as it is), or None if none is kept."""
        with self._lock:
            if ref in self._held:
                return self._held[ref]
            entry = self._entries.get(ref)
            if entry is None or self._file is None:
                return None
            self._entries.move_to_end(ref)
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        try:
            if os.preadv(self._file.fileno(), [buffer.numpy()], entry.offset) != entry.nbytes:
                raise OSError("short read")
        except (OSError, ValueError) as e:
            logger.warning("reading adapter %r's spilled host copy failed (%s): reading its files instead", ref.name, e)
            self.forget(ref)
            return None
        with self._lock:  # a read on the step thread (AdapterStore.activate) races the loader's writes, which
            if self._entries.get(ref) is not entry:  # reuse an extent only once its entry is gone
                return None
        return _rebuild(buffer, entry)

    def __contains__(self, ref: AdapterRef) -> bool:
        return ref in self._entries or ref in self._held

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the kept copies take in the file."""
        return self._used

    # ---- internals -------------------------------------------------------------------------------
    def _write(self, ref: AdapterRef, weights: AdapterWeights) -> None:
        storages, starts, tensors, nbytes = _layout(weights.tensors())
        with self._lock:
            offset = self._allocate(nbytes) if ref in self._writing else None
            if offset is None:
                self._writing.discard(ref)
                return
        try:
            for storage, start in zip(storages, starts):
                data = torch.empty(0, dtype=torch.uint8).set_(storage).numpy() if storage.nbytes() else b""
                if os.pwrite(self._file.fileno(), data, offset + start) != storage.nbytes():
                    raise OSError("short write")
        except OSError as e:
            self._write_failed(ref, e)
            with self._lock:
                self._writing.discard(ref)
                self._release(offset, nbytes)
            return
        shell = replaced(weights, modules={}, copies={})
        with self._lock:
            if ref in self._writing:  # (not forgotten meanwhile)
                self._writing.discard(ref)
                entry = _Entry(offset, nbytes, shell, self._share(weights.structure()), self._share(tensors))
                self._entries[ref] = entry
                self._used += nbytes
            else:
                self._release(offset, nbytes)

    def _write_failed(self, ref: AdapterRef, error: OSError) -> None:
        if not self._failed:
            logger.warning("writing adapter %r's host copy to %s failed (%s): adapters that leave host memory are "
                           "read back from their own files", ref.name, self.directory, error)
        self._failed = True

    def _allocate(self, nbytes: int) -> int | None:
        """An extent of nbytes (under the lock), making room from the least recently read; None if it cannot fit."""
        if nbytes > self.max_bytes:
            return None
        while self._entries and self._used + nbytes > self.max_bytes:
            self._drop(self._entries.popitem(last=False)[1])
        if self._file is None:
            try:
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                self._file = tempfile.TemporaryFile(dir=self.directory)
            except OSError as e:
                self._failed = True
                logger.warning("cannot keep adapters' host copies in %s (%s): adapters that leave host memory are "
                               "read back from their own files", self.directory, e)
                self.max_bytes = 0
                return None
        for i, (offset, size) in enumerate(self._free):
            if size >= nbytes:
                self._free[i:i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        try:
            self._file.truncate(self._end + nbytes)  # (whole extents are read: one past its data reads zeros)
        except OSError:
            return None
        offset, self._end = self._end, self._end + nbytes
        return offset

    def _share(self, value: tuple) -> tuple:
        """The one copy of an equal structure or layout kept (under the lock)."""
        kept = self._shared.setdefault(value, [value, 0])
        kept[1] += 1
        return kept[0]

    def _drop(self, entry: _Entry) -> None:
        """An entry out (under the lock): its extent freed, its shared parts let go when no entry uses them."""
        for value in (entry.structure, entry.tensors):
            kept = self._shared[value]
            kept[1] -= 1
            if not kept[1]:
                del self._shared[value]
        self._used -= entry.nbytes
        self._release(entry.offset, entry.nbytes)

    def _release(self, offset: int, nbytes: int) -> None:
        """Free an extent (under the lock), merged with free neighbours; the file shrinks when its end is free."""
        free = sorted([*self._free, (offset, nbytes)])
        merged: list[tuple[int, int]] = []
        for start, size in free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        if merged and merged[-1][0] + merged[-1][1] == self._end and self._shrink(merged[-1][0]):
            self._end = merged.pop()[0]
        self._free = merged

    def _shrink(self, size: int) -> bool:
        """Cut the file to `size` bytes (its free end); False if it cannot be (the end stays free, for reuse)."""
        try:
            if self._file is not None:
                self._file.truncate(size)
        except OSError:
            return False
        return True


def _rebuild(buffer: torch.Tensor, entry: _Entry) -> AdapterWeights:
    """The entry's adapter over views of the bytes read."""
    typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    views = []
    for t in entry.tensors:
        base = typed.get((t.start, t.dtype))
        if base is None:
            base = typed[(t.start, t.dtype)] = buffer[t.start:].view(t.dtype)
        views.append(base.as_strided(t.size, t.stride, t.start // t.dtype.itemsize + t.offset))
    return entry.shell.assemble(entry.structure, views)
