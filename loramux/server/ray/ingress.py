"""Scale-out on Ray Serve: one OpenAI-compatible endpoint in front of N engine replicas (replica.py).

    client --HTTP--> Serve proxy --> Ingress --handle, multiplexed_model_id=adapter--> ServeReplica x N
                                        |                                                  |
                                        +------------- AdapterRegistry <---- reports ------+

- Ingress: maps a request's `model` to Serve's multiplexed model id (a registered adapter; none for the
  base model) and forwards the request whole, streaming the answer back with `x-loramux-replica`. Serve
  routes an id to a replica that holds it (or to the one holding the fewest; routing.py counts what it has
  just sent, which the replicas' reports say only later), which is the adapter affinity: a cold adapter costs
  a disk read and a slot once per replica, not per request.
- AdapterRegistry: the cluster's adapters (name -> path, version, pinned) and each replica's last report
  (what it holds, its engine's state). /v1/load_lora_adapter registers and loads on one replica at once (so
  a broken adapter is refused right away, with the engine's message); the others load it on first use.
  /v1/unload_lora_adapter removes it and waits until no replica reports holding it.
- /v1/models lists the base model and every registered adapter once; /metrics gives each replica's state,
  labelled by replica; /health is up while a replica reports a healthy engine.

`scaleout_app(...)` builds the Serve application (for `serve.run`, or to compose with other deployments);
`loramux serve --replicas N [--ray-address ADDR]` runs it.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
import uuid
from dataclasses import replace

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig

from loramux.adapters.names import MAX_PARTS, parse_adapter_arg
from loramux.config import EngineConfig, ServerConfig
from loramux.server.http import protocol as p
from loramux.server.http import adapter_admin as admin
from loramux.server.http.api_server import client_of, tenant_of
from loramux.server.http.app import Auth, BodyLimit, BodyTooLarge, error_response, json_off_the_loop, public_paths
from loramux.server.http.tenants import Quotas, Tenant, Tenants, allows, check_admin, check_use, load_dirs, load_tenants
from loramux.server.http.errors import HTTPError, combination_part, model_not_found
from loramux.server.http.on_demand import OnDemand
from loramux.server.adapter_registry import AdapterRecords
from loramux.server.engine.wire import AdapterRecord
from loramux.server.ray.replica import REPORT_INTERVAL_S, ServeReplica

ROUTER = "loramux.server.ray.routing.AdapterRouter"  # by name: each handle's router imports it where it runs

logger = logging.getLogger("loramux.server")
REPORT_STALE_S = 5.0  # a replica silent this long is not counted (it reports every 0.5 s)


class AdapterRegistry:
    """The cluster's adapters (an AdapterRecords, as one server's front end keeps), and the replicas' reports. Its
    state is kept in the Ray cluster's key-value store (GCS) under `state_key` (one per deployment) after every
    change, and read back when Serve restarts this deployment: runtime loads, pins, versions and generations
    survive it."""

    def __init__(self, lora_modules: list[str], state_key: str | None = None):
        self.reports: dict[str, tuple[float, dict]] = {}
        self.tenants_generation = 0  # grows with every reload of the tenants file (SIGHUP); replicas follow it
        self._state_key = state_key.encode() if state_key else None
        saved = _kv("get", self._state_key)
        if saved is not None:
            state = json.loads(saved)
            records = msgspec.convert(state["entries"], list[AdapterRecord])
            self.records = AdapterRecords(records, self._save, state["version"], state["generation"])
            self.tenants_generation = state["tenants"]
            logger.info("adapter registry restored after a restart: %d adapter(s)", len(self.records))
            return
        self.records = AdapterRecords(save=self._save)  # its generation: what replicas report having applied
        for spec in lora_modules:
            name, path = parse_adapter_arg(spec)
            self.records.register(AdapterRecord(name, os.path.realpath(path), ()))

    def _save(self, records: AdapterRecords) -> None:
        state = {"entries": msgspec.to_builtins(list(records.values())), "version": records.version,
                 "generation": records.generation, "tenants": self.tenants_generation}
        _kv("put", self._state_key, json.dumps(state).encode())

    def register(self, name: str, path: str, pinned: bool,
                 allowed_dirs: tuple[str, ...] | None = None) -> tuple[AdapterRecord, AdapterRecord | None]:
        """(the new record, the one it replaces)."""
        return self.records.register(AdapterRecord(name, path, allowed_dirs, pinned))

    def restore(self, name: str, old: AdapterRecord | None) -> None:
        """Undo a registration that no replica could load."""
        self.records.put_back(name, old)

    def remove(self, name: str) -> int | None:
        """The generation that no longer has `name` (None: it was not registered)."""
        return None if self.records.remove(name) is None else self.records.generation

    def set_pinned(self, name: str, pinned: bool) -> int | None:
        return self.records.generation if self.records.set_pinned(name, pinned) else None

    def snapshot(self) -> tuple[int, dict[str, AdapterRecord], int]:
        """(the generation, the records, the tenants file's generation): what a replica follows, in one call."""
        return self.records.generation, dict(self.records), self.tenants_generation

    def tenants(self) -> int:
        """The tenants file's generation (a starting replica's baseline, taken before it reads the file)."""
        return self.tenants_generation

    def reload_tenants(self) -> int:
        """Every replica reads its tenants file again (it follows tenants_generation)."""
        self.tenants_generation += 1
        self._save(self.records)
        return self.tenants_generation

    def get(self, name: str) -> AdapterRecord | None:
        return self.records.get(name)

    def all(self) -> dict[str, AdapterRecord]:
        return dict(self.records)

    def pid(self) -> int:
        return os.getpid()

    def report(self, replica_id: str, state: dict) -> None:
        self.reports[replica_id] = (time.monotonic(), state)

    def replicas(self) -> dict[str, dict]:
        """The replicas that reported lately: replica id -> its last report."""
        now = time.monotonic()
        return {rid: state for rid, (at, state) in self.reports.items() if now - at < REPORT_STALE_S}


@serve.ingress()
class Ingress:
    def __init__(self, replica, registry, config: ServerConfig):
        self.replica, self.registry, self.config = replica, registry, config
        self._info: dict | None = None
        # The registry's entries as this ingress last saw them: a request's lookup costs no actor call. This
        # (single) ingress changes the registry itself and updates the copy as it does; a name missing here
        # is asked of the registry, so a copy behind it only costs a call.
        self._entries: dict[str, AdapterRecord] = {}
        self._changes = 0  # bumped at each change made here: a lookup begun before one is not kept
        self.on_demand = OnDemand(config, self._install_resolved)  # the replicas' own resolvers are off
        # the same file as the replicas' (they authenticate the forwarded key again: their prefix caches are per
        # tenant); read at deployment, and again on SIGHUP (reload_tenants)
        self.tenants = load_tenants(config.tenants_file) if config.tenants_file else Tenants()
        # A tenant's limits hold for the whole deployment: every request passes here. (Each replica keeps its own
        # count as well, of its share, which is never the stricter.) Its tokens are counted by the replicas and
        # learned from their reports (_tokens_reported).
        self.quotas = Quotas()
        self._rejected: collections.Counter[tuple[str, str]] = collections.Counter()  # (tenant, limit) -> 429s here
        self._tokens_seen: dict[tuple[str, str], float] = {}  # (replica, tenant) -> its token counter last read
        self._tokens_read = 0.0

    async def reload_tenants(self) -> None:
        """SIGHUP to `loramux serve --replicas`: this ingress and every replica read the tenants file again; a
        file that does not read leaves the tenants as they were (logged), here and on each replica."""
        if self.config.tenants_file:
            try:
                self.tenants = load_tenants(self.config.tenants_file)
                logger.info("tenants reloaded from %s: %d tenant(s)", self.config.tenants_file, len(self.tenants.tenants))
            except ValueError as e:
                logger.error("tenants not reloaded (the old ones stay): %s", e)
        await self.registry.reload_tenants.remote()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="loramux (Ray Serve)")
        app.add_middleware(BodyLimit, limit=self.config.max_body_bytes)
        app.add_middleware(Auth, key=self.config.api_key, tenants=lambda: self.tenants,
                           public=public_paths(self.config))
        app.add_exception_handler(HTTPError, lambda _, e: error_response(e.status_code, e.message, e.err_type, e.code,
                                                                           e.headers))
        app.add_exception_handler(BodyTooLarge, lambda _, e: error_response(413, e.detail))
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        app.post("/v1/load_lora_adapter")(self.load)
        app.post("/v1/unload_lora_adapter")(self.unload)
        app.post("/v1/pin_lora_adapter")(self.pin)
        app.post("/v1/unpin_lora_adapter")(self.unpin)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics)
        app.api_route("/{path:path}", methods=["GET", "POST"])(self.forward)
        return app

    # ---- requests -------------------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        body = await request.body()
        model, parts = _models_of(body) if request.method == "POST" else (None, [])
        entries = [entry] if model is not None and (entry := await self._entry_for(model, request)) else []
        for name in parts:
            with combination_part():  # as one server answers for it
                entry = await self._entry_for(name, request)
            entries += [entry] if entry is not None else []
        tenant = tenant_of(request) if request.method == "POST" and request.url.path in GENERATION_PATHS else None
        if tenant is not None:
            await self._tokens_reported(tenant)
            try:
                self.quotas.admit(tenant)  # over a limit: 429 with Retry-After, as one server answers
            except HTTPError as e:
                self._rejected[tenant.name, e.code] += 1
                raise
        try:
            status, headers, rest = await self._send(request, body, entries)
        except BaseException:
            self._release(tenant)
            raise
        if status is None:
            self._release(tenant)
            return rest
        return StreamingResponse(self._released(rest, tenant), status_code=status, headers=headers)

    async def _send(self, request: Request, body: bytes, entries: list[AdapterRecord]):
        """Forward the request to a replica: (status, headers, the body's rest), or (None, None, a 503 response)."""
        # routed by the first adapter (`model`'s, or a weighted combination's first part): the replica loads them all
        handle = self.replica.options(stream=True, multiplexed_model_id=entries[0].name if entries else "")
        client = request.client.host if request.client else "unknown"
        headers = [*request.headers.raw, (b"x-forwarded-for", client.encode())]
        stream = handle.forward.remote(request.method, request.url.path, request.url.query.encode(), headers, body,
                                       entries)
        try:
            status, response_headers, replica_id = await stream.__anext__()
        except (RayError, StopAsyncIteration) as e:
            return None, None, error_response(503, f"The replica serving this request failed: {e}", "service_unavailable")
        headers = {k.decode(): v.decode() for k, v in response_headers if k.lower() != b"content-length"}
        headers["x-loramux-replica"] = replica_id
        return status, headers, _rest(stream, headers.get("content-type", ""))

    async def _released(self, rest, tenant: Tenant | None):
        """The answer's body; the tenant's request counts as in flight until it has gone (or the client left)."""
        try:
            async for chunk in rest:
                yield chunk
        finally:
            self._release(tenant)

    def _release(self, tenant: Tenant | None) -> None:
        if tenant is not None:
            self.quotas.finished(tenant, 0)  # (its tokens come from the replicas' reports)

    async def _tokens_reported(self, tenant: Tenant) -> None:
        """Feed the quotas what the replicas counted of each tenant's tokens since the last look (their reports
        come every REPORT_INTERVAL_S; looked at no more often), for a tenant with a tokens-per-minute limit."""
        if tenant.tpm_limit is None or time.monotonic() - self._tokens_read < REPORT_INTERVAL_S:
            return
        first, self._tokens_read = not self._tokens_read, time.monotonic()
        for rid, state in (await self.registry.replicas.remote()).items():
            for labels, total in state.get("tenants", {}).get("loramux:tenant_tokens", []):
                key = (rid, labels.get("tenant", ""))
                seen = self._tokens_seen.get(key, 0.0)
                self._tokens_seen[key] = total
                if not first:  # (this ingress's first look is the baseline; a restarted replica counts from 0)
                    self.quotas.spent(key[1], total - seen if total >= seen else total)

    async def _entry_for(self, name: str, request: Request) -> AdapterRecord | None:
        """The registry's entry for a name a request uses (None: the base model, or a name the replica answers for,
        as one server would: 404, or 400 for a combination's part)."""
        check_use(tenant_of(request), name)  # outside its patterns: 404, and no resolver is asked
        entry = await self._entry(name)
        if entry is None and name != (await self._base())["model_name"]:
            # not registered (or being unloaded, while replicas still hold it): resolved, or 404 as one server
            await self.on_demand.load(name, (await self._base())["model_root"], client_of(request))
            entry = await self._entry(name)
        return entry

    async def _entry(self, name: str) -> AdapterRecord | None:
        entry, changes = self._entries.get(name), self._changes
        if entry is None and (entry := await self.registry.get.remote(name)) is not None and changes == self._changes:
            self._entries[name] = entry
        return entry

    def _changed(self, name: str) -> None:
        self._entries.pop(name, None)
        self._changes += 1

    async def _base(self) -> dict:
        if self._info is None:
            self._info = await self.replica.info.remote()
        return self._info

    async def models(self, raw: Request) -> Response:
        base, entries, allowed = await self._base(), await self.registry.all.remote(), allows(tenant_of(raw))
        card = p.model_card(base["model_name"], base["model_root"], None, base["max_model_len"])
        adapters = [p.model_card(name, e.path, base["model_name"]) for name, e in entries.items() if allowed(name)]
        card = card if allowed(base["model_name"]) else None
        return await json_off_the_loop(lambda: p.model_list(card, adapters))

    async def model(self, model_id: str, raw: Request) -> dict:
        check_use(tenant_of(raw), model_id)
        base = await self._base()
        if model_id == base["model_name"]:
            return p.model_card(base["model_name"], base["model_root"], None, base["max_model_len"])
        entry = await self.registry.get.remote(model_id)
        if entry is None:
            raise model_not_found(model_id)
        return p.model_card(model_id, entry.path, base["model_name"])

    # ---- admin ----------------------------------------------------------------------------------
    async def load(self, raw: Request) -> Response:
        """Registered cluster-wide, and loaded on one replica now: the engine's refusal, if any, is the answer.
        A path or URI every replica can read; an upload (multipart) is refused: its files would live on the
        ingress's node alone."""
        if raw.headers.get("content-type", "").startswith("multipart/"):
            raise HTTPError(400, "adapter uploads are not taken by the Ray Serve ingress: the replicas could not read "
                                 "files written on its node; push to `loramux serve`, or load a path or URI that "
                                 "every replica can read")
        request = await admin.load_request(raw)
        name, tenant = admin.checked_name(request.lora_name), tenant_of(raw)
        check_admin(tenant, name)
        dirs = load_dirs(tenant, self.config.allowed_adapter_dirs)
        path = admin.allowed_adapter_path(dirs, request.lora_path)
        existing = await self.registry.get.remote(name)
        kind = admin.load_kind(request, path, (await self._base())["model_name"], existing.path if existing else None)
        if kind == admin.AGAIN:  # as on one server: nothing to read again; `pinned` pins it
            if request.pinned and not existing.pinned:
                await self._pin(name, True)
            return admin.loaded(name, kind)
        keep_pin = kind == admin.REPLACE and existing.pinned  # a reload in place keeps the pin
        await self._register(name, path, request.pinned or keep_pin, None if tenant is None else dirs)
        return admin.loaded(name, kind)

    async def _install_resolved(self, name: str, found) -> None:
        """An adapter a resolver found: registered cluster-wide and loaded on one replica, as an admin load."""
        await self._register(name, found.path, False, found.allowed_dirs)

    async def _register(self, name: str, path: str, pinned: bool, allowed_dirs: tuple[str, ...] | None = None):
        """Registered cluster-wide and loaded on one replica now; unregistered again if it does not load there."""
        entry, old = await self.registry.register.remote(name, path, pinned, allowed_dirs)
        self._changed(name)
        try:
            await self.replica.options(multiplexed_model_id=name).warm.remote(entry)
        except RayError as e:
            await self.registry.restore.remote(name, old)
            self._changed(name)
            raise _from_replica(e) from None

    async def unload(self, request: p.UnloadLoRAAdapterRequest, raw: Request) -> Response:
        """Removed from the registry; answered once every replica has applied that (each unloads it when its
        running requests on it finish)."""
        name = admin.unload_name(request)
        check_admin(tenant_of(raw), name)
        generation = await self.registry.remove.remote(name)
        self._changed(name)
        if generation is None:
            raise admin.not_found(name)
        await self._applied(generation, f"adapter '{name}' was removed from the registry")
        return admin.removed(name)

    async def pin(self, request: p.PinLoRAAdapterRequest, raw: Request) -> Response:
        check_admin(tenant_of(raw), request.lora_name)
        return await self._pin(request.lora_name, True)

    async def unpin(self, request: p.PinLoRAAdapterRequest, raw: Request) -> Response:
        check_admin(tenant_of(raw), request.lora_name)
        return await self._pin(request.lora_name, False)

    async def _pin(self, name: str, pinned: bool) -> Response:
        generation = await self.registry.set_pinned.remote(name, pinned)
        self._changed(name)
        if generation is None:
            raise admin.not_found(name)
        await self._applied(generation, f"adapter '{name}' was {'pinned' if pinned else 'unpinned'} in the registry")
        return admin.pinned(name, pinned)

    async def _applied(self, generation: int, what: str) -> None:
        """Wait until every reporting replica has applied registry `generation` (504 after shutdown_timeout)."""
        deadline = time.monotonic() + self.config.shutdown_timeout
        while True:
            behind = [r for r, s in (await self.registry.replicas.remote()).items() if s.get("applied", 0) < generation]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise HTTPError(504, f"{what}, but replicas {', '.join(behind)} have not applied it yet (requests "
                                     "still running on it)")
            await asyncio.sleep(0.1)

    # ---- state ----------------------------------------------------------------------------------
    async def health(self) -> Response:
        replicas = await self.registry.replicas.remote()
        if any(state["healthy"] for state in replicas.values()):
            return Response(status_code=200)
        return error_response(503, f"No replica has a healthy engine ({len(replicas)} reporting).", "service_unavailable")

    async def metrics(self, raw: Request) -> Response:
        if not self.config.public_metrics:
            check_admin(tenant_of(raw))
        replicas = await self.registry.replicas.remote()
        rejected = [({"tenant": tenant, "limit": limit}, n) for (tenant, limit), n in sorted(self._rejected.items())]
        return Response(render_metrics(replicas, len(await self.registry.all.remote()), await self.registry.pid.remote(),
                                       {"loramux:tenant_rejected": rejected} if rejected else {}),
                        media_type="text/plain; version=0.0.4")


