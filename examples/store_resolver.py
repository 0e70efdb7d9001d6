"""An example adapter resolver plugin: adapters kept in a shared store (a network mount, a bucket synced to
disk, ...), copied to local disk the first time a request names one.

    ADAPTER_STORE=/mnt/adapters loramux serve --lora-resolver store_resolver:StoreResolver  # examples/ on PYTHONPATH

or, from an installed package, declared in its pyproject.toml:

    [project.entry-points."loramux.lora_resolvers"]
    store = "store_resolver:StoreResolver"

The store holds `<base model>/<name>/` or `<name>/` (adapter_config.json + safetensors). Copies are kept in
ADAPTER_CACHE (default: ~/.cache/loramux/adapter-store/<a key of the store's path>), so a restarted server does
not copy them again; a copy whose files differ from the store's in size or modification time is made again,
so an adapter replaced in the store is never answered from its old copy. loramux calls
`resolve` in a thread, once per cold name however many requests ask, so it may be slow (ADAPTER_STORE_DELAY_S
adds a delay per copy: a stand-in for a remote store in benchmarks). The directory it returns is then read
under loramux's rules: safetensors only, every file inside the directory returned (or inside what
`allowed_dirs` answers, when a resolver has that method).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time


class StoreResolver:
    def __init__(self, store: str | None = None, cache: str | None = None, delay_s: float | None = None):
        self.store = store or os.environ["ADAPTER_STORE"]
        self.cache = cache or os.environ.get("ADAPTER_CACHE") or default_cache(self.store)
        self.delay_s = float(os.environ.get("ADAPTER_STORE_DELAY_S", 0)) if delay_s is None else delay_s

    def resolve(self, base_model: str, name: str) -> str | None:
        if name.startswith("/") or ".." in name.split("/"):
            return None  # a name is never a path out of the store
        local = os.path.join(self.cache, name)
        for source in (os.path.join(self.store, base_model, name), os.path.join(self.store, name)):
            if os.path.isfile(os.path.join(source, "adapter_config.json")):
                return local if _same_files(source, local) else self._copy(source, local)
        return None

    def _copy(self, source: str, local: str) -> str:
        time.sleep(self.delay_s)
        partial = f"{local}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial)  # copy2: each file keeps the store's modification time
        os.makedirs(os.path.dirname(local), exist_ok=True)
        shutil.rmtree(local, ignore_errors=True)
        os.replace(partial, local)  # whole or not at all: a copy cut short is never answered
        return local

    def __str__(self) -> str:
        return f"store {self.store}"


def default_cache(store: str) -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    key = hashlib.sha256(os.path.realpath(store).encode()).hexdigest()[:16]
    return os.path.join(root, "loramux", "adapter-store", key)


def _same_files(source: str, local: str) -> bool:
    """Whether `local` holds a copy of every file of `source`, each of its size and modification time."""
    def listing(path: str) -> dict[str, tuple[int, int]]:
        stats = {entry.name: entry.stat() for entry in os.scandir(path) if entry.is_file()}
        return {name: (st.st_size, st.st_mtime_ns) for name, st in stats.items()}
    return os.path.isdir(local) and listing(source) == listing(local)
