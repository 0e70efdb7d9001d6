"""The OpenAI-compatible HTTP front end. No torch: it validates and tokenizes requests, applies chat
templates, turns the engine's tokens into text and streams it; the engine process only steps.

Adapters are addressed as `model`. Runtime adapter admin follows vLLM (/v1/load_lora_adapter,
/v1/unload_lora_adapter) and SGLang (`pinned`), restricted to --allowed-adapter-dir and to safetensors
files. Every refusal uses OpenAI's error layout.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import AsyncIterator

import msgspec
import pydantic
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from loramux.adapters.names import split_revision
from loramux.adapters.remote import is_uri
from loramux.config import EngineConfig, ServerConfig
from loramux.server.http import adapter_admin as admin
from loramux.server.http import protocol as p
from loramux.server.http import responses
from loramux.server.http import tools
from loramux.server.http.admission import TooBusy
from loramux.server.http.connections import ConnectionGuard, default_max_connections, guarded_protocol
from loramux.server.engine.engine_client import EngineDeadError
from loramux.server.http.errors import HTTPError, model_not_found
from loramux.server.http.aliases import target_name
from loramux.server.http.api_server import APIServer, ShuttingDown, client_of, tenant_of, until_disconnected
from loramux.server.http.tenants import Tenants, allows, check_admin, check_use, load_dirs
from loramux.logprobs import Logprobs
from loramux.server.http.choices import Choice, new_choices, run_choices
from loramux.server.engine.wire import PauseMode
from loramux.server.http.logprobs import merge_completion

VERSION = "0.1.0"
logger = logging.getLogger("loramux.server")


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a body passes the limit; an HTTPException so that FastAPI's body parsing
    lets it through instead of turning it into "There was an error parsing the body"."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


class BodyLimit:
    """ASGI middleware: counts a request's body as it arrives, so that a chunked body (no Content-Length)
    is held to the limit too; one with a Content-Length over it is refused before anything is read."""

    def __init__(self, app, limit: int, upload_limit: int = 0):
        """upload_limit: an adapter upload's (multipart, to /v1/load_lora_adapter), where it is higher."""
        self.app, self.limit, self.upload_limit = app, limit, upload_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        limit = self.limit
        if scope["path"] == "/v1/load_lora_adapter" and headers.get(b"content-type", b"").startswith(b"multipart/"):
            limit = max(limit, self.upload_limit)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            message = f"the request body is {int(length)} bytes; the limit is {limit}"
            return await error_response(413, message)(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)


def error_response(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(message, err_type, code), status_code=status, headers=headers)


