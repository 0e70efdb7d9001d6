"""The OpenAI-compatible HTTP front end. No torch: generation happens in the engine process.

Adapters are addressed as `model`. Runtime adapter admin follows vLLM (/v1/load_lora_adapter,
/v1/unload_lora_adapter), restricted to --allowed-adapter-dir and to safetensors files.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from loramux.adapters.names import InvalidAdapterNameError, check_adapter_name
from loramux.config import EngineConfig, ServerConfig
from loramux.server import protocol as p
from loramux.server.engine_client import EngineClient, EngineDeadError, RequestError
from loramux.server.ipc import Generate
from loramux.server.metrics import Metrics

VERSION = "0.1.0"


class HTTPError(Exception):
    def __init__(self, status_code: int, message: str, err_type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.err_type, self.code = status_code, message, err_type, code


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes the limit; an HTTPException so that FastAPI's body parsing
    lets it through instead of turning it into "There was an error parsing the body"."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


class BodyLimit:
    """ASGI middleware: counts a request's body as it arrives, so that a chunked body (no Content-Length)
    is held to the limit too; one with a Content-Length over it is refused before anything is read."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            message = f"the request body is {int(length)} bytes; the limit is {self.limit}"
            return await _error(413, message)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, counted, send)


def _error(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, err_type, code), status_code=status)


