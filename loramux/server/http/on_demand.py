"""Adapters loaded on their first request: a `model` that is neither the base model nor a registered adapter
is asked of the adapter resolvers (loramux.adapters.resolvers), and the adapter found is loaded and
registered before the request goes on (LoRAX's dynamic adapters; vLLM's LoRAResolver). Used by the single
server (api_server.py) and the Ray Serve ingress. No torch.

- Many requests for one cold name at once: one resolution and one load; the others wait for it.
- Resolving runs in a thread of its own pool (a resolver may download, and one tenant's cold adapter must not
  queue behind other tenants' copies); the load is the engine's, read off its step loop.
- A name no resolver knows: 404, naming the resolvers asked. An adapter found that does not load (broken,
  unsupported, outside its resolver's directory): 400 with the engine's reason, answered again without a
  second read for FAILURE_TTL_S (a client retrying a broken adapter costs nothing), then tried afresh. The
  refusal is remembered under the name and under the directory it resolved to (another name for the same
  files is not read again either), for at most MAX_FAILURES entries. Only a refusal is remembered: a load
  never fails for want of room (the engine parks it until its requests need it).
- A name no resolver knows is answered 404 again without asking them for NOT_FOUND_TTL_S (a client retrying
  an unknown Hub id costs the Hub nothing); an adapter put in a resolver's directory meanwhile is found after.
- Resolver threads are shared: one client (API key, else address) has at most
  ServerConfig.max_resolves_per_client cold names resolving at once; its others wait their turn (pressure
  waits, it never fails a request), so one client asking for hundreds of unknown names cannot keep another
  tenant's cold adapter waiting.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from loramux.adapters import resolvers
from loramux.adapters.remote import RemoteAdapterError, RemoteCache
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name
from loramux.config import ServerConfig
from loramux.server.http.errors import HTTPError, model_not_found

logger = logging.getLogger("loramux.server")
FAILURE_TTL_S = 10.0
NOT_FOUND_TTL_S = 5.0
MAX_FAILURES = 4096
# Resolvers wait on stores and networks, not on the CPU: as many copies at once as cold names (asyncio's default
# pool, cpu_count + 4 threads, made 32 cold names wait behind each other's copies on 2 cores).
RESOLVE_THREADS = 64

Install = Callable[[str, resolvers.Resolved], Awaitable[None]]


def build_resolvers(config: ServerConfig, cache: RemoteCache | None = None) -> list:
    """The server's resolvers (ValueError naming a bad --lora-resolver-dir, --lora-resolver-uri or
    --lora-resolver); cache: where --lora-resolver-uri adapters are fetched to (None: a cache of their own)."""
    cache = cache or remote_cache(config, None)
    return resolvers.build(config.lora_resolver_dirs, config.lora_resolver_hf, config.lora_resolvers,
                           plugins=config.lora_resolver_plugins, uris=config.lora_resolver_uris, cache=cache)


def remote_cache(config: ServerConfig, root: str | None) -> RemoteCache:
    """Where adapters from stores are fetched to, under the server's download limits (root None: a temporary
    directory, made on first use)."""
    return RemoteCache(root, config.max_adapter_download_bytes, config.adapter_download_timeout)


class _Failures:
    """Refusals by key (a name, or the directory one resolved to), each for ttl_s; at most `limit` of them,
    the oldest dropped first, and the expired ones whenever one is added."""

    def __init__(self, ttl_s: float = FAILURE_TTL_S, limit: int = MAX_FAILURES):
        self.ttl_s, self.limit = ttl_s, limit
        self._entries: OrderedDict[str, tuple[float, str]] = OrderedDict()  # key -> (when, the engine's reason)

    def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is not None and time.monotonic() - entry[0] < self.ttl_s:
            return entry[1]
        return None

    def add(self, keys: tuple[str, ...], reason: str) -> None:
        now = time.monotonic()
        for key in keys:
            self._entries.pop(key, None)
            self._entries[key] = (now, reason)
        while self._entries and (len(self._entries) > self.limit
                                 or now - next(iter(self._entries.values()))[0] >= self.ttl_s):
            self._entries.popitem(last=False)

    def forget(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


def _refused(name: str, path: str, reason: str) -> HTTPError:
    return HTTPError(400, f"adapter '{name}' (resolved to {path}) does not load: {reason}", code="invalid_adapter")


@dataclass
class _Gate:
    semaphore: asyncio.Semaphore
    users: int = 0  # its cold names under way or waiting


class OnDemand:
    def __init__(self, config: ServerConfig, install: Install, cache: RemoteCache | None = None):
        """install(name, resolved): load and register it (HTTPError with the refusal if it does not load).
        cache: where adapters from stores go (build_resolvers)."""
        self.resolvers = build_resolvers(config, cache)
        self._install = install
        self._pending: dict[str, asyncio.Future] = {}
        self.failed = _Failures()
        self.missing = _Failures(NOT_FOUND_TTL_S)  # names no resolver knew
        self.max_per_client = config.max_resolves_per_client
        self._gates: dict[str, _Gate] = {}  # per client with cold names under way or waiting their turn
        self._pool = ThreadPoolExecutor(RESOLVE_THREADS, thread_name_prefix="loramux-resolve")  # threads made as needed

    def __bool__(self) -> bool:
        return bool(self.resolvers)

    async def load(self, name: str, base_model: str, client: str = "?") -> None:
        """`name` resolved and installed, once for all who ask at the same time; 404 if it is not a valid
        adapter name or no resolver has it, the refusal if it does not load. client: who asks (its cold names
        take turns, _in_turn)."""
        if not self.resolvers:
            raise model_not_found(name)
        if (reason := self.failed.get(name)) is not None:
            raise HTTPError(400, reason, code="invalid_adapter")
        if (reason := self.missing.get(name)) is not None:
            raise model_not_found(name, reason)
        future = self._pending.get(name)
        if future is None:
            future = self._pending[name] = asyncio.ensure_future(self._in_turn(client, name, base_model))
            future.add_done_callback(lambda _: self._pending.pop(name, None))
        await asyncio.shield(future)  # a waiter that disconnects does not cancel the others' load

    async def _in_turn(self, client: str, name: str, base_model: str) -> None:
        """_resolve_and_install once `client` has fewer than max_resolves_per_client of its own under way: its
        other cold names wait their turn, and no other client's wait for them."""
        if not self.max_per_client:
            return await self._resolve_and_install(name, base_model)
        gate = self._gates.get(client)
        if gate is None:
            gate = self._gates[client] = _Gate(asyncio.Semaphore(self.max_per_client))
        gate.users += 1
        try:
            async with gate.semaphore:
                return await self._resolve_and_install(name, base_model)
        finally:
            gate.users -= 1
            if not gate.users:
                del self._gates[client]

    async def _resolve_and_install(self, name: str, base_model: str) -> None:
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError:
            raise model_not_found(name) from None
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                self._pool, resolvers.resolve, self.resolvers, base_model, name)
        except RemoteAdapterError as e:  # a store's adapter that cannot be used (too large, not as it said)
            raise HTTPError(400, f"adapter '{name}': {e}", code="invalid_adapter") from e
        except Exception as e:  # a resolver that fails, or answers a directory with no adapter in it
            logger.error("resolving adapter %r failed: %s", name, e)
            raise HTTPError(502, f"resolving adapter '{name}' failed: {e}", "server_error") from e
        if found is None:
            missing = f" It is not registered, and no adapter resolver has it ({resolvers.describe(self.resolvers)})."
            self.missing.add((name,), missing)
            raise model_not_found(name, missing)
        if (reason := self.failed.get(found.path)) is not None:  # the same files under another name
            raise _refused(name, found.path, reason)
        logger.info("adapter %r resolved to %s; loading it", name, found.path)
        try:
            await self._install(name, found)
        except HTTPError as e:
            if e.status_code != 400:
                raise
            refused = _refused(name, found.path, e.message)
            self.failed.add((found.path,), e.message)
            self.failed.add((name,), refused.message)
            raise refused from None
        self.failed.forget((name, found.path))