def build_app(engine_config: EngineConfig, config: ServerConfig | None = None, lora_modules: list[str] = (),
              state_file: str | None = None, restarts: int = 0) -> FastAPI:
    """state_file: where the adapter registry is kept for a front end that replaces this one (restarts: how
    many did, for loramux:frontend_restarts); see server/supervisor.py."""
    server = APIServer(engine_config, config or ServerConfig(), list(lora_modules), state_file, restarts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The engine starts in the background: /health answers 503 with the reason until it is up.
        starting = asyncio.create_task(server.start())
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # (not in the main thread: tests)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.reload_tenants)
        starting.add_done_callback(lambda task: _started(app, task))
        try:
            yield
        finally:
            starting.cancel()
            await server.stop()

    app = FastAPI(title="loramux", version=VERSION, lifespan=lifespan)
    app.state.server = server
    _add_middleware(app, server)
    _add_error_handlers(app)
    _add_generation_routes(app, server)
    _add_model_routes(app, server)
    _add_admin_routes(app, server)
    _add_alias_routes(app, server)
    _add_responses_route(app, server)
    _add_embeddings_route(app, server)
    _add_pause_routes(app, server)
    return app


def _started(app: FastAPI, task: asyncio.Task) -> None:
    """The engine's first start ended: a failure stops the server (exit code 3, as if it never started)."""
    if task.cancelled() or task.exception() is None:
        return
    logger.error("the engine failed to start: %s", task.exception())
    app.state.start_failed = True
    uvicorn_server = getattr(app.state, "uvicorn", None)
    if uvicorn_server is not None:
        uvicorn_server.should_exit = True


def run_server(app: FastAPI, config: ServerConfig, log_level: str, sockets=None) -> int:
    """Serve `app` with uvicorn until stopped; the exit code (3: the engine never started)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # SIGTERM: new requests are refused and running ones get shutdown_timeout to finish (uvicorn waits
            # for their connections); a second signal exits at once
            loop = getattr(self, "_loop", None)
            if loop is not None and not self.should_exit:
                loop.call_soon_threadsafe(app.state.server.begin_drain)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a drained shutdown is a clean exit (0), not a death by the signal

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

    guard = ConnectionGuard(config.max_connections or default_max_connections(), config.max_connections_per_client,
                            config.header_timeout)
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                   timeout_graceful_shutdown=int(config.shutdown_timeout) + 5,
                                   http=guarded_protocol(guard)))
    app.state.uvicorn = server
    server.run(sockets=sockets)
    return 3 if not server.started or getattr(app.state, "start_failed", False) else 0


class Auth:
    """ASGI middleware: who a request is, decided once, at the boundary, into `scope["state"]["tenant"]` (read
    with tenant_of). With an API key or tenants set, every path but /health needs `Authorization: Bearer <key>`:
    the operator's key (tenant None, allowed everything) or a tenant's (server/http/tenants.py); else 401. Without
    either, every request is the operator's. Keys are compared in constant time and never logged. (Plain ASGI,
    not Starlette's BaseHTTPMiddleware, which hides a client's disconnect from the route.)

    tenants(): the tenants now (a SIGHUP reload swaps them). public: paths answered without a key as /health is
    (ServerConfig.public_metrics: /metrics)."""

    def __init__(self, app, key: str | None, tenants=lambda: Tenants(), public: frozenset[str] = frozenset()):
        self.app, self.tenants = app, tenants
        self.expected = None if key is None else f"Bearer {key}".encode()
        self.public = frozenset({"/health", *public})

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            tenants = self.tenants()
            if (self.expected is not None or tenants.enabled) and scope["path"] not in self.public:
                sent = dict(scope["headers"]).get(b"authorization", b"")
                operator = self.expected is not None and hmac.compare_digest(sent, self.expected)
                tenant = None
                if tenants.enabled and not operator and sent.startswith(b"Bearer "):
                    tenant = tenants.find(sent[7:].decode("utf-8", "replace"))
                if not operator and tenant is None:
                    response = error_response(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                      "authentication_error", "invalid_api_key")
                    return await response(scope, receive, send)
                scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def public_paths(config) -> frozenset[str]:
    """The paths answered without a key besides /health (Auth)."""
    return frozenset({"/metrics"}) if config.public_metrics else frozenset()


def _add_middleware(app: FastAPI, server: APIServer) -> None:
    app.add_middleware(BodyLimit, limit=server.config.max_body_bytes, upload_limit=server.config.max_adapter_upload_bytes)
    # added last, so it runs first: 401 before 413
    app.add_middleware(Auth, key=server.config.api_key, tenants=lambda: server.tenants,
                       public=public_paths(server.config))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BodyTooLarge)
    async def too_large(_, e: BodyTooLarge):
        return error_response(413, e.detail)

    @app.exception_handler(HTTPError)
    async def http_error(_, e: HTTPError):
        return error_response(e.status_code, e.message, e.err_type, e.code, e.headers)

    @app.exception_handler(TooBusy)
    async def too_busy(_, e: TooBusy):
        return error_response(429, str(e), "rate_limit_exceeded", "server_busy", {"Retry-After": str(e.retry_after)})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, e: EngineDeadError):
        return error_response(503, f"The engine is not available: {e}", "service_unavailable", None, {"Retry-After": "5"})

    @app.exception_handler(ShuttingDown)
    async def shutting_down(_, e: ShuttingDown):
        return error_response(503, str(e), "service_unavailable", None, {"Connection": "close"})

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        details = "; ".join(f"{'.'.join(str(x) for x in err['loc'][1:]) or 'body'}: {err['msg']}" for err in e.errors())
        return error_response(400, f"invalid request: {details}")

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(_, e: StarletteHTTPException):  # unknown routes, wrong methods, unparsable bodies
        err_type = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), err_type, None, getattr(e, "headers", None))


# ---- generation ---------------------------------------------------------------------------------------
def _add_generation_routes(app: FastAPI, server: APIServer) -> None:
    @app.post("/v1/completions")
    async def completions(request: p.CompletionRequest, raw: Request):
        requests = await server.engine_requests(request, chat=False, client=client_of(raw), tenant=tenant_of(raw))
        chunks = CompletionChunks(request, p.new_id("cmpl"), server)
        if request.stream:
            return await _sse(server, raw, requests, chunks)
        choices = await server.complete(requests, raw, discard=chunks.discard)

        def answer() -> dict:
            body = [chunks.choice(c) for c in choices]
            return p.completion_response(chunks.rid, request.model, body, *_usage(choices, request.n))

        return await _whole(choices, answer)

    @app.post("/v1/chat/completions")
    async def chat(request: p.ChatCompletionRequest, raw: Request):
        requests = await server.engine_requests(request, chat=True, client=client_of(raw), tenant=tenant_of(raw))
        chunks = ChatChunks(request, p.new_id("chatcmpl"), server)
        if request.stream:
            return await _sse(server, raw, requests, chunks)
        choices = await server.complete(requests, raw)

        def answer() -> dict:
            body = [chunks.choice(c) for c in choices]
            response = p.chat_response(chunks.rid, request.model, body, *_usage(choices, request.n))
            if request.prompt_logprobs is not None:  # vLLM's place for them in a chat response
                response["prompt_logprobs"] = server.logprobs.vllm_prompt(choices[0].prompt_logprobs or Logprobs(),
                                                                          request.skip_special_tokens)
            return response

        return await _whole(choices, answer)


def _add_responses_route(app: FastAPI, server: APIServer) -> None:
    @app.post("/v1/responses")
    async def create_response(request: responses.ResponsesRequest, raw: Request):
        """OpenAI's Responses API as one chat completion (server/http/responses.py)."""
        refused = request.refused()
        if refused:
            raise HTTPError(400, refused, code=refused.split(":")[0])
        try:
            chat = request.to_chat()
        except (ValueError, pydantic.ValidationError) as e:
            raise HTTPError(400, str(e)) from e
        requests = await server.engine_requests(chat, chat=True, client=client_of(raw), tenant=tenant_of(raw))
        events = ResponseEvents(request, chat, responses.new_id("resp"), server)
        if request.stream:
            return await _sse(server, raw, requests, events)
        choices = await server.complete(requests, raw)

        def answer() -> dict:
            choice = events.chat.choice(choices[0])
            status, why = responses.outcome(choice["finish_reason"])
            return responses.response(request, events.rid, responses.output_of(choice, request.wants_logprobs), status,
                                      responses.usage(*_usage(choices, 1)), why)

        return await _whole(choices, answer)