class Server:
    """State shared by the routes: the engine client, the served names and the metrics."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, lora_modules: list[str]):
        self.config = config
        self.client = EngineClient(engine_config, lora_modules)
        self.metrics = Metrics()
        self.model_name = ""
        self.model_root = ""
        self.max_model_len = 0
        self.adapters: dict[str, str | None] = {}  # name -> path; the engine's list, kept in step

    async def start(self) -> None:
        ready = await self.client.start(self.config.engine_start_timeout)
        self.model_root, self.max_model_len = ready.model_name, ready.max_model_len
        self.model_name = self.config.served_model_name or os.path.basename(ready.model_name.rstrip("/"))
        self.adapters = dict(ready.adapters)

    def resolve(self, model: str) -> str | None:
        """The adapter a `model` field names (None = the base model); 404 for anything else."""
        if model == self.model_name:
            return None
        if model in self.adapters:
            return model
        raise HTTPError(404, f"The model `{model}` does not exist.", code="model_not_found")

    def check_limits(self, request: p._Request) -> None:
        if not 1 <= request.n <= self.config.max_n:
            raise HTTPError(400, f"n must be between 1 and {self.config.max_n}, got {request.n}", code="n")
        if len(request.stop_list()) > self.config.max_stop:
            raise HTTPError(400, f"at most {self.config.max_stop} stop sequences are allowed", code="stop")

    def generation_requests(self, request: p._Request, prompts: list, chat: bool) -> list[Generate]:
        """One engine request per (prompt, choice); validates every sampling field first."""
        self.check_limits(request)
        adapter = self.resolve(request.model)
        max_tokens = request.max_completion_tokens if chat and request.max_completion_tokens else request.max_tokens
        if max_tokens is None and not chat:
            max_tokens = 16  # OpenAI's default for completions, also when a client sends null
        try:
            params = [request.sampling_params(16 if max_tokens is None else max_tokens, seed_offset=i)
                      for i in range(request.n)]
        except ValueError as e:
            raise HTTPError(400, str(e)) from e
        rid = p.new_id("req")
        return [Generate(f"{rid}-{i}-{j}", adapter, params[j], max_tokens is not None,
                         messages=prompt if chat else None, prompt=None if chat else prompt)
                for i, prompt in enumerate(prompts) for j in range(request.n)]

    async def outputs(self, gen: Generate) -> AsyncIterator[dict]:
        timer = self.metrics.track(gen.adapter or self.model_name)
        async for output in self.client.generate(gen):
            timer.on_output(output)
            yield output

    async def final(self, gen: Generate) -> dict:
        last = None
        async for output in self.outputs(gen):
            last = output
        return last


async def _merge(streams: list[AsyncIterator[dict]]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave several output streams as their items arrive: (stream index, item)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, None))
        except Exception as e:  # surfaced to the consumer, which stops everything
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(p.error_body(str(e), 'service_unavailable'))}\n\n"
        except (RequestError, HTTPError) as e:
            yield f"data: {json.dumps(p.error_body(str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


def _usage_of(outputs: list[dict], n: int) -> tuple[int, int]:
    prompt = sum(len(o["prompt_token_ids"]) for o in outputs[::n])
    return prompt, sum(len(o["token_ids"]) for o in outputs)


def build_app(engine_config: EngineConfig, config: ServerConfig | None = None, lora_modules: list[str] = ()) -> FastAPI:
    server = Server(engine_config, config or ServerConfig(), list(lora_modules))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.client.shutdown()

    app = FastAPI(title="loramux", version=VERSION, lifespan=lifespan)
    app.state.server = server
    _add_middleware(app, server)
    _add_error_handlers(app)
    _add_generation_routes(app, server)
    _add_admin_routes(app, server)
    return app


def _add_middleware(app: FastAPI, server: Server) -> None:
    app.add_middleware(BodyLimit, limit=server.config.max_body_bytes)  # inside the key check: 401 comes first

    @app.middleware("http")
    async def guard(request: Request, call_next):
        key = server.config.api_key
        if key and request.url.path != "/health" and request.headers.get("authorization") != f"Bearer {key}":
            return _error(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                          "authentication_error", "invalid_api_key")
        return await call_next(request)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BodyTooLarge)
    async def too_large(_, e: BodyTooLarge):
        return _error(413, e.detail)

    @app.exception_handler(HTTPError)
    async def http_error(_, e: HTTPError):
        return _error(e.status_code, e.message, e.err_type, e.code)

    @app.exception_handler(RequestError)
    async def request_error(_, e: RequestError):
        return _error(e.status_code, str(e), "not_found_error" if e.status_code == 404 else "invalid_request_error")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return _error(503, f"The engine is not available: {e}", "service_unavailable")

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        details = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:])}: {err['msg']}" for err in e.errors())
        return _error(400, f"invalid request: {details}")


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(request: p.CompletionRequest):
        gens = server.generation_requests(request, request.prompts(), chat=False)
        rid = p.new_id("cmpl")
        if request.stream:
            return _sse(_completion_chunks(server, request, gens, rid))
        outputs = await asyncio.gather(*(server.final(g) for g in gens))
        choices = [p.completion_choice(i, o["text"], o["finish_reason"]) for i, o in enumerate(outputs)]
        return p.completion_response(rid, request.model, choices, *_usage_of(outputs, request.n))

    @app.post("/v1/chat/completions")
    async def chat(request: p.ChatCompletionRequest):
        gens = server.generation_requests(request, [request.messages], chat=True)
        rid = p.new_id("chatcmpl")
        if request.stream:
            return _sse(_chat_chunks(server, request, gens, rid))
        outputs = await asyncio.gather(*(server.final(g) for g in gens))
        choices = [p.chat_choice(i, o["text"], o["finish_reason"]) for i, o in enumerate(outputs)]
        return p.chat_response(rid, request.model, choices, *_usage_of(outputs, request.n))


async def _completion_chunks(server: Server, request, gens, rid) -> AsyncIterator[dict]:
    finals = {}
    async for index, out in _merge([server.outputs(g) for g in gens]):
        if out["delta_text"] or out["finish_reason"]:
            choice = p.completion_choice(index, out["delta_text"], out["finish_reason"])
            yield p.completion_chunk(rid, request.model, choice)
        if out["finish_reason"]:
            finals[index] = out
    if request.include_usage:
        outputs = [finals[i] for i in sorted(finals)]
        yield {"id": rid, "object": "text_completion", "model": request.model, "choices": [],
               "usage": p.usage(*_usage_of(outputs, request.n))}


async def _chat_chunks(server: Server, request, gens, rid) -> AsyncIterator[dict]:
    for index in range(len(gens)):
        yield p.chat_chunk(rid, request.model, index, {"role": "assistant", "content": ""}, None)
    finals = {}
    async for index, out in _merge([server.outputs(g) for g in gens]):
        if out["delta_text"]:
            yield p.chat_chunk(rid, request.model, index, {"content": out["delta_text"]}, None)
        if out["finish_reason"]:
            finals[index] = out
            yield p.chat_chunk(rid, request.model, index, {}, out["finish_reason"])
    if request.include_usage:
        outputs = [finals[i] for i in sorted(finals)]
        yield {"id": rid, "object": "chat.completion.chunk", "model": request.model, "choices": [],
               "usage": p.usage(*_usage_of(outputs, request.n))}


def _add_admin_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models")
    async def models():
        cards = [p.model_card(server.model_name, server.model_root, None, server.max_model_len)]
        cards += [p.model_card(name, path or name, server.model_name) for name, path in server.adapters.items()]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load(request: p.LoadLoRAAdapterRequest):
        name = request.lora_name
        try:
            check_adapter_name(name)
        except InvalidAdapterNameError as e:
            raise HTTPError(400, str(e), code="invalid_adapter_name") from e
        if name == server.model_name or name in server.adapters:
            raise HTTPError(409, f"The lora adapter '{name}' has already been loaded.", code="adapter_exists")
        path = _allowed_adapter_path(server.config, request.lora_path)
        result = await server.client.control("load", name=name, path=path,
                                             allowed_dirs=server.config.allowed_adapter_dirs)
        if result["status"] == "SUCCESS":
            server.adapters[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
        raise HTTPError(409 if result["status"] == "LOAD_NAME_EXISTS" else 400, result["message"])

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: p.UnloadLoRAAdapterRequest):
        name = request.lora_name
        if name not in server.adapters:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error")
        server.adapters.pop(name)  # new requests for it are refused while running ones finish
        result = await server.client.control("unload", name=name)
        if result["status"] != "SUCCESS":
            raise HTTPError(404 if result["status"] == "UNLOAD_NAME_NONEXISTENT" else 400, result["message"])
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/health")
    async def health():
        if not server.client.alive:
            return _error(503, f"The engine is not available: {server.client.dead_reason}", "service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics():
        stats = await server.client.control("stats") if server.client.alive else None
        return Response(server.metrics.render(stats), media_type="text/plain; version=0.0.4")


def _allowed_adapter_path(config: ServerConfig, path: str) -> str:
    """The real path of a runtime-loaded adapter: under an allowed directory, safetensors only."""
    if not config.allowed_adapter_dirs:
        raise HTTPError(400, "runtime adapter loading is off; start the server with --allowed-adapter-dir DIR")
    if "\x00" in path:
        raise HTTPError(400, "lora_path must not contain a NUL byte")
    real = os.path.realpath(path)  # symlinks and `..` resolved before the check
    allowed = [os.path.realpath(d) for d in config.allowed_adapter_dirs]
    if not any(os.path.commonpath([real, d]) == d for d in allowed):
        raise HTTPError(400, f"adapter path {path!r} is outside the allowed adapter directories ({', '.join(allowed)})")
    if not os.path.isfile(os.path.join(real, "adapter_model.safetensors")):
        raise HTTPError(400, f"adapter path {path!r} has no adapter_model.safetensors (only safetensors "
                             "adapters are loaded at run time)")
    return real
