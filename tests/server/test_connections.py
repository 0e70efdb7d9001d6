"""The front end's connection bounds (server/http/connections.py): idle connections past a cap make room for new
ones, a request head that does not come in time closes the connection, and a flood of idle connections leaves
/health and other requests answerable."""
import asyncio
import socket

import httpx
import pytest

from loramux.server.http.connections import ConnectionGuard, default_max_connections
from support.serving import make_files, server_log, start_server, stop, wait_until


class Conn:
    def __init__(self, guard: ConnectionGuard):
        self.guard, self.open = guard, True
        self.transport = self

    def close(self):  # what uvicorn does on transport.close(): connection_lost follows
        if self.open:
            self.open = False
            self.guard.closed(self)


def run(coro):
    return asyncio.run(coro)


def test_past_a_clients_cap_its_oldest_idle_connection_goes_and_busy_ones_stay():
    async def scenario():
        guard = ConnectionGuard(max_connections=100, max_per_client=3, header_timeout_s=60)
        a = [Conn(guard) for _ in range(5)]
        guard.opened(a[0], "10.0.0.1")
        guard.busy(a[0])  # a request runs on it
        for conn in a[1:3]:
            guard.opened(conn, "10.0.0.1")
        other = Conn(guard)
        guard.opened(other, "10.0.0.2")
        guard.opened(a[3], "10.0.0.1")  # fourth: the oldest idle one (a[1]) goes, not the busy a[0]
        assert [c.open for c in a[:4]] == [True, False, True, True] and other.open
        guard.busy(a[2])
        guard.busy(a[3])
        guard.opened(a[4], "10.0.0.1")  # every other one busy: the new one is closed
        assert not a[4].open and guard.per_client["10.0.0.1"] == 3 and guard.total == 4
        guard.done(a[0])  # its response is complete: it is idle again, the first to go
        b = Conn(guard)
        guard.opened(b, "10.0.0.1")
        assert not a[0].open and b.open
        b.close()  # the client goes away while its connection waits for a request
        other.close()
        assert guard.total == 2 and guard.per_client == {"10.0.0.1": 2} and not guard._waiting

    run(scenario())


def test_past_the_total_cap_the_oldest_idle_connection_of_anyone_goes():
    async def scenario():
        guard = ConnectionGuard(max_connections=3, max_per_client=10, header_timeout_s=60)
        conns = [Conn(guard) for _ in range(4)]
        for i, conn in enumerate(conns):
            guard.opened(conn, f"10.0.0.{i}")
        assert [c.open for c in conns] == [False, True, True, True] and guard.total == 3 and guard.closed_by_cap == 1

    run(scenario())


def test_a_connection_without_a_request_head_in_time_is_closed_and_a_busy_one_is_not():
    async def scenario():
        guard = ConnectionGuard(max_connections=10, max_per_client=10, header_timeout_s=0.01)
        idle, busy = Conn(guard), Conn(guard)
        guard.opened(idle, "a")
        guard.opened(busy, "a")
        guard.busy(busy)
        while idle.open:  # the timer's state, not a time
            await asyncio.sleep(0.01)
        assert busy.open and guard.closed_by_timeout == 1 and guard.total == 1

    run(scenario())


def test_the_default_cap_is_below_the_file_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_connections() < soft or soft < 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default connection caps (below the file limit, 1,024 per client), the test's file limit raised to its
    hard limit first (the server inherits it); a long header timeout, so that only the caps close idle ones."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    files = make_files(tmp_path_factory)
    proc, url = start_server(files, "--header-timeout", "300")
    yield proc, url
    stop(proc)


def test_a_client_opening_twenty_thousand_idle_connections_leaves_health_and_requests_answerable(server):
    """One client with no key opens as many idle connections as this process may (20,000 at most): past its
    per-client cap its oldest idle ones are closed, and /health and another request are answered."""
    import resource

    proc, url = server
    port = int(url.rsplit(":", 1)[1])
    count = min(20_000, resource.getrlimit(resource.RLIMIT_NOFILE)[0]) - 500  # (the test's own files)
    assert count > 2 * 1024, "this machine's file limit is too low to flood past the per-client cap"
    idle = []
    try:
        for _ in range(count):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        out = httpx.post(f"{url}/v1/completions", json={"model": "s0", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert out.status_code == 200
        wait_until(lambda: "connection cap" in server_log(proc), 60, "the cap's log line")
    finally:
        for s in idle:
            s.close()


def test_a_slow_request_head_is_cut_off(tmp_path_factory):
    files = make_files(tmp_path_factory)
    proc, url = start_server(files, "--header-timeout", "1")
    try:
        s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
        s.settimeout(120)
        assert s.recv(1024) == b""  # closed by the server
        s.close()
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    finally:
        stop(proc)