def _add_embeddings_route(app: FastAPI, server: APIServer) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(request: p.EmbeddingRequest, raw: Request):
        """OpenAI's embeddings per adapter: each input's pooled hidden state (SamplingParams.pooling)."""
        requests = await server.embedding_requests(request, client_of(raw), tenant_of(raw))
        choices = await server.complete(requests, raw)
        vectors = [c.embedding for c in choices]
        if request.dimensions is not None and request.dimensions != len(vectors[0]):
            raise HTTPError(400, f"dimensions: this model's embeddings have {len(vectors[0])} dimensions, and they "
                                 "cannot be shortened (the model was not trained for it)", code="dimensions")
        return await _whole(choices, lambda: p.embedding_list(request.model, vectors, request.encoding_format,
                                                              sum(c.prompt_tokens for c in choices)))


REVISION_HEADER = "x-adapter-revision"


async def _whole(choices: list[Choice], answer) -> Response:
    """A whole (non-streamed) answer, built off the event loop by answer(); it and its header name the adapter
    load that produced it."""
    fingerprint = _fingerprint(c.revision for c in choices)
    return await json_off_the_loop(lambda: {**answer(), "system_fingerprint": fingerprint},
                                   _revision_header(fingerprint))


def _fingerprint(revisions) -> str | None:
    """OpenAI's system_fingerprint: the adapter load that answered, name@rev (several, comma-separated, if a
    reload in place came between a request's prompts); None for the base model."""
    return ",".join(sorted({r for r in revisions if r})) or None


def _revision_header(fingerprint: str | None) -> dict:
    return {REVISION_HEADER: fingerprint} if fingerprint else {}


async def json_off_the_loop(answer, headers: dict | None = None) -> Response:
    """A whole response, built and encoded in a worker thread: with logprobs of long prompts it is megabytes
    of JSON, and the event loop must keep serving every other client meanwhile. Encoded by msgspec: an encoder
    holds the GIL until it is done (the loop with it), and json.dumps holds it ~12x as long (an echo of 4,051
    prompt tokens with 20 logprobs each: 40 ms against 3.3 ms)."""
    def encode() -> bytes:
        return msgspec.json.encode(answer())

    return Response(await run_in_threadpool(encode), media_type="application/json", headers=headers)


