"""AdapterLoader: adapter files are read on a loader thread, never on the step loop.

Two kinds of read: an identity evicted from host memory (or parked there by a load that found no room) that
waiting requests need back (the scheduler asks `readiness(ref)`, which starts its read; S-LoRA's prefetch of
waiting requests' adapters: a read ahead of the head of the queue only where it finds room the next waiting
requests do not want, AdapterCache.room_ahead), and a new load (a runtime load from the admin route). Reads
run one at a time on the loader thread and touch nothing of the store's; what they produced is installed by
the step loop between steps (`install_ready`), where the cache and the store change. The same thread writes
the host copies that leave host memory to the store's spill file (adapters/spill.py), which a read-back
takes instead of the files while they still hold what was loaded. Meanwhile every running stream keeps
stepping, and a request waits in the queue until its adapter is in host memory.

Pressure waits: a read whose adapter finds no room in host memory because requests in use hold it stays
read and is installed as soon as they finish (the scheduler stops admitting new work for it when the head of
its queue waits so: Readiness.NO_ROOM); one that pinned adapters keep out waits for an unpin, holding back
no one; a pinned load waits for requests in use, up to LoRAConfig.load_timeout_s. Files
that changed on disk since their identity was loaded become a new identity of the name (AdapterStore.renew).
Only what can never load is an error.
"""
from __future__ import annotations

import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from loramux.adapters.cache import CacheBusyError, CacheFullError, Readiness
from loramux.adapters.names import AdapterRef
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.adapters.store import AdapterChangedError, AdapterStore, Source


@dataclass
class _Load:
    read: Future | None  # None: nothing to read (the same files again)
    args: tuple  # AdapterStore.install's: name, source, replace, pinned
    result: Future
    deadline: float  # a pinned load that finds no room waits until then


