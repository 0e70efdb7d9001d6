"""The API key check (server/http/app.py Auth): 401 without the key, in constant time (hmac.compare_digest)."""
import asyncio
import hmac

from loramux.server.http import app as app_module


def call(middleware, path: str, headers: list) -> int:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "headers": headers, "method": "GET", "query_string": b""}
    asyncio.run(middleware(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


async def ok_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_the_key_is_compared_in_constant_time_and_only_the_right_one_passes(monkeypatch):
    compared, real = [], hmac.compare_digest

    def compare(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare)
    middleware = app_module.Auth(ok_app, "s3cret")
    assert call(middleware, "/v1/models", [(b"authorization", b"Bearer s3cret")]) == 200
    assert call(middleware, "/v1/models", [(b"authorization", b"Bearer s3cre")]) == 401
    assert call(middleware, "/v1/models", []) == 401
    assert call(middleware, "/health", []) == 200  # /health needs no key
    assert compared == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer s3cre", b"Bearer s3cret"), (b"", b"Bearer s3cret")]


def test_public_metrics_need_no_key_and_nothing_else_opens():
    """--public-metrics (for a gateway's endpoint picker, which scrapes without credentials): /metrics answers
    without a key, every other path still needs it."""
    from loramux.config import ServerConfig

    closed = app_module.Auth(ok_app, "s3cret", public=app_module.public_paths(ServerConfig()))
    public = app_module.Auth(ok_app, "s3cret", public=app_module.public_paths(ServerConfig(public_metrics=True)))
    assert call(closed, "/metrics", []) == 401 and call(public, "/metrics", []) == 200
    assert call(public, "/v1/models", []) == 401 and call(public, "/metrics/../v1/models", []) == 401
    assert call(public, "/health", []) == 200