def _usage(choices: list[Choice], n: int) -> tuple[int, int, int]:
    """(prompt tokens, completion tokens, cached prompt tokens); the prompt of a request with n choices counts
    once (its first choice's cache hit with it)."""
    firsts = choices[::n]
    return (sum(c.prompt_tokens for c in firsts), sum(c.num_tokens for c in choices),
            sum(c.cached_tokens for c in firsts))


class _Chunks:
    """How one endpoint writes its answer: a stream's first events, one per (choice, delta), a usage event."""

    discard = False

    def __init__(self, request, rid: str, server: APIServer):
        self.request, self.rid, self.formatter = request, rid, server.logprobs

    done = "data: [DONE]\n\n"  # after the last event

    def start(self, choices: list[Choice]) -> list[dict]:
        return []

    def usage(self, choices: list[Choice]) -> dict | None:
        if not self.request.include_usage:
            return None
        return {**self.chunk_head(), "choices": [], "usage": p.usage(*_usage(choices, self.request.n))}

    def tail(self, choices: list[Choice], error: dict | None) -> list[dict]:
        """The events after the choices' own: the error, else the usage (if asked for)."""
        if error is not None:
            return [error]
        usage = self.usage(choices)
        return [usage] if usage is not None else []

    def encode(self, data: dict, fingerprint: str | None) -> str:
        """One SSE event; chunks carry the revision that answered (system_fingerprint), as OpenAI's do."""
        return _sse_event({**data, "system_fingerprint": fingerprint} if "choices" in data else data)


