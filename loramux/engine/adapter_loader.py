"""AdapterLoader: adapter files are read on a loader thread, never on the step loop.

Two kinds of read: an identity evicted from host memory that waiting requests need back (the scheduler asks
`ready(ref)`, which starts its read; S-LoRA's prefetch of waiting requests' adapters), and a new load (a
runtime load from the admin route). Reads run one at a time on the loader thread and touch nothing of the
store's; what they produced is installed by the step loop between steps (`install_ready`), where the cache
and the store change. Meanwhile every running stream keeps stepping, and a request waits in the queue until
its adapter is in host memory.
"""
from __future__ import annotations

from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

from loramux.adapters.cache import CacheFullError
from loramux.adapters.names import AdapterRef
from loramux.adapters.store import AdapterStore, Source


class AdapterLoader:
    def __init__(self, store: AdapterStore, max_prefetch: int):
        """max_prefetch: identities read back ahead of their requests at a time (each takes host memory)."""
        self.store, self.max_prefetch = store, max(1, max_prefetch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loramux-adapter-loader")
        self._reading: dict[AdapterRef, Future] = {}  # identities read back for waiting requests
        self._loads: list[tuple[Future, tuple, Future]] = []  # (the read, install's arguments, the result)

    def ready(self, ref: AdapterRef) -> bool:
        """Whether `ref` is in host memory; if it is not, its read starts (if max_prefetch allows)."""
        cache = self.store.cache
        if ref not in cache or cache.in_host(ref):
            return True
        if ref not in self._reading and len(self._reading) < self.max_prefetch:
            self._reading[ref] = self._executor.submit(self.store.read_back, ref)
        return False

    def load(self, name: str, source: Source, replace: bool = False, pinned: bool = False) -> Future:
        """A runtime load: the files are read on the loader thread; the future's LoRAResult comes once the step
        loop has installed them (install_ready)."""
        result: Future = Future()
        if not self.store.needs_read(name, source, replace):
            result.set_result(self.store.install(name, source, None, replace, pinned))
            return result
        read = self._executor.submit(self.store.read, name, source)
        self._loads.append((read, (name, source, replace, pinned), result))
        return result

    def install_ready(self) -> list[tuple[AdapterRef, str]]:
        """Between steps: install what the loader has read. Returns the identities whose read-back failed (their
        files went away or changed), with why: their waiting requests cannot run."""
        failed = []
        for ref, read in list(self._reading.items()):
            if not read.done():
                continue
            try:
                self.store.restore(ref, read.result())
            except CacheFullError:
                continue  # the adapters in host memory are all in use: it goes in when one is not
            except Exception as e:
                failed.append((ref, f"adapter {ref.name!r} could not be read again: {type(e).__name__}: {e}"))
            del self._reading[ref]
        for entry in [e for e in self._loads if e[0].done()]:
            self._loads.remove(entry)
            read, (name, source, replace, pinned), result = entry
            result.set_result(self.store.install_read(name, source, read.result, replace, pinned))
        return failed

    @property
    def busy(self) -> bool:
        return bool(self._reading or self._loads)

    @property
    def pending(self) -> list[Future]:
        """The reads started and not installed yet (done or not)."""
        return [*self._reading.values(), *(read for read, _, _ in self._loads)]

    def wait(self, timeout_s: float) -> None:
        """Block until a read finishes, for timeout_s at most (an idle step loop must not spin)."""
        if pending := self.pending:
            futures.wait(pending, timeout_s, futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
