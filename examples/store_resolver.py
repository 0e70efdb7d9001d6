"""An example adapter resolver plugin: adapters kept in a shared store (a network mount, a bucket synced to
disk, ...), copied to local disk the first time a request names one.

    ADAPTER_STORE=/mnt/adapters ADAPTER_CACHE=/var/cache/adapters \\
        loramux serve --lora-resolver store_resolver:StoreResolver     # with examples/ on PYTHONPATH

or, from an installed package, declared in its pyproject.toml:

    [project.entry-points."loramux.lora_resolvers"]
    store = "store_resolver:StoreResolver"

The store holds `<base model>/<name>/` or `<name>/` (adapter_config.json + safetensors). loramux calls
`resolve` in a thread, once per cold name however many requests ask, so it may be slow (ADAPTER_STORE_DELAY_S
adds a delay per copy: a stand-in for a remote store in benchmarks). The directory it returns is then read
under loramux's rules: safetensors only, every file inside the directory returned (or inside what
`allowed_dirs` answers, when a resolver has that method).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time


class StoreResolver:
    def __init__(self, store: str | None = None, cache: str | None = None, delay_s: float | None = None):
        self.store = store or os.environ["ADAPTER_STORE"]
        self.cache = cache or os.environ.get("ADAPTER_CACHE") or tempfile.mkdtemp(prefix="adapter-cache-")
        self.delay_s = float(os.environ.get("ADAPTER_STORE_DELAY_S", 0)) if delay_s is None else delay_s

    def resolve(self, base_model: str, name: str) -> str | None:
        if name.startswith("/") or ".." in name.split("/"):
            return None  # a name is never a path out of the store
        local = os.path.join(self.cache, name)
        if os.path.isfile(os.path.join(local, "adapter_config.json")):
            return local
        for source in (os.path.join(self.store, base_model, name), os.path.join(self.store, name)):
            if os.path.isfile(os.path.join(source, "adapter_config.json")):
                return self._copy(source, local)
        return None

    def _copy(self, source: str, local: str) -> str:
        time.sleep(self.delay_s)
        partial = f"{local}.partial-{os.getpid()}"
        shutil.copytree(source, partial, dirs_exist_ok=True)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        os.replace(partial, local)  # whole or not at all: a copy cut short is never answered
        return local

    def __str__(self) -> str:
        return f"store {self.store}"
