"""ServeReplica: one loramux server (front end + its engine process, as `loramux serve` runs them) inside a
Ray Serve replica. The ingress (ray_ingress.py) forwards each HTTP request to it whole, with the adapter as
Serve's multiplexed model id, so every route, stream and error code is the single server's own.

Adapters: Serve's model multiplexing decides which replicas hold which adapter (it routes an id to a replica
that reported holding it, and evicts a replica's least recently used id past max_num_models_per_replica).
`load_adapter` is the multiplexed loader: it loads the adapter the ingress named (path and version from the
cluster's registry) into this replica's engine. Eviction calls the returned handle's `__del__` (possibly
twice, possibly while requests still run): the adapter is unloaded once Serve holds no handle to it and no
forwarded request uses it (a request for it may arrive between the eviction and the unload: it keeps it),
and the engine's unload itself waits for the requests that run on it. A background task follows the
registry: adapters unloaded or replaced cluster-wide are unloaded or reloaded here, and this replica's
state is reported for the ingress's /metrics.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import msgspec
from ray import serve

from loramux.config import EngineConfig, ServerConfig
from loramux.server.engine.wire import AdapterRecord
from loramux.server.http.app import build_app
from loramux.server.http.errors import HTTPError, model_not_found

logger = logging.getLogger("loramux.server")
REPORT_INTERVAL_S = 0.5


class LoadedAdapter:
    """What the multiplexed loader returns: Serve keeps it while the replica holds the adapter."""

    def __init__(self, replica: ServeReplica, name: str):
        self.replica, self.name, self._released = replica, name, False

    def __del__(self) -> None:
        # Serve awaits this on eviction (in a thread) and the garbage collector may call it again: once only
        if not self._released:
            self._released = True
            self.replica.release(self.name)


class ServeReplica:
    async def __init__(self, engine_config: EngineConfig, server_config: ServerConfig, registry, max_adapters: int = 16):
        """Starts its engine (the replica is ready once the engine is). max_adapters: Serve's
        max_num_models_per_replica (its LRU evicts past it, which unloads here)."""

        async def load(name: str) -> LoadedAdapter:  # a plain function: Serve keeps its cache on the function
            return await self._load(name)

        self.load_adapter = serve.multiplexed(max_num_models_per_replica=max_adapters)(load)
        self.registry = registry
        # taken before the app reads the tenants file: a SIGHUP while this replica starts moves the registry's
        # generation past it, and the first round of _follow_registry reads the file again
        self._tenants_seen: int | None = await _tenants_generation(registry)
        self.app = build_app(engine_config, server_config)
        self.server = self.app.state.server
        self.replica_id = serve.get_replica_context().replica_tag
        self.entries: dict[str, AdapterRecord] = {}  # what the ingress last told us of each adapter
        self.loaded: dict[str, int] = {}  # adapter -> version loaded in this engine
        self._holds: dict[str, int] = {}  # adapter -> handles Serve keeps (loads - evictions)
        self._using: dict[str, int] = {}  # adapter -> forwarded requests under way
        self._locks: dict[str, asyncio.Lock] = {}
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._follower: asyncio.Task | None = None
        await self._started()

    async def _started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            await self.server.start()
            self._follower = asyncio.create_task(self._follow_registry())

    # ---- requests ---------------------------------------------------------------------------------
    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes,
                      entries: list[AdapterRecord]) -> AsyncIterator:
        """The server's answer to one HTTP request: first (status, headers, replica id), then body chunks.
        entries: the adapters it uses (its `model`'s, or a weighted combination's parts), loaded here first."""
        await self._started()
        names = list(dict.fromkeys(entry.name for entry in entries))
        for entry in entries:
            self.entries[entry.name] = entry
        for name in names:
            self._using[name] = self._using.get(name, 0) + 1
        try:
            for name in names:
                await self.load_adapter(name)  # Serve's record of what this replica holds
                await self._ensure(name)  # what this engine holds (after an eviction, a cluster-wide reload, ...)
            async for item in _call_asgi(self.app, method, path, query, headers, body, self.replica_id):
                yield item
        except HTTPError as e:
            yield e.status_code, [(b"content-type", b"application/json")], self.replica_id
            yield _error_body(e)
        finally:
            for name in names:
                self._using[name] -= 1
                if not self._holds.get(name):
                    asyncio.ensure_future(self._unload(name, evicted=True))

    async def warm(self, entry: AdapterRecord) -> None:
        """Load `entry` here now (the ingress's /v1/load_lora_adapter): its refusal is the caller's answer."""
        await self._started()
        self.entries[entry.name] = entry
        await self.load_adapter(entry.name)
        await self._ensure(entry.name)

    # ---- adapters ---------------------------------------------------------------------------------
    async def _load(self, name: str) -> LoadedAdapter:
        """The multiplexed loader (self.load_adapter wraps it): Serve calls it for an id it does not hold here."""
        await self._ensure(name)
        self._holds[name] = self._holds.get(name, 0) + 1
        return LoadedAdapter(self, name)

    async def _ensure(self, name: str) -> None:
        """This engine holds the registry's current version of `name` (loads, or reloads in place)."""
        entry = self.entries.get(name)
        if entry is None:
            raise model_not_found(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            if self.loaded.get(name) == entry.version:
                return
            replace = name in self.server.registry
            await self.server.load_adapter(name, entry.path, entry.pinned, replace=replace,
                                           allowed_dirs=entry.allowed_dirs)
            self.loaded[name] = entry.version

    def release(self, name: str) -> None:
        """Serve evicted `name` from this replica (called from any thread)."""
        if self._loop is not None and not self._loop.is_closed() and not self._stopping:
            asyncio.run_coroutine_threadsafe(self._released(name), self._loop)

    async def _released(self, name: str) -> None:
        self._holds[name] -= 1
        await self._unload(name, evicted=True)

    async def _unload(self, name: str, evicted: bool = False) -> None:
        """evicted: only if Serve holds no handle to it and no forwarded request uses it (else: a cluster-wide
        unload, which the engine completes once the requests running on it finish)."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name not in self.loaded or (evicted and (self._holds.get(name) or self._using.get(name))):
                return
            try:
                await self.server.unload_adapter(name)  # waits for the requests that use it
            except HTTPError as e:
                logger.warning("replica %s could not unload adapter %r: %s", self.replica_id, name, e.message)
            self.loaded.pop(name, None)

    async def _follow_registry(self) -> None:
        """Every REPORT_INTERVAL_S: apply the registry (unload what left it, reload new versions, pins), then
        report this replica's state with the registry generation it has applied."""
        while True:
            try:
                generation, current, latest = await self.registry.snapshot.remote()
                await self._apply(current)
                if latest != self._tenants_seen:
                    self.server.reload_tenants()  # SIGHUP to the deployment (ingress.reload_tenants)
                    self._tenants_seen = latest
                await self.registry.report.remote(self.replica_id, {**await self._stats(), "applied": generation})
            except Exception as e:  # the registry restarting, an adapter failing to reload: next round
                logger.warning("replica %s: following the adapter registry failed: %s", self.replica_id, e)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def _apply(self, current: dict[str, AdapterRecord]) -> None:
        for name in [n for n in self.loaded if n not in current]:
            await self._unload(name)
        for name, entry in current.items():
            if name in self.loaded:
                self.entries[name] = entry
                await self._ensure(name)
                if self.server.registry[name].pinned != entry.pinned:
                    await self.server.pin_adapter(name, entry.pinned)

    async def _stats(self) -> dict:
        engine = self.server.client.engine
        stats = {"loaded": sorted(self.loaded), "healthy": self.server.health() is None, "pid": os.getpid(),
                 "engine_pid": engine.process.pid if engine is not None else None,
                 "pending": self.server.admission.requests, "tenants": self.server.metrics.tenant_counts()}
        if stats["healthy"]:
            try:
                stats["engine"] = msgspec.structs.asdict(await self.server.client.stats(timeout=2.0))
            except Exception:
                stats["healthy"] = False
        return stats

    async def info(self) -> dict:
        """The served model, for the ingress's /v1/models."""
        await self._started()
        return {"model_name": self.server.model_name, "model_root": self.server.model_root,
                "max_model_len": self.server.max_model_len}

    async def __del__(self) -> None:
        self._stopping = True
        if self._follower is not None:
            self._follower.cancel()
        await self.server.stop()


async def _tenants_generation(registry) -> int | None:
    """The registry's tenants generation; None if it failed to answer (the first round then reads the file again)."""
    try:
        return await registry.tenants.remote()
    except Exception as e:  # the registry restarting: a replica still starts
        logger.warning("the adapter registry did not say its tenants generation (%s): the file is read again", e)
        return None


def _error_body(e: HTTPError) -> bytes:
    import json

    from loramux.server.http import protocol as p

    return json.dumps(p.error_body(e.message, e.err_type, e.code)).encode()


async def _call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes,
                     replica_id: str) -> AsyncIterator:
    """Run one HTTP request through the ASGI app in this process, streaming its answer: (status, headers,
    replica id), then body chunks. If the consumer goes away (the client disconnected upstream), the app
    sees http.disconnect, as it would from uvicorn, and aborts the request."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query,
             "headers": [(bytes(k), bytes(v)) for k, v in headers], "client": ("ray-serve-ingress", 0),
             "server": ("loramux-replica", 0)}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.create_task(app(scope, receive, messages.put))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", [])), replica_id
            elif message["type"] == "http.response.body":
                chunk, done = _drain(message, messages)
                if chunk:
                    yield chunk
                if done:
                    break
    finally:
        gone.set()
        await asyncio.wait({task}, timeout=5)
        if not task.done():
            task.cancel()


def _drain(message: dict, messages: asyncio.Queue) -> tuple[bytes, bool]:
    """One body message plus every body message already queued behind it, as one chunk: (bytes, last?).
    Each item of a Serve stream is a Ray object passed between processes; when this replica falls behind
    its engine (under load), the stream events that piled up go as one item, not one each."""
    parts = [message.get("body", b"")]
    while message.get("more_body", False) and not messages.empty():
        queued = messages.get_nowait()
        if queued is None or queued["type"] != "http.response.body":
            messages.put_nowait(queued)  # the end (None) is read again by the caller's loop
            break
        message = queued
        parts.append(message.get("body", b""))
    return b"".join(parts), not message.get("more_body", False)