def _kv(op: str, key: bytes | None, value: bytes | None = None) -> bytes | None:
    """The Ray cluster's key-value store (GCS; Serve keeps its own state there too), where connected: get or put."""
    from ray.experimental import internal_kv

    if key is None or not internal_kv._internal_kv_initialized():
        return None
    if op == "get":
        return internal_kv._internal_kv_get(key)
    internal_kv._internal_kv_put(key, value, overwrite=True)
    return None


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # (engine's SpecDecodeStats fields)


def render_metrics(replicas: dict[str, dict], registered: int, registry_pid: int, own: dict | None = None) -> bytes:
    """Each replica's engine state, labelled by replica; lora_requests_info as vLLM's, one per replica. own: the
    ingress's per-tenant counters (its 429s), labelled replica="ingress"."""
    r = CollectorRegistry()
    gauges = {key: Gauge(f"loramux:{key}", text, ["replica"], registry=r) for key, text in (
        ("num_requests_running", "Requests in the running batch"), ("num_requests_waiting", "Requests waiting to run"),
        ("num_loaded_adapters", "Adapters the replica holds"), ("engine_healthy", "1 when the replica's engine is up"),
        ("pending_requests", "Engine requests in flight in the replica's front end (admitted, not yet ended)"))}
    info = Gauge("loramux:lora_requests_info", "Running stats on LoRA requests",
                 ["replica", "max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r)
    Gauge("loramux:registered_adapters", "Adapters registered cluster-wide", registry=r).set(registered)
    Gauge("loramux:adapter_registry_info", "The adapter registry's process", ["pid"], registry=r).labels(
        str(registry_pid)).set(1)
    processes = Gauge("loramux:replica_info", "A replica's processes (its server's and its engine's pid)",
                      ["replica", "pid", "engine_pid"], registry=r)
    resident = Gauge("loramux:lora_adapter_resident", "1 while an adapter is in a tier of a replica (what LoRA-aware "
                     "routers score on); the series is gone when it leaves", ["replica", "adapter", "tier", "pinned"],
                     registry=r)
    spec = {key: CounterMetricFamily(f"loramux:spec_decode_{key}", f"Speculative decoding's {key}, per replica",
                                     labels=["replica"]) for key in SPEC_COUNTERS}
    for rid, state in sorted(replicas.items()):
        engine = state.get("engine") or {}
        processes.labels(rid, str(state["pid"]), str(state["engine_pid"])).set(1)
        gauges["engine_healthy"].labels(rid).set(state["healthy"])
        gauges["num_loaded_adapters"].labels(rid).set(len(state["loaded"]))
        gauges["pending_requests"].labels(rid).set(state.get("pending", 0))
        if engine:
            gauges["num_requests_running"].labels(rid).set(engine["num_running"])
            gauges["num_requests_waiting"].labels(rid).set(engine["num_waiting"])
            info.labels(rid, str(engine["max_loras"]), ",".join(engine["running_adapters"]),
                        ",".join(engine["waiting_adapters"])).set(time.time())
            pinned = set(engine["pinned"])
            for tier, names in engine["resident"].items():
                for name in names:
                    resident.labels(rid, name, tier, str(name in pinned).lower()).set(1)
            if engine.get("spec_decode") is not None:
                for key, family in spec.items():
                    family.add_metric([rid], getattr(engine["spec_decode"], key))
    counted = [("ingress", own or {})] + [(rid, state.get("tenants", {})) for rid, state in sorted(replicas.items())]
    families = _tenant_families(counted) + [f for f in spec.values() if f.samples]
    if families:
        r.register(_Families(families))
    return generate_latest(r)


def _tenant_families(counted: list[tuple[str, dict]]) -> list[CounterMetricFamily]:
    """The per-tenant counters of each (replica, {metric: [(labels, value)]}): each replica counts its own
    requests and tokens; the ingress, the 429s of the deployment-wide limits."""
    tenants: dict[str, CounterMetricFamily] = {}
    for rid, families in counted:
        for name, samples in families.items():
            for labels, value in samples:
                if name not in tenants:
                    tenants[name] = CounterMetricFamily(name, f"{name}, per replica", labels=["replica", *labels])
                tenants[name].add_metric([rid, *labels.values()], value)
    return list(tenants.values())


class _Families:
    """A collector of ready-made metric families (the replicas' per-tenant counters)."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def _models_of(body: bytes) -> tuple[str | None, list[str]]:
    """The request's `model` and the adapters of its weighted combination (`adapters`), where the body is a JSON
    object naming them (else the replica says what is wrong)."""
    try:
        fields = json.loads(body)
        model, parts = fields.get("model"), fields.get("adapters")
    except (ValueError, AttributeError):
        return None, []
    parts = [p for p in parts if isinstance(p, str)][:MAX_PARTS] if isinstance(parts, dict) else []
    return (model if isinstance(model, str) else None), parts


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"})
"""The routes whose requests count against a tenant's limits (as one server's admission counts them)."""


async def _rest(stream, content_type: str):
    """The body after the first item; a replica lost mid-answer ends an event stream with an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except RayError as e:
        logger.warning("a replica failed mid-answer: %s", e)
        if content_type.startswith("text/event-stream"):
            error = p.error_body(f"The replica serving this request failed: {e}", "service_unavailable")
            yield f"data: {json.dumps(error)}\n\n".encode()


def _from_replica(e: RayError) -> HTTPError:
    cause = getattr(e, "cause", None) or e
    if isinstance(cause, HTTPError):
        return cause
    return HTTPError(503, f"The replica failed: {cause}", "service_unavailable")


def scaleout_app(engine_config: EngineConfig, server_config: ServerConfig | None = None, lora_modules=(),
                 replicas: int = 2, replica_cpus: float = 1.0, max_adapters_per_replica: int = 16,
                 replica_gpus: float = 0.0):
    """The Serve application: `serve.run(scaleout_app(...), route_prefix="/")`. Each replica is one loramux
    server (front end + engine process); replica_cpus / replica_gpus: Ray CPUs / GPUs reserved per replica (Ray
    hides the GPUs from an actor that reserves none: its engine would run on the CPU); max_adapters_per_replica:
    Serve's max_num_models_per_replica (its LRU evicts past it, which unloads the adapter there)."""
    server_config = server_config or ServerConfig()
    replica = serve.deployment(ServeReplica, name="ServeReplica", num_replicas=replicas,
                               max_ongoing_requests=server_config.max_pending_requests,
                               graceful_shutdown_timeout_s=server_config.shutdown_timeout + 5,
                               ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
                               request_router_config=RequestRouterConfig(request_router_class=ROUTER))
    registry = serve.deployment(AdapterRegistry, name="AdapterRegistry", ray_actor_options={"num_cpus": 0})
    ingress = serve.deployment(Ingress, name="Ingress", max_ongoing_requests=server_config.max_pending_requests,
                               ray_actor_options={"num_cpus": 0})
    registry_app = registry.bind(list(lora_modules), f"loramux:adapter-registry:{uuid.uuid4().hex}")
    # the ingress resolves adapters on demand and registers them cluster-wide; a replica serves the registry
    local = replace(server_config, lora_resolver_dirs=(), lora_resolver_hf=False, lora_resolvers=(),
                    lora_resolver_plugins=False)
    replicas_app = replica.bind(engine_config, local, registry_app, max_adapters_per_replica)
    return ingress.bind(replicas_app, registry_app, server_config)


def check(server_config: ServerConfig) -> None:
    """ValueError for what a server on Ray Serve cannot honour."""
    if server_config.listen_fd is not None:
        raise ValueError("--listen-fd (listen_fd) is for one server: with --replicas, Ray Serve binds --host/--port")


def run(engine_config: EngineConfig, server_config: ServerConfig, lora_modules=(), replicas: int = 2,
        address: str | None = None, max_adapters_per_replica: int = 16) -> None:
    """`loramux serve --replicas N`: start (or join, with `address`) a Ray cluster, serve until SIGINT/SIGTERM.
    On a local cluster each replica gets an equal share of the CPUs (Ray's reservation and its engine's
    threads, unless --num-threads says otherwise). Where the cluster has GPUs each replica reserves one (a
    share, with fewer GPUs than replicas: then give each engine a KV-cache budget, as they share the memory)."""
    check(server_config)
    import ray

    # Ray runs its workers at nice 15, below its own daemons and anything else on the machine: an engine there
    # loses its cores to the load generator or the HTTP proxy, and its threads wait for each other at every op.
    system = {"worker_niceness": 0} if address is None else None  # joined clusters: see docs/scale-out.md
    ray.init(address=address, include_dashboard=False, configure_logging=False, _system_config=system)
    replica_cpus = 1.0
    resources = ray.cluster_resources()
    gpus = resources.get("GPU", 0)
    replica_gpus = min(1.0, gpus / replicas) if gpus and engine_config.device in ("auto", "cuda") else 0.0
    if address is None:
        cpus = resources.get("CPU", os.cpu_count() or 1)
        replica_cpus = min(1.0, cpus / replicas)
        if engine_config.num_threads is None:
            engine_config = replace(engine_config, num_threads=max(1, int(cpus // replicas)))
    stop = _stop_on_signal()
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        ingress = serve.run(scaleout_app(engine_config, server_config, lora_modules, replicas, replica_cpus,
                                         max_adapters_per_replica, replica_gpus), name="loramux", route_prefix="/")
        _reload_on_sighup(ingress)
        logger.info("serving on http://%s:%d with %d replicas", server_config.host, server_config.port, replicas)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


def _reload_on_sighup(ingress) -> None:
    """SIGHUP: the ingress and every replica read the tenants file again (as one server's front end does)."""
    import signal
    import threading

    def reload(*_):  # (a signal handler must not wait on the cluster: the call runs in a thread of its own)
        threading.Thread(target=lambda: ingress.reload_tenants.remote().result(), daemon=True).start()

    signal.signal(signal.SIGHUP, reload)


def _stop_on_signal():
    """An event SIGINT / SIGTERM set (then the cluster is shut down in order, start-up included)."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the deployment is up (_reload_on_sighup)
    return stop
