"""APIServer: the HTTP process's state and work — the adapter registry, request validation and tokenization,
admission, the engine client, draining on shutdown, metrics. The routes (app.py) call into it. No torch.

The registry (adapter name -> where it was loaded from) is the front end's record of what the engine serves:
it answers /v1/models and 404s, and it is what a restarted engine loads again.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from fastapi import Request

from loramux.adapters.names import InvalidCombinationError, combination_name, is_combination
from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name, parse_adapter_arg, split_revision
from loramux.adapters.remote import RemoteAdapterError, RemoteStoreError, check_uri
from loramux.adapters.status import LoRAStatus
from loramux.config import EngineConfig, ServerConfig
from loramux.sampling_params import SamplingParams
from loramux.engine.input_processor import EngineLimits, InputProcessor
from loramux.engine.sequence import PROMPT_LOGPROBS_WEIGHT
from loramux.server.http import protocol as p
from loramux.server.http.adapter_admin import AGAIN, REPLACE, Upload, load_kind
from loramux.server.http.admission import Admission, Ticket
from loramux.server.http.aliases import Alias, Aliases, make_alias, target_name
from loramux.server.http.errors import HTTPError, combination_part
from loramux.server.engine import prctl
from loramux.server.engine.engine_client import ControlError, EngineClient, EngineDeadError, Supervision
from loramux.server.http.choices import Choice, new_choices, run_choices
from loramux.server.http.grammar_checker import GrammarChecker, GrammarSource
from loramux.server.http.logprobs import LogprobFormatter
from loramux.server.http.metrics import Metrics, RequestTimer
from loramux.server.http.on_demand import OnDemand, remote_cache
from loramux.server.http.tenants import Quotas, Tenant, Tenants, check_use, load_tenants
from loramux.server.http.uploads import Uploads, discard
from loramux.server.adapter_registry import AdapterRecords
from loramux.server.engine.wire import (AddRequest, AdapterRecord, LoadAdapter, Pause, PauseMode, PinAdapter, Ready,
                                 ResetPrefixCache, Resume, UnloadAdapter)
from loramux.tokenizer import Tokenizer, import_renderer

COMBINATION_LABEL = "combination"  # the metrics' model_name of requests on a weighted combination of adapters
logger = logging.getLogger("loramux.server")


class ShuttingDown(Exception):
    """The server is draining: no new work, and what still runs at the deadline is stopped."""


def _registry(lora_modules: list[str]) -> dict[str, AdapterRecord]:
    registry = {}
    for spec in lora_modules:
        try:
            name, path = parse_adapter_arg(spec)
            if name == path:  # a bare path names the adapter after itself: clients send it as `model`
                check_adapter_name(name)
        except InvalidAdapterNameError as e:
            raise ValueError(f"--lora-modules {spec}: a bare path names the adapter after itself, and {e}; "
                             f"write NAME={spec}") from e
        except ValueError as e:
            raise ValueError(f"--lora-modules {spec}: {e}") from e
        registry[name] = AdapterRecord(name, path)
    return registry


def client_of(raw: Request) -> str:
    """Who sends a request, for per-client limits and fair shares: its tenant, else its API key, else its
    address. (Only ever a key in this process: the engine gets share_of's digest.)"""
    tenant = tenant_of(raw)
    if tenant is not None:
        return f"tenant:{tenant.name}"
    return raw.headers.get("authorization") or (raw.client.host if raw.client else "?")


def tenant_of(raw: Request) -> Tenant | None:
    """The tenant a request was authenticated as (app.Auth); None: the operator, or no tenants."""
    return raw.scope.get("state", {}).get("tenant")


def _origin(client: str, tenant: Tenant | None) -> dict:
    """An engine request's origin fields: its tenant (its own prefix cache) and its fair share with its weight."""
    return {"tenant": tenant.name if tenant else None, "share": share_of(client),
            "weight": tenant.weight if tenant else 1.0}


def share_of(client: str) -> str:
    """A client's fair-share key for the engine: a tenant's name, else a digest (never an API key)."""
    if client.startswith("tenant:"):
        return client
    return "client:" + hashlib.sha256(client.encode()).hexdigest()[:16]


def _kept(source: AdapterRecord) -> bool:
    """Whether an engine restart loads the adapter again (else it is resolved on its next request)."""
    return not source.resolved or source.pinned


def _uploads(config: ServerConfig, state_file: str | None, keep_revisions: int) -> Uploads | None:
    """Where uploaded adapters' files go (None: uploads are off): beside the registry, which keeps their paths
    for the front ends and engines that come after this one. A name keeps the files of its kept revisions
    and of one more (requests running on the revision that just left may still read it back)."""
    if not config.max_adapter_upload_bytes:
        return None
    root = os.path.join(os.path.dirname(state_file), "uploads") if state_file else tempfile.mkdtemp(prefix="loramux-uploads-")
    return Uploads(root, keep_revisions + 1)


class APIServer:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig, lora_modules: list[str],
                 state_file: str | None = None, restarts: int = 0):
        """state_file: the registry as a front end this one replaces left it (then it overrides lora_modules),
        and where this one keeps it; restarts: how many front ends died before this one."""
        self.config = config
        self.grammar_limits = engine_config.grammar_limits
        self.grammars: GrammarChecker | None = None  # structured outputs are checked in worker processes
        self.state_file, self.restarts = state_file, restarts
        records = _registry(lora_modules).values()
        if state_file is not None and os.path.isfile(state_file):
            with open(state_file, "rb") as f:
                records = msgspec.json.decode(f.read(), type=list[AdapterRecord])
        self.registry = AdapterRecords(records, save=self._save_registry)
        self.keep_revisions = engine_config.lora.keep_revisions if engine_config.lora else 1
        self.uploads = _uploads(config, state_file, self.keep_revisions)
        supervision = Supervision(config.engine_start_timeout, config.engine_unresponsive_s, config.engine_kill_s)
        self.client = EngineClient(engine_config, self._preloaded, self._on_ready, supervision)
        state_dir = os.path.dirname(state_file) if state_file else None
        self.aliases = Aliases(os.path.join(state_dir, "aliases.json") if state_dir else None)
        self.remote = remote_cache(config, os.path.join(os.path.dirname(state_file), "remote") if state_file else None)
        self.on_demand = OnDemand(config, self._install_resolved, self.remote)
        self.metrics = Metrics()
        self.admission = Admission(config.max_pending_requests, config.max_pending_tokens,
                                   config.max_pending_per_client)
        self.priority_scheduling = engine_config.scheduling_policy == "priority"
        self.tenants = self._read_tenants()
        self.quotas = Quotas()
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.logprobs: LogprobFormatter | None = None
        self.template_shows_tools = False
        self.model_name = self.model_root = ""
        self.max_model_len = 0
        self.draining = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="loramux-tokenize")
        self._ids = itertools.count()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine; RuntimeError if it fails, or if a --lora-modules adapter does not load at the
        server's first start (after a restart, an adapter that no longer loads is dropped instead)."""
        started = time.monotonic()
        logger.info("starting the engine (loading the model and the adapters)")
        self._executor.submit(import_renderer)  # meanwhile, on the other core (the template renders at ready)
        ready = await self.client.start()
        if ready.failed_adapters and not self.restarts:
            await self.client.shutdown()
            raise RuntimeError("; ".join(f"--lora-modules {name}: {why}" for name, why in ready.failed_adapters.items()))
        adapters = ", ".join(self.registry) or "none"
        logger.info("ready in %.0f s: http://%s:%d serves %s; adapters: %s", time.monotonic() - started,
                    self.config.host, self.config.port, self.model_name, adapters)

    def _read_tenants(self) -> Tenants:
        """ValueError naming the cause if the file is not a valid tenants file for this server."""
        if self.config.tenants_file is None:
            return Tenants()
        tenants = load_tenants(self.config.tenants_file)
        urgent = [t.name for t in tenants.tenants if t.priority != 0]
        if urgent and not self.priority_scheduling:
            raise ValueError(f"--tenants {self.config.tenants_file}: tenant(s) {', '.join(urgent)} set a priority, "
                             "which needs --scheduling-policy priority")
        return tenants

    def reload_tenants(self) -> None:
        """SIGHUP: read the tenants file again. Requests in flight keep the tenant they started with; a file that
        does not read leaves the tenants as they were (logged)."""
        try:
            self.tenants = self._read_tenants()
        except ValueError as e:
            logger.error("tenants not reloaded (the old ones stay): %s", e)
            return
        logger.info("tenants reloaded from %s: %d tenant(s)", self.tenants.path, len(self.tenants.tenants))

    @property
    def started(self) -> bool:
        return self.tokenizer is not None

    def require_engine(self) -> None:
        """EngineDeadError (503, with the reason) until the engine has started once."""
        if not self.started:
            raise EngineDeadError(self.client.dead_reason or "the engine is starting")

    def _save_registry(self, registry: AdapterRecords) -> None:
        """The registry, for a front end that replaces this one (written whole, then renamed: never torn)."""
        if self.state_file is None:
            return
        tmp = f"{self.state_file}.tmp"
        with open(tmp, "wb") as f:
            f.write(msgspec.json.encode(list(registry.values())))
        os.replace(tmp, self.state_file)

    def _preloaded(self) -> list[AdapterRecord]:
        """What an engine (re)start loads: the registry, less the adapters resolved on demand (they are
        resolved again on their next request, rather than all read at once) unless pinned (a pin keeps an
        adapter loaded, across restarts too; it stays an on-demand adapter: unpinned, it is not loaded at the
        next restart, and it never gets what only the operator's start-up adapters get wrapped)."""
        return [source for source in self.registry.values() if _kept(source)]

    def _on_ready(self, ready: Ready) -> None:
        """After every engine (re)start: the first one sets the tokenizer and names; a restart's adapters
        that no longer load are dropped from the registry (their requests get 404 from now on), and so are
        those resolved on demand, which it did not load (all but the pinned ones)."""
        if self.tokenizer is None:
            self.tokenizer = Tokenizer.from_dir(ready.tokenizer_dir)
            self.template_shows_tools = self.tokenizer.shows_tools()  # tool_choice "auto" needs it
            self.inputs = InputProcessor(self.tokenizer, EngineLimits(ready.max_model_len, ready.vocab_size,
                                                                      priority_scheduling=ready.priority_scheduling))
            self.logprobs = LogprobFormatter(self.tokenizer)
            self.model_root, self.max_model_len = ready.model_name, ready.max_model_len
            self.model_name = self.config.served_model_name or os.path.basename(ready.model_name.rstrip("/"))
            self.grammars = GrammarChecker(self._grammar_source(ready), self.grammar_limits, workers=2)
            prctl.freeze_startup_heap("front end")  # its start-up is done
        for seconds in ready.load_seconds.values():
            self.metrics.load_seconds.labels("registered").observe(seconds)
        for name, why in ready.failed_adapters.items():
            logger.error("adapter %r did not load into the engine: %s", name, why)
            self.registry.remove(name)
        self.registry.keep(_kept)

    def _grammar_source(self, ready: Ready) -> GrammarSource:
        """The tokenizer for the grammar workers, as text: the engine's directory goes with it when it restarts,
        and a worker replaced later still needs it (a file of the front end's own would outlive a killed one)."""
        with open(os.path.join(ready.tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
            return GrammarSource(f.read(), ready.vocab_size, tuple(ready.eos_token_ids))

    async def stop(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        await self.client.shutdown()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def begin_drain(self, grace_s: float | None = None) -> None:
        """SIGTERM: take no new requests; those still running after the grace period end with an error."""
        if self.draining:
            return
        self.draining = True
        grace = self.config.shutdown_timeout if grace_s is None else grace_s
        logger.warning("shutting down: running requests have %.0f s to finish", grace)

        async def deadline():
            await asyncio.sleep(grace)
            self.client.fail_in_flight(ShuttingDown(f"the server shut down before this request finished "
                                                    f"(shutdown_timeout {grace:.0f} s)"))

        asyncio.get_running_loop().create_task(deadline())

    def health(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        return self.client.health()

    # ---- requests -------------------------------------------------------------------------------
    async def adapter_named(self, model: str, client: str = "?", tenant: Tenant | None = None,
                      pick: str | None = None) -> str | None:
        """The adapter a `model` field names (None = the base model), loaded first if a resolver has it and it
        is not registered (client: who asks, for on-demand's per-client cap); 404 for anything else, and for a
        name outside the tenant's patterns (resolvers are never asked for one). `name@rev` of a registered name
        is a revision of it: the engine knows which it keeps (404 from there if not this one). A weighted
        alias's name is one of its targets, picked by `pick` (aliases.py)."""
        alias = self.aliases.get(model)
        if alias is not None:
            check_use(tenant, model)
            model = alias.pick(pick)
            self.metrics.alias_requests.labels(alias.name, model).inc()
        revision = split_revision(model) if model not in self.registry else None
        name = revision[0] if revision is not None and revision[0] in self.registry else model
        check_use(tenant, name)
        if model == self.model_name:
            return None
        if name not in self.registry:
            await self.on_demand.load(model, self.model_root, client)
        return model

    async def adapter_of(self, request: p.GenerationRequest, client: str, tenant: Tenant | None,
                         pick: str | None) -> str | None:
        """The adapter a request runs on: its `model` (adapter_named), or with `adapters` ({name: weight}, `model` then
        the base model's name) their weighted combination, each part resolved as a `model` is (a part this client
        may not use or nobody has: a 400 saying it does not exist, the same for both). The engine builds the
        combination (adapters/combinations.py) and refuses, with a 400, what cannot be combined."""
        if request.adapters is None:
            return await self.adapter_named(request.model, client, tenant, pick)
        if request.model != self.model_name:
            raise HTTPError(400, f"a request with `adapters` names the base model ({self.model_name!r}) as its `model`, "
                                 f"not {request.model!r}", code="adapters")
        parts = {}
        for name, weight in request.adapters.items():
            with combination_part():
                resolved = await self.adapter_named(name, client, tenant, pick)
            if resolved is None:
                raise HTTPError(400, "the base model is not an adapter to combine", code="adapters")
            parts[resolved] = weight
        try:
            return combination_name(parts)
        except InvalidCombinationError as e:
            raise HTTPError(400, str(e), code="adapters") from e

    async def engine_requests(self, request: p.GenerationRequest, chat: bool, client: str = "?",
                              tenant: Tenant | None = None) -> list[AddRequest]:
        """One engine request per (prompt, choice), every field checked and every prompt tokenized first; they
        carry the tenant (its own prefix cache) and the client's fair share."""
        self._accepting()
        self._check_counts(request)
        pick = request.user if request.user is not None else None if request.seed is None else str(request.seed)
        adapter = await self.adapter_of(request, client, tenant, pick)
        if tenant is not None and "priority" not in request.model_fields_set:
            request = request.model_copy(update={"priority": tenant.priority})
        origin = _origin(client, tenant)
        sources = [request.messages] if chat else self._check(request.prompts)
        if len(sources) * request.n > self.config.max_prompts_per_request:
            raise HTTPError(400, f"this request asks for {len(sources)} prompts x n={request.n} completions; at most "
                                 f"{self.config.max_prompts_per_request} per request", code="too_many_prompts")
        if chat and self._check(lambda: request.check_tools(self.config.tool_call_parser)) == "auto":
            if not self.template_shows_tools:
                raise HTTPError(400, 'tool_choice "auto" needs a chat template that declares tools; this model\'s '
                                     'does not (use tool_choice "required" or a named function)')
        asked = request.max_tokens_for()
        params = self._sampling_params(request, max(1, asked or self.max_model_len), 0)  # checked before tokenizing
        if params.structured_outputs is not None:  # in a worker process, never the tokenizer thread
            try:
                await self.grammars.check(params.structured_outputs)
            except ValueError as e:
                raise HTTPError(400, str(e), code="invalid_structured_output") from e
        tools = request.tools if chat else None
        ids = await asyncio.get_running_loop().run_in_executor(self._executor, self._tokenize, sources, chat, params,
                                                               tools)
        rid = p.new_id("req")
        if request.user:
            logger.info("%s: user %r", rid, request.user)
        requests = []
        for i, prompt_ids in enumerate(ids):
            max_tokens = request.max_tokens_for()
            max_tokens = self.inputs.max_tokens_left(len(prompt_ids)) if max_tokens is None else max_tokens
            if max_tokens == 0 and getattr(request, "echo", False):
                max_tokens = 1  # the prompt alone (scored, with logprobs): the engine's one token is discarded
            for j in range(request.n):
                params = self._sampling_params(request, max_tokens, j)
                self._check(lambda: self.inputs.check_length(len(prompt_ids), params, strict=True))
                requests.append(AddRequest(f"{rid}-{i}-{j}", prompt_ids, params, adapter, **origin))
        return requests

    def _accepting(self) -> None:
        """503 while the server shuts down or its engine is not up."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; send the request again to another replica or later")
        self.require_engine()

    async def embedding_requests(self, request: p.EmbeddingRequest, client: str = "?",
                                 tenant: Tenant | None = None) -> list[AddRequest]:
        """One pooling request per input (SamplingParams.pooling), tokenized as completions' prompts are; they share
        the adapter tiers, slots and steps with generation."""
        self._accepting()
        adapter = await self.adapter_named(request.model, client, tenant, request.user)
        sources = self._check(request.prompts)
        if len(sources) > self.config.max_prompts_per_request:
            raise HTTPError(400, f"this request has {len(sources)} inputs; at most {self.config.max_prompts_per_request}",
                            code="too_many_prompts")
        params = self._check(lambda: SamplingParams(max_tokens=1, pooling=request.pooling, normalize=request.normalize,
                                                    cache_salt=request.cache_salt))
        ids = await asyncio.get_running_loop().run_in_executor(self._executor, self._tokenize, sources, False, params,
                                                               None)
        origin = _origin(client, tenant)
        if tenant is not None:
            params = dataclasses.replace(params, priority=tenant.priority)
        rid = p.new_id("embd")
        for prompt_ids in ids:
            self._check(lambda: self.inputs.check_length(len(prompt_ids), params, strict=True))
        return [AddRequest(f"{rid}-{i}", prompt_ids, params, adapter, **origin) for i, prompt_ids in enumerate(ids)]

    async def tokenize(self, request: p.TokenizeRequest, tenant: Tenant | None = None) -> list[int]:
        """/tokenize, in the tokenizer thread (the chat template renders as for a chat request)."""
        self.require_engine()
        await self.adapter_named(request.model, tenant=tenant)

        def run():
            if request.messages is not None:
                return self.inputs.chat_ids(request.messages, request.add_generation_prompt, request.tools)
            return self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)

        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: self._check(run))

    async def detokenize(self, request: p.DetokenizeRequest, tenant: Tenant | None = None) -> str:
        self.require_engine()
        await self.adapter_named(request.model, tenant=tenant)
        ids = self._check(lambda: self.inputs.prompt_ids(request.tokens))  # ids inside the vocabulary
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _check_counts(self, request) -> None:
        if not 1 <= request.n <= self.config.max_n:
            raise HTTPError(400, f"n must be between 1 and {self.config.max_n}, got {request.n}", code="n")
        if len(request.stop_list()) > self.config.max_stop:
            raise HTTPError(400, f"at most {self.config.max_stop} stop sequences are allowed", code="stop")

    def _sampling_params(self, request, max_tokens: int, index: int):
        return self._check(lambda: request.sampling_params(max_tokens, seed_offset=index))

    @staticmethod
    def _check(make):
        try:
            return make()
        except ValueError as e:
            raise HTTPError(400, str(e)) from e
        except RecursionError as e:  # a client's deeply nested JSON (tool parameters) where the code recurses
            raise HTTPError(400, "the request nests too deeply to be read") from e

    def _tokenize(self, sources: list, chat: bool, params, tools: list | None) -> list[list[int]]:
        """In the tokenizer thread: the event loop keeps streaming other requests meanwhile. (A structured
        output was checked before, in a grammar worker process.)"""
        self._check(lambda: self.inputs.check_params(params))
        if chat:
            return [self._check(lambda s=s: self.inputs.chat_ids(s, tools=tools)) for s in sources]
        return [self._check(lambda s=s: self.inputs.prompt_ids(s)) for s in sources]

    def admit(self, requests: list[AddRequest], raw: Request) -> Ticket:
        """Count the requests in (TooBusy -> 429 past a limit; a tenant's own limits: HTTPError 429); release()
        the ticket when they are done."""
        tenant, work = tenant_of(raw), (client_of(raw), len(requests), sum(map(work_tokens, requests)))
        if tenant is None:
            return self.admission.admit(*work)
        try:
            self.quotas.admit(tenant)
        except HTTPError as e:
            self.metrics.tenant_rejected.labels(tenant.name, e.code).inc()
            raise
        try:
            ticket = self.admission.admit(*work, tenant)
        except BaseException:
            self.quotas.finished(tenant, 0)
            raise
        self.metrics.tenant_requests.labels(tenant.name).inc()
        return ticket

    def release(self, ticket: Ticket, choices: list[Choice] | None) -> None:
        """The ticket's requests are done; their tokens (prompt + generated, every choice) count for the tenant."""
        self.admission.release(ticket)
        if ticket.tenant is not None:
            used = sum(c.prompt_tokens + c.num_tokens for c in choices) if choices else 0
            self.quotas.finished(ticket.tenant, used)
            self.metrics.tenant_tokens.labels(ticket.tenant.name).inc(used)

    def timers(self, choices: list[Choice]) -> list[RequestTimer]:
        """Per-request metrics, labelled by adapter; every weighted combination as one label (a client choosing
        weights must not be able to grow /metrics without bound)."""
        model = choices[0].request.adapter or self.model_name
        return [self.metrics.track(COMBINATION_LABEL if is_combination(model) else model) for _ in choices]

    async def complete(self, requests: list[AddRequest], raw: Request, discard: bool = False) -> list[Choice]:
        """Run the requests to the end (a non-streaming response); a client that goes away aborts them.
        discard: the requests' tokens are not part of the answer (echo with max_tokens 0)."""
        ticket, choices = self.admit(requests, raw), None
        try:
            stream = await self.client.generate(requests)
            choices = new_choices(requests, self.tokenizer, discard)
            timers = self.timers(choices)
            try:
                await until_disconnected(raw, self._drain(stream, choices, timers))
            finally:
                await stream.close()
        finally:
            self.release(ticket, choices)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise HTTPError(failed.status or 500, failed.error or "the request failed",
                            "invalid_request_error" if failed.status in (400, 404) else "server_error")
        return choices

    async def _drain(self, stream, choices: list[Choice], timers: list[RequestTimer]) -> None:
        async for choice, _ in run_choices(stream, choices, self.admission.generated):
            timers[choice.index].update(choice)

    # ---- adapters ---------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str, pinned: bool, replace: bool = False,
                           allowed_dirs: tuple[str, ...] | None = None, resolved: bool = False, uri: str = "",
                           again: bool = False) -> str:
        """allowed_dirs: the directories its files must resolve into (None: --allowed-adapter-dir; (): any, as
        for --lora-modules at start). again: the loaded name's own path (the engine reads it only if its files
        changed, so none is started ahead). The registry records what the engine answers (a reload in place keeps
        the pin of the adapter it replaces). -> the load's revision, name@rev."""
        dirs = self.config.allowed_adapter_dirs if allowed_dirs is None else tuple(allowed_dirs)
        started = time.monotonic()
        result = await self._control(LoadAdapter(0, name, path, dirs, pinned, replace, read_ahead=not again))
        if result.status is LoRAStatus.LOAD_BUSY:  # a pinned load that found no room within --lora-load-timeout
            raise HTTPError(503, result.message, "service_unavailable", "adapter_busy", {"Retry-After": "5"})
        if result.status is not LoRAStatus.SUCCESS:
            raise HTTPError(400, result.message, code="adapter_exists" if result.status is LoRAStatus.LOAD_NAME_EXISTS
                            else "invalid_adapter")
        self.metrics.load_seconds.labels("resolver" if resolved else "runtime").observe(time.monotonic() - started)
        self.registry.register(AdapterRecord(name, path, dirs, result.pinned, resolved, uri))
        return result.revision

    async def load_from_uri(self, request: p.LoadLoRAAdapterRequest) -> tuple[str, str]:
        """A runtime load from a store (--allowed-adapter-uri): fetched into the local cache off the event loop,
        then loaded from there as a directory is. The same URI again fetches what the store holds now: if it
        changed, that is a new version of the name (a reload in place). -> (ADD, REPLACE or AGAIN, revision)"""
        name, source = request.lora_name, self.registry.get(request.lora_name)
        try:
            uri = check_uri(request.lora_path, self.config.allowed_adapter_uris)
        except RemoteAdapterError as e:
            raise HTTPError(400, str(e), code="invalid_adapter_uri") from e
        same = source is not None and source.uri == uri
        kind = load_kind(request, uri, self.model_name, None if source is None or same else source.uri or source.path)
        local = await self._fetch(uri)
        if same:
            kind = AGAIN if local == source.path else REPLACE  # (a changed object is a new version)
        revision = await self.load_adapter(name, local, request.pinned, replace=kind == REPLACE,
                                           allowed_dirs=(self.remote.root,), uri=uri)
        self.remote.prune(uri, self.keep_revisions + 1, {s.path for s in self.registry.values()})
        return kind, revision

    async def _fetch(self, uri: str) -> str:
        """The local copy of a remote adapter (adapters/remote.py): 400 if it cannot be used, 502 if the store
        fails, 504 past --adapter-download-timeout."""
        timeout = self.config.adapter_download_timeout
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.remote.fetch, uri), timeout)
        except RemoteAdapterError as e:
            raise HTTPError(400, str(e), code="invalid_adapter") from e
        except RemoteStoreError as e:
            raise HTTPError(502, str(e), "server_error", "adapter_store_failed") from e
        except TimeoutError:
            raise HTTPError(504, f"fetching adapter {uri!r} took over {timeout:g} s (--adapter-download-timeout)",
                            "server_error", "adapter_store_timeout") from None

    async def upload_adapter(self, upload: Upload) -> tuple[str, str]:
        """An adapter whose files came in the request (server/http/uploads.py), written under the uploads directory
        as they arrived: loaded from there as a runtime load is (every check of files; read back from there after host
        eviction; loaded again by an engine restart). Its directory goes if it is refused. -> (ADD or REPLACE, the
        load's revision)"""
        request = p.LoadLoRAAdapterRequest(lora_name=upload.name, lora_path="(upload)", pinned=upload.pinned,
                                           load_inplace=upload.load_inplace)
        source = self.registry.get(upload.name)
        path = upload.path
        try:
            # refused before the engine reads anything: the base model's name, a loaded name without load_inplace
            kind = load_kind(request, request.lora_path, self.model_name, source.path if source else None)
            revision = await self.load_adapter(upload.name, path, upload.pinned, replace=kind == REPLACE,
                                               allowed_dirs=(self.uploads.root,))
        except BaseException:
            discard(path)
            raise
        self.uploads.keep(upload.name, path)
        return kind, revision

    async def _install_resolved(self, name: str, found) -> None:
        """An adapter a resolver found (on_demand.py), read under the rule of the resolver's directories."""
        try:
            await self.load_adapter(name, found.path, pinned=False, allowed_dirs=found.allowed_dirs, resolved=True,
                                    uri=found.uri)
        except HTTPError as e:
            if e.code != "adapter_exists" or name not in self.registry:  # else: loaded meanwhile by the admin route
                raise

    async def unload_adapter(self, name: str) -> None:
        """Answered once the engine has freed the adapter, after the requests running on it; the engine drops
        the name at once (requests for it that have not started get 404). It leaves the registry when the
        engine answers, unless a new load of the name came meanwhile (a new identity: it stays)."""
        source = self.registry.get(name)
        if source is None:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error")
        result = await self._control(UnloadAdapter(0, name))
        if self.registry.get(name) is source:
            self.registry.remove(name)
            if self.uploads is not None:
                self.uploads.forget(name)
        if result.status is LoRAStatus.UNLOAD_NAME_NONEXISTENT:
            raise HTTPError(404, result.message, "not_found_error")

    async def pin_adapter(self, name: str, pinned: bool) -> None:
        if name not in self.registry:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error")
        result = await self._control(PinAdapter(0, name, pinned))
        if result.status is LoRAStatus.LOAD_BUSY:
            raise HTTPError(503, result.message, "service_unavailable", "adapter_busy", {"Retry-After": "5"})
        if result.status is not LoRAStatus.SUCCESS:
            raise HTTPError(400, result.message)
        self.registry.set_pinned(name, result.pinned)

    def set_alias(self, name: str, targets: dict) -> Alias:
        """A weighted alias (aliases.py), replacing one of that name: 400 for a bad one, or for a target that
        is neither the base model nor a loaded adapter (or a revision of one)."""
        try:
            alias = make_alias(name, targets)
        except ValueError as e:
            raise HTTPError(400, str(e), code="invalid_alias") from e
        if name == self.model_name:
            raise HTTPError(400, f"'{name}' is the base model's name; an alias cannot take it", code="invalid_alias")
        unknown = [t for t, _ in alias.targets if t != self.model_name and target_name(t) not in self.registry]
        if unknown:
            raise HTTPError(400, f"alias {name!r}: no adapter is loaded for {', '.join(map(repr, unknown))}",
                            code="invalid_alias")
        self.aliases.set(alias)
        return alias

    async def kept_revisions(self) -> dict[str, list[str]]:
        """name -> its earlier revisions the engine keeps (name@rev), asked between its steps; none to ask for
        with --lora-keep-revisions 1."""
        if self.keep_revisions == 1:
            return {}
        return (await self.client.stats(timeout=30)).revisions

    async def reset_prefix_cache(self) -> None:
        self.require_engine()
        await self._control(ResetPrefixCache(0))

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """vLLM's /pause (wire.Pause says what each mode does); mode "wait" returns once the requests in flight
        have finished. HTTPError 409 if a /resume came first."""
        self.require_engine()
        if not (await self._control(Pause(0, mode, clear_cache))).paused:
            raise HTTPError(409, "the engine was resumed before the requests in flight had finished", "conflict")

    async def resume(self) -> None:
        self.require_engine()
        await self._control(Resume(0))

    async def is_paused(self) -> bool:
        """Asked of the engine, not remembered here."""
        self.require_engine()
        return (await self.client.stats()).paused

    async def _control(self, msg):
        try:
            return await self.client.control(msg)
        except ControlError as e:
            raise HTTPError(500, f"the engine failed on this request: {e}", "server_error") from e

    # ---- metrics ------------------------------------------------------------------------------------
    async def render_metrics(self) -> bytes:
        stats = None
        if self.client.health() is None:
            try:
                stats = await self.client.stats(timeout=2.0)
            except (EngineDeadError, ControlError, asyncio.TimeoutError):
                stats = None
        self.metrics.engine_healthy.set(self.health() is None)
        self.metrics.engine_restarts.set(self.client.restarts)
        self.metrics.frontend_restarts.set(self.restarts)
        return self.metrics.render(stats, self.admission)


def work_tokens(request: AddRequest) -> int:
    """What an engine request may cost, in tokens, as admission counts it: its prompt (weighed as the scheduler
    weighs its chunks when its prompt logprobs are asked for) and max_tokens. The n choices of a request are n
    engine requests."""
    weight = PROMPT_LOGPROBS_WEIGHT if request.params.prompt_logprobs is not None else 1
    return weight * len(request.prompt_token_ids) + request.params.max_tokens


async def until_disconnected(raw: Request, work, poll_s: float = 0.5):
    """Run `work` and return what it returns; cancel it if the client disconnects first (Starlette does not,
    for a plain response)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if not done and await raw.is_disconnected():
                task.cancel()
                break
        return await task
    except asyncio.CancelledError:
        if not task.done():
            task.cancel()
        raise
    finally:
        if not task.done():
            task.cancel()


__all__ = ["APIServer", "HTTPError", "ShuttingDown"]