class CompletionChunks(_Chunks):
    """/v1/completions: echo puts the prompt (text and, with logprobs, its logprobs) before the completion;
    echo with max_tokens 0 returns the prompt alone (the engine's one token is discarded)."""

    def __init__(self, request: p.CompletionRequest, rid: str, server: APIServer):
        super().__init__(request, rid, server)
        self.prompts, self.tokenizer = request.prompts(), server.tokenizer
        self.discard = request.echo and request.max_tokens == 0
        self._offsets: dict[int, int] = {}  # streaming: choice -> text offset of its next token (after its first event)

    def chunk_head(self) -> dict:
        return {"id": self.rid, "object": "text_completion", "model": self.request.model}

    def prompt_text(self, choice: Choice) -> str:
        prompt = self.prompts[choice.index // self.request.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=False)

    def choice(self, c: Choice) -> dict:
        """A whole (non-streamed) choice."""
        prompt = self.prompt_text(c) if self.request.echo else ""
        return p.completion_choice(c.index, prompt + c.text, c.finish_reason, self._logprobs(c, True, c.logprobs, 0),
                                   self._prompt_logprobs(c))

    def delta(self, choice: Choice, text: str) -> list[dict]:
        """A stream's event: the first one of a choice carries the echoed prompt and the prompt's logprobs."""
        new, first = choice.unsent_logprobs(), choice.index not in self._offsets
        if not (text or first or new is not None or choice.finish_reason is not None):
            return []
        prompt = self.prompt_text(choice) if self.request.echo and first else ""
        logprobs = self._logprobs(choice, first, new, self._offsets.get(choice.index, 0))
        if logprobs is not None and logprobs["tokens"]:  # the next event's tokens start where these end
            self._offsets[choice.index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        else:
            self._offsets.setdefault(choice.index, 0)
        body = p.completion_choice(choice.index, prompt + text, choice.finish_reason, logprobs,
                                   self._prompt_logprobs(choice) if first else None)
        return [p.completion_chunk(self.rid, self.request.model, body)]

    def _logprobs(self, c: Choice, with_prompt: bool, lp: Logprobs | None, offset: int) -> dict | None:
        """The legacy logprobs of `lp`'s tokens, after the prompt's when echoed (with_prompt). Offsets count
        the tokens' own texts from `offset`."""
        if self.request.logprobs is None:
            return None
        skip = self.request.skip_special_tokens
        parts = []
        if with_prompt and self.request.echo:
            first_token = c.request.prompt_token_ids[0]
            parts.append(self.formatter.completion(c.prompt_logprobs or Logprobs(), offset, skip, first_token,
                                                   self.request.logprobs))
            offset = parts[0]["text_offset"][-1] + len(parts[0]["tokens"][-1])
        parts.append(self.formatter.completion(lp or Logprobs(), offset, skip))
        return merge_completion(parts)

    def _prompt_logprobs(self, c: Choice) -> list | None:
        if self.request.prompt_logprobs is None:
            return None
        return self.formatter.vllm_prompt(c.prompt_logprobs or Logprobs(), self.request.skip_special_tokens,
                                          self.request.prompt_logprobs)


class ChatChunks(_Chunks):
    """/v1/chat/completions: with tools, a choice's text is parsed into tool calls (server.tools); streamed,
    the calls come in one delta at the end of the choice, after its content."""

    def __init__(self, request: p.ChatCompletionRequest, rid: str, server: APIServer):
        super().__init__(request, rid, server)
        self.mode = request.tool_mode
        self._tools: dict[int, tools.ToolStream] = {}

    def chunk_head(self) -> dict:
        return {"id": self.rid, "object": "chat.completion.chunk", "model": self.request.model}

    def logprobs(self, lp: Logprobs | None) -> list | None:
        if not self.request.logprobs:
            return None
        return self.formatter.chat(lp or Logprobs(), self.request.skip_special_tokens)

    def choice(self, c: Choice) -> dict:
        """A whole (non-streamed) choice."""
        request = self.request
        content, calls = (tools.parse(self.mode, c.text, request.tool_choice, request.parallel_tool_calls)
                          if self.mode != "none" else (c.text, []))
        return p.chat_choice(c.index, content, tools.finish_reason(self.mode, calls, c.finish_reason),
                             self.logprobs(c.logprobs), calls)

    def start(self, choices: list[Choice]) -> list[dict]:
        return [p.chat_chunk(self.rid, self.request.model, c.index, {"role": "assistant", "content": ""}, None)
                for c in choices]

    def delta(self, choice: Choice, text: str) -> list[dict]:
        stream = self._tools.get(choice.index)
        if stream is None:
            stream = self._tools[choice.index] = tools.ToolStream(self.mode, self.request.tool_choice,
                                                                  self.request.parallel_tool_calls)
        content = stream.feed(text) + (stream.finish() if choice.finish_reason is not None else "")
        new, events = choice.unsent_logprobs(), []
        if content or new is not None:
            events.append(p.chat_chunk(self.rid, self.request.model, choice.index, {"content": content}, None,
                                       self.logprobs(new) if new is not None else None))
        if stream.calls:
            calls = [{"index": i, **call} for i, call in enumerate(stream.calls)]
            events.append(p.chat_chunk(self.rid, self.request.model, choice.index, {"tool_calls": calls}, None))
        if choice.finish_reason is not None:
            reason = tools.finish_reason(self.mode, stream.calls, choice.finish_reason)
            events.append(p.chat_chunk(self.rid, self.request.model, choice.index, {}, reason))
        return events


class ResponseEvents(_Chunks):
    """/v1/responses, streamed: the chat choice's chunks (ChatChunks: content as it comes, tool calls at the end)
    become the Responses event sequence: created, in_progress, the message item (added, its text part's deltas,
    done), one function_call item per call, then completed (or incomplete, or failed) with the whole response."""

    done = ""  # (the Responses stream ends with its last event)

    def __init__(self, request: responses.ResponsesRequest, chat: p.ChatCompletionRequest, rid: str,
                 server: APIServer):
        super().__init__(request, rid, server)
        self.chat = ChatChunks(chat, p.new_id("chatcmpl"), server)
        self.output: list[dict] = []
        self.message_id: str | None = None  # the message item being streamed, its text and logprobs so far
        self.text, self.logprobs = "", []
        self.finish_reason: str | None = None
        self._sequence = 0

    def start(self, choices: list[Choice]) -> list[dict]:
        head = responses.response(self.request, self.rid, [], "in_progress", None)
        return [{"type": "response.created", "response": head}, {"type": "response.in_progress", "response": head}]

    def delta(self, choice: Choice, text: str) -> list[dict]:
        events = []
        for chunk in self.chat.delta(choice, text):
            delta, reason = chunk["choices"][0]["delta"], chunk["choices"][0]["finish_reason"]
            if delta.get("content"):
                events += self._text(delta["content"], (chunk["choices"][0]["logprobs"] or {}).get("content"))
            for call in delta.get("tool_calls", []):
                events += self._close_message() + self._call(call)
            if reason is not None:
                self.finish_reason = reason
                events += self._close_message()
        return events

    def _text(self, text: str, logprobs: list | None) -> list[dict]:
        events = []
        if self.message_id is None:
            self.message_id, self.text, self.logprobs = responses.new_id("msg"), "", []
            events += [self._item("response.output_item.added", responses.message_item(self.message_id, "", "in_progress")),
                       {**self._part(), "type": "response.content_part.added",
                        "part": {"type": "output_text", "text": "", "annotations": []}}]
        self.text += text
        self.logprobs += logprobs or []
        return events + [{**self._part(), "type": "response.output_text.delta", "delta": text, "logprobs": logprobs or []}]

    def _close_message(self) -> list[dict]:
        if self.message_id is None:
            return []
        item = responses.message_item(self.message_id, self.text,
                                      logprobs=self.logprobs if self.request.wants_logprobs else None)
        part = {**self._part(), "part": item["content"][0]}
        self.message_id = None
        self.output.append(item)
        return [{**part, "type": "response.output_text.done", "text": self.text, "logprobs": self.logprobs},
                {**part, "type": "response.content_part.done"},
                self._item("response.output_item.done", item, len(self.output) - 1)]

    def _call(self, call: dict) -> list[dict]:
        item = responses.call_item(call)
        added = {**item, "arguments": "", "status": "in_progress"}
        where = {"item_id": item["id"], "output_index": len(self.output)}
        self.output.append(item)
        return [self._item("response.output_item.added", added, len(self.output) - 1),
                {**where, "type": "response.function_call_arguments.delta", "delta": item["arguments"]},
                {**where, "type": "response.function_call_arguments.done", "arguments": item["arguments"]},
                self._item("response.output_item.done", item, len(self.output) - 1)]

    def _item(self, kind: str, item: dict, index: int | None = None) -> dict:
        return {"type": kind, "output_index": len(self.output) if index is None else index, "item": item}

    def _part(self) -> dict:
        """Where the streamed message's text part is (it is the next output item until it is closed)."""
        return {"item_id": self.message_id, "output_index": len(self.output), "content_index": 0}

    def tail(self, choices: list[Choice], error: dict | None) -> list[dict]:
        use = responses.usage(*_usage(choices, 1))
        if error is not None:
            failed = {**responses.response(self.request, self.rid, self.output, "failed", use),
                      "error": {"code": error["error"].get("code") or "server_error",
                                "message": error["error"]["message"]}}
            return [{"type": "response.failed", "response": failed}]
        status, why = responses.outcome(self.finish_reason)
        body = responses.response(self.request, self.rid, self.output, status, use, why)
        return [{"type": f"response.{status}", "response": body}]

    def encode(self, data: dict, fingerprint: str | None) -> str:
        """`event: <type>` and its data, numbered in order (sequence_number), as OpenAI's stream is."""
        if "response" in data:
            data = {**data, "response": {**data["response"], "system_fingerprint": fingerprint}}
        event = {**data, "sequence_number": self._sequence}
        self._sequence += 1
        return f"event: {data['type']}\n{_sse_event(event)}"


async def _sse(server: APIServer, raw: Request, requests, chunks: _Chunks) -> StreamingResponse:
    """Admission, the engine requests and their first output happen before the response starts: a refusal
    (the adapter unloaded before the request started: 404, as a plain request gets) is a plain HTTP error.
    After that, an error ends the stream with finish_reason "error" (or "abort") on every unfinished choice,
    then an error event, then [DONE]."""
    ticket = server.admit(requests, raw)
    stream = None
    try:
        stream = await server.client.generate(requests)
        first = await until_disconnected(raw, _refused_before_start(stream))
    except BaseException:
        if stream is not None:
            await stream.close()
        server.release(ticket, None)
        raise
    choices = new_choices(requests, server.tokenizer, chunks.discard)
    timers = server.timers(choices)
    fingerprint = first.revision if first is not None else None  # (every event carries it, as OpenAI's chunks)

    def _event(data: dict) -> str:
        return chunks.encode(data, fingerprint)

    async def body() -> AsyncIterator[str]:
        error = None
        try:
            for event in chunks.start(choices):
                yield _event(event)
            async for choice, text in run_choices(stream, choices, server.admission.generated):
                timers[choice.index].update(choice)
                for event in chunks.delta(choice, text):
                    yield _event(event)
            error = _choice_error(choices)
        except (EngineDeadError, ShuttingDown) as e:
            error = p.error_body(f"The engine is not available: {e}" if isinstance(e, EngineDeadError) else str(e),
                                 "service_unavailable")
            reason = "abort" if isinstance(e, ShuttingDown) else "error"
            for choice in choices:
                if choice.finish_reason is None:
                    choice.finish_reason = reason
                    for event in chunks.delta(choice, ""):
                        yield _event(event)
        finally:
            await stream.close()
            server.release(ticket, choices)
        for event in chunks.tail(choices, error):
            yield _event(event)
        yield chunks.done

    return StreamingResponse(body(), media_type="text/event-stream", headers=_revision_header(fingerprint))


async def _refused_before_start(stream):
    """The engine's first output for these requests (None if the stream ended); HTTPError if it refuses one (it
    never started)."""
    first = await stream.peek()
    if first is not None and first.finish_reason == "error" and first.status and not first.new_token_ids:
        raise HTTPError(first.status, first.error or "the request was refused",
                        "not_found_error" if first.status == 404 else "invalid_request_error")
    return first


def _sse_event(data: dict) -> str:
    return f"data: {msgspec.json.encode(data).decode()}\n\n"


def _choice_error(choices: list[Choice]) -> dict | None:
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is None:
        return None
    return p.error_body(failed.error or "the request failed", "invalid_request_error" if failed.status in (400, 404)
                        else "server_error")


# ---- models and tokens ----------------------------------------------------------------------------------
def _add_model_routes(app: FastAPI, server: APIServer) -> None:
    """/v1/models (one or all), and vLLM's /tokenize and /detokenize."""
    @app.get("/v1/models")
    async def models(raw: Request):
        server.require_engine()
        allowed = allows(tenant_of(raw))
        base = p.model_card(server.model_name, server.model_root, None, server.max_model_len)
        adapters = [(name, source.uri or source.path) for name, source in server.registry.items() if allowed(name)]
        revisions = await server.kept_revisions()
        cards = [card for name, path in adapters for card in p.adapter_cards(name, path, server.model_name,
                                                                           revisions.get(name, ()))]
        cards += [p.model_card(a.name, ",".join(t for t, _ in a.targets), server.model_name)
                  for a in server.aliases.all() if a.name not in server.registry and allowed(a.name)]
        show_base = allowed(server.model_name)  # a tenant sees the base model only where its patterns list it
        return await json_off_the_loop(lambda: p.model_list(base if show_base else None, cards))

    @app.get("/v1/models/{model_id:path}")  # adapter names may hold "/" (org/adapter)
    async def model(model_id: str, raw: Request):
        server.require_engine()
        revision = split_revision(model_id) if model_id not in server.registry else None
        name = revision[0] if revision else model_id
        check_use(tenant_of(raw), name)
        if model_id == server.model_name:
            return p.model_card(server.model_name, server.model_root, None, server.max_model_len)
        if (alias := server.aliases.get(model_id)) is not None and model_id not in server.registry:
            return p.model_card(model_id, ",".join(t for t, _ in alias.targets), server.model_name)
        if name in server.registry:
            source = server.registry[name]
            cards = p.adapter_cards(name, source.uri or source.path, server.model_name,
                                    (await server.kept_revisions()).get(name, ()))
            card = next((c for c in cards if c["id"] == model_id), None)
            if card is not None:
                return card
        raise model_not_found(model_id)

    @app.post("/tokenize")
    async def tokenize(request: p.TokenizeRequest, raw: Request):
        """vLLM's: a prompt, or chat messages through the chat template, to token ids."""
        ids = await server.tokenize(request, tenant_of(raw))
        strs = [server.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: p.DetokenizeRequest, raw: Request):
        return {"prompt": await server.detokenize(request, tenant_of(raw))}


# ---- admin --------------------------------------------------------------------------------------------
def _add_pause_routes(app: FastAPI, server: APIServer) -> None:
    """vLLM's /pause, /resume and /is_paused (what each mode does: wire.Pause, docs/server.md)."""
    @app.post("/pause")
    async def pause(raw: Request, mode: PauseMode = "abort", clear_cache: bool = True):
        check_admin(tenant_of(raw))
        await server.pause(mode, clear_cache)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume(raw: Request):
        check_admin(tenant_of(raw))
        await server.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(raw: Request):
        check_admin(tenant_of(raw))
        return {"is_paused": await server.is_paused()}


async def _load_from_path(server: APIServer, request: p.LoadLoRAAdapterRequest, tenant) -> Response:
    """A runtime load from a directory under --allowed-adapter-dir (or the tenant's adapter_dir), or from a store
    under --allowed-adapter-uri (the operator's only)."""
    name = admin.checked_name(request.lora_name)
    check_admin(tenant, name)
    if is_uri(request.lora_path):
        if tenant is not None:
            raise HTTPError(403, "loads from a URI are the operator's (--allowed-adapter-uri); a tenant loads from its "
                                 "adapter_dir", "permission_error")
        kind, revision = await server.load_from_uri(request)
        return admin.loaded(name, kind, _revision_header(revision))
    dirs = load_dirs(tenant, server.config.allowed_adapter_dirs)
    path = admin.allowed_adapter_path(dirs, request.lora_path)
    source = server.registry.get(name)
    kind = admin.load_kind(request, path, server.model_name, source.path if source else None)
    revision = await server.load_adapter(name, path, request.pinned, replace=kind == admin.REPLACE,
                                         allowed_dirs=None if tenant is None else dirs, again=kind == admin.AGAIN)
    return admin.loaded(name, kind, _revision_header(revision))


def _add_alias_routes(app: FastAPI, server: APIServer) -> None:
    """Weighted aliases (server/http/aliases.py): set or replace one, list them, remove one. Admin routes: a tenant
    needs `admin` and the alias's name and every target's adapter in its patterns."""
    @app.post("/v1/lora_aliases")
    async def set_alias(request: p.LoRAAliasRequest, raw: Request):
        tenant = tenant_of(raw)
        for name in (request.name, *map(target_name, request.targets)):
            check_admin(tenant, name)
        alias = server.set_alias(request.name, request.targets)
        return p.alias_card(alias.name, alias.targets)

    @app.get("/v1/lora_aliases")
    async def list_aliases(raw: Request):
        allowed = allows(tenant_of(raw))
        return {"object": "list", "data": [p.alias_card(a.name, a.targets) for a in server.aliases.all()
                                           if allowed(a.name)]}

    @app.delete("/v1/lora_aliases/{name:path}")
    async def remove_alias(name: str, raw: Request):
        check_admin(tenant_of(raw), name)
        if not server.aliases.remove(name):
            raise HTTPError(404, f"no alias named {name!r}", "not_found_error")
        return {"name": name, "deleted": True}


def _add_admin_routes(app: FastAPI, server: APIServer) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load(raw: Request):
        """vLLM's JSON body ({lora_name, lora_path, load_inplace}; SGLang's pinned), or the adapter's files in
        the body (multipart: lora_name, load_inplace, pinned, and the adapter_config.json and
        adapter_model.safetensors parts; server/http/uploads.py)."""
        if raw.headers.get("content-type", "").startswith("multipart/form-data"):
            tenant = tenant_of(raw)
            upload = await admin.upload_form(raw, server.config.max_adapter_upload_bytes, server.uploads,
                                             lambda name: check_admin(tenant, name))
            kind, revision = await server.upload_adapter(upload)
            return admin.loaded(upload.name, kind, _revision_header(revision))
        return await _load_from_path(server, await admin.load_request(raw), tenant_of(raw))

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: p.UnloadLoRAAdapterRequest, raw: Request):
        name = admin.unload_name(request)
        check_admin(tenant_of(raw), name)
        await server.unload_adapter(name)
        return admin.removed(name)

    @app.post("/v1/pin_lora_adapter")
    async def pin(request: p.PinLoRAAdapterRequest, raw: Request):
        check_admin(tenant_of(raw), request.lora_name)
        await server.pin_adapter(request.lora_name, True)
        return admin.pinned(request.lora_name, True)

    @app.post("/v1/unpin_lora_adapter")
    async def unpin(request: p.PinLoRAAdapterRequest, raw: Request):
        check_admin(tenant_of(raw), request.lora_name)
        await server.pin_adapter(request.lora_name, False)
        return admin.pinned(request.lora_name, False)

    @app.get("/health")
    async def health():
        problem = server.health()
        if problem:
            return error_response(503, f"The engine is not available: {problem}", "service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request):
        """vLLM's route: forget every cached prefix block (requests running keep theirs)."""
        check_admin(tenant_of(raw))
        await server.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics(raw: Request):
        if not server.config.public_metrics:
            check_admin(tenant_of(raw))  # every tenant's adapter names are in it
        return Response(await server.render_metrics(), media_type="text/plain; version=0.0.4")
