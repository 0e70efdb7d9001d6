"""ConnectionGuard: the front end's connections, bounded. No torch.

uvicorn keeps a connection that never sends a request open for ever, and caps nothing below the process's
file limit: one client that opens ~20,000 idle connections takes every descriptor, and /health and every
other client's requests fail until it lets go. The guard bounds them, per connection and in total:
- a connection whose request head is not complete within `header_timeout_s` of its opening (or of its last
  response) is closed: idle sockets and slow-header (slowloris) clients alike;
- at most `max_per_client` per address and `max_connections` in all (below the file limit): past either, the
  oldest connection that is waiting for a request head (that client's, for its own cap) is closed to make
  room, so a new client's /health and requests get through while the idle ones go; only when every one is
  busy with a request is the new connection closed instead;
- a warning when a cap bites, at most one every LOG_EVERY_S, with counts (a flood must not flood the log).

Hooked into uvicorn's httptools protocol (guarded_protocol): opened at connection_made, busy once a request
head is complete, waiting again when its response is complete, gone at connection_lost.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time

logger = logging.getLogger("loramux.server")
LOG_EVERY_S = 10.0
FD_MARGIN = 512  # descriptors left for the engine's sockets, files and logs


def default_max_connections() -> int:
    """Below the process's soft file limit, with room for everything else the front end opens."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, soft - FD_MARGIN) if soft != resource.RLIM_INFINITY else 65536


class ConnectionGuard:
    def __init__(self, max_connections: int, max_per_client: int, header_timeout_s: float):
        self.max_connections, self.max_per_client, self.header_timeout_s = max_connections, max_per_client, \
            header_timeout_s
        self.total = 0
        self.per_client: collections.Counter[str] = collections.Counter()
        # connections waiting for a request head, oldest first: all, and per client (value: its close timer)
        self._waiting: dict[object, asyncio.TimerHandle] = {}
        self._waiting_of: dict[str, dict[object, None]] = collections.defaultdict(dict)
        self._client: dict[object, str] = {}
        self.closed_by_cap = 0
        self.closed_by_timeout = 0
        self._logged_at = 0.0

    def opened(self, conn, client: str) -> None:
        self.total += 1
        self.per_client[client] += 1
        self._client[conn] = client
        self._wait(conn)
        if self.per_client[client] > self.max_per_client:
            self._make_room(conn, self._waiting_of[client], f"client {client} holds {self.per_client[client] - 1} "
                                                            f"connections (--max-connections-per-client "
                                                            f"{self.max_per_client})")
        elif self.total > self.max_connections:
            self._make_room(conn, self._waiting, f"{self.total - 1} connections are open (--max-connections "
                                                 f"{self.max_connections})")

    def busy(self, conn) -> None:
        """Its request head is complete: no header timeout while the request runs."""
        timer = self._waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()
            self._waiting_of[self._client[conn]].pop(conn, None)

    def done(self, conn) -> None:
        """Its response is complete: it waits for its next request head (uvicorn's keep-alive timeout may close
        it sooner)."""
        if conn in self._client and conn not in self._waiting:
            self._wait(conn)

    def closed(self, conn) -> None:
        if conn not in self._client:
            return
        self.busy(conn)
        client = self._client.pop(conn)
        self.total -= 1
        self.per_client[client] -= 1
        if not self.per_client[client]:
            del self.per_client[client]
            self._waiting_of.pop(client, None)

    def _wait(self, conn) -> None:
        loop = asyncio.get_running_loop()
        self._waiting[conn] = loop.call_later(self.header_timeout_s, self._timed_out, conn)
        self._waiting_of[self._client[conn]][conn] = None

    def _timed_out(self, conn) -> None:
        if conn in self._waiting:
            self.closed_by_timeout += 1
            self._waiting.pop(conn, None)
            self._waiting_of[self._client[conn]].pop(conn, None)
            conn.transport.close()

    def _make_room(self, new, waiting: dict, why: str) -> None:
        """Close the oldest connection in `waiting` other than `new`; `new` itself if there is none."""
        victim = next((c for c in waiting if c is not new), new)
        self.closed_by_cap += 1
        self.busy(victim)
        victim.transport.close()
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            what = "the new connection (every other one is busy with a request)" if victim is new else \
                "the oldest connection waiting for a request"
            logger.warning("connection cap: %s; closed %s (%d closed by caps, %d by the %.0f s header timeout so "
                           "far)", why, what, self.closed_by_cap, self.closed_by_timeout, self.header_timeout_s)


def guarded_protocol(guard: ConnectionGuard) -> type:
    """uvicorn's httptools HTTP protocol, reporting to `guard` (uvicorn.Config(http=...))."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            guard.opened(self, self.client[0] if self.client else "?")

        def connection_lost(self, exc) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            guard.busy(self)
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            guard.done(self)

    return GuardedProtocol