class AdapterLoader:
    def __init__(self, store: AdapterStore, max_prefetch: int, load_timeout_s: float = 60.0):
        """max_prefetch: identities read back ahead of their requests at a time (each takes host memory; one at
        least, however little room the host tier has beyond the slots: reads ahead that find no room are
        installed as room frees up, and in a tier full of them each is evicted again before its requests run)."""
        self.store, self.max_prefetch, self.load_timeout_s = store, max(1, max_prefetch), load_timeout_s
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loramux-adapter-loader")
        self._reading: dict[AdapterRef, Future] = {}  # identities read back for waiting requests
        self._no_room: set[AdapterRef] = set()  # of those, read and waiting for room in host memory
        self._loads: list[_Load] = []
        self._flush: Future | None = None  # the spill file's writes of copies that left host memory

    def readiness(self, ref: AdapterRef, first: bool = False) -> Readiness:
        """Whether `ref` is in host memory; if it is not, its read starts (if max_prefetch allows and it would
        find room the next waiting requests do not want, or always for `first`: the request at the head of the
        queue, so the queue always moves)."""
        cache = self.store.cache
        if ref not in cache or cache.in_host(ref):
            return Readiness.READY
        if ref in self._no_room:
            return Readiness.NO_ROOM
        if ref in self._reading:
            return Readiness.READING
        if first or (len(self._reading) < self.max_prefetch and cache.room_ahead(ref)):
            self._reading[ref] = self._executor.submit(self.store.read_back, ref)
        return Readiness.READING

    def ready(self, ref: AdapterRef) -> bool:
        return self.readiness(ref) is Readiness.READY

    def read_ahead(self, name: str, source: Source) -> Future:
        """Start reading a runtime load's files before the step loop takes the load (any thread may call this:
        the read touches nothing of the store's); the load passes the future on (`load`'s ahead)."""
        return self._executor.submit(self.store.read, name, source)

    def load(self, name: str, source: Source, replace: bool = False, pinned: bool = False,
             ahead: Future | None = None) -> Future:
        """A runtime load: the files are read on the loader thread (ahead: read_ahead's read of these files, if it
        started one); the future's LoRAResult comes once the step loop has installed them (install_ready)."""
        result: Future = Future()
        if self.store.needs_read(name, source, replace):
            read = ahead or self._executor.submit(self.store.read, name, source)
        else:
            read = None
            if ahead is not None:
                ahead.cancel()  # the same files again: nothing to read (one already running is not waited for)
        load = _Load(read, (name, source, replace, pinned), result, time.monotonic() + self.load_timeout_s)
        if read is None:
            self._install(load, queued=False)  # answered now, or queued to wait for room (a pin)
        else:
            self._loads.append(load)
        return result

    def install_ready(self) -> list[tuple[AdapterRef, str]]:
        """Between steps: install what the loader has read. Returns the identities that can never be read back
        (their files went away or became unreadable), with why: their waiting requests cannot run. (One that
        pinned adapters keep out waits for an unpin.)"""
        failed = []
        for ref, read in list(self._reading.items()):
            if not read.done():
                continue
            error = self._restore(ref, read)
            if isinstance(error, Readiness):  # read, not in yet: tried again between the next steps
                (self._no_room.add if error is Readiness.NO_ROOM else self._no_room.discard)(ref)
                continue
            self._no_room.discard(ref)
            del self._reading[ref]
            if error is not None:
                failed.append((ref, error))
        for load in [entry for entry in self._loads if entry.read is None or entry.read.done()]:
            self._install(load)
        if self.store.spill.pending and (self._flush is None or self._flush.done()):
            self._flush = self._executor.submit(self.store.spill.flush)
        return failed

    def _restore(self, ref: AdapterRef, read: Future) -> str | Readiness | None:
        """Put a read-back identity in host memory: None when done, NO_ROOM while requests in use hold the room,
        or why it never can."""
        try:
            self.store.restore(ref, read.result())
        except CacheBusyError:
            return Readiness.NO_ROOM
        except CacheFullError:  # pinned adapters fill host memory: it waits for an unpin, holding back no one
            return Readiness.READING
        except AdapterChangedError as e:  # its requests start on the new identity of its name instead
            renewed = self.store.renew(ref, e.weights)
            return None if renewed else f"{e}, and could not be loaded again: {renewed.message}"
        except Exception as e:  # gone, or unreadable
            return f"adapter {ref.name!r} could not be read again: {type(e).__name__}: {e}"
        return None

    def _install(self, load: _Load, queued: bool = True) -> None:
        name, source, replace, pinned = load.args
        if load.read is None:
            result = self.store.install(name, source, None, replace, pinned)
        else:
            result = self.store.install_read(name, source, load.read.result, replace, pinned)
        if result.status is LoRAStatus.LOAD_BUSY:
            if time.monotonic() < load.deadline:
                if not queued:
                    self._loads.append(load)
                return  # a pinned load: tried again between the next steps
            result = LoRAResult(LoRAStatus.LOAD_BUSY, f"{result.message}; waited {self.load_timeout_s:g} s "
                                                      "(--lora-load-timeout)")
        if queued:
            self._loads.remove(load)
        load.result.set_result(result)

    @property
    def busy(self) -> bool:
        return bool(self._reading or self._loads)

    @property
    def pending(self) -> list[Future]:
        """The reads started and not installed yet (done or not)."""
        return [*self._reading.values(), *(load.read for load in self._loads if load.read is not None)]

    @property
    def writing(self) -> list[Future]:
        """The spill file's writes under way (one flush at most): what a caller that needs the loader idle waits
        for besides `pending`."""
        return [self._flush] if self._flush is not None and not self._flush.done() else []

    def wait(self, timeout_s: float) -> None:
        """Block until a read finishes, or for timeout_s (an idle step loop must not spin, also while what was
        read waits for room)."""
        reading = [f for f in self.pending if not f.done()]
        if reading:
            futures.wait(reading, timeout_s, futures.FIRST_COMPLETED)
        elif self.busy:
            time.sleep(timeout_s)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
