"""EngineClient: the HTTP process's handle on the engine process — it spawns it, supervises it, and routes
its outputs to the requests that wait for them.

Supervision: the engine writes a heartbeat (shared memory) every 0.25 s. No beat for `unresponsive_s` makes
the engine unhealthy (/health answers 503); none for `kill_s` (frozen) gets it killed. When the engine
process dies, every request in flight fails at once with EngineDeadError (HTTP 503), and a new engine is
started with bounded exponential backoff, loading the adapters the front end had registered (and paused if
the engine it replaces was: the pause is the operator's, not the engine's). Each engine gets fresh sockets in
a fresh IPC directory, so nothing sent to a dead engine reaches its successor.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from loramux.config import EngineConfig
from loramux.engine.output import CoreOutput
from loramux.server.engine import prctl
from loramux.server.engine.engine_process import run_engine
from loramux.server.engine.wire import (Abort, AddRequest, AdapterResult, AdapterRecord, Control, ControlAnswer,
                                 ControlFailed, EngineStats, GetStats, Outputs, Pause, PauseState, PrefixCacheReset,
                                 Ready, StartupFailed, decode_from_engine, encode)

logger = logging.getLogger("loramux.server")
WATCH_INTERVAL_S = 0.1


class EngineDeadError(RuntimeError):
    """The engine is not available (it died and is restarting, or it is stopping); nothing can be generated."""


class ControlError(RuntimeError):
    """A control request failed inside the engine (a bug: the engine reported it and carries on)."""


@dataclass(frozen=True)
class Supervision:
    start_timeout_s: float = 600.0
    unresponsive_s: float = 5.0
    """No heartbeat for this long: /health says the engine is not responding."""
    kill_s: float = 30.0
    """No heartbeat for this long: the engine is frozen; it is killed and restarted."""
    restart_backoff_s: tuple[float, float] = (0.5, 30.0)
    """First and longest wait before a restart; doubled after every failed start."""


class EngineProcess:
    """One engine process with its sockets, IPC directory and heartbeat."""

    def __init__(self, config: EngineConfig, adapters: list[AdapterRecord]):
        self.dir = tempfile.mkdtemp(prefix="loramux-ipc-")
        self.ctx = zmq.asyncio.Context()
        self.send_sock, self.recv_sock = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        self.send_sock.bind(f"ipc://{self.dir}/to_engine")
        self.recv_sock.bind(f"ipc://{self.dir}/from_engine")
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch/zmq state
        self.heartbeat = spawn.Value("d", time.monotonic(), lock=False)
        log_level = logging.getLogger("loramux").level  # the front end's --log-level (0: not set here)
        self.process = spawn.Process(target=run_engine, name="loramux-engine", daemon=True,
                                     args=(config, adapters, self.dir, self.heartbeat, os.getpid(), log_level))
        self.process.start()

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat.value

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: the engine exits at once (it holds nothing worth saving)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)  # a stopped engine (SIGSTOP) takes its SIGTERM now
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
        self.process.join(1)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


class OutputStream:
    """The outputs of a group of engine requests (the choices of one HTTP request), in arrival order."""

    def __init__(self, client: EngineClient, request_ids: list[str]):
        self.client, self.queue = client, asyncio.Queue()
        self.open_ids = set(request_ids)
        self._head: CoreOutput | None = None  # read by peek, not yet by iteration

    def __aiter__(self):
        return self

    async def peek(self) -> CoreOutput | None:
        """The next output, which iteration then yields too (None: there is none)."""
        if self._head is None:
            try:
                self._head = await self.__anext__()
            except StopAsyncIteration:
                return None
        return self._head

    async def __anext__(self) -> CoreOutput:
        if self._head is not None:
            head, self._head = self._head, None
            return head
        while self.open_ids:
            item = await self.queue.get()
            if isinstance(item, Exception):
                self.open_ids.clear()
                raise item
            if item.request_id not in self.open_ids:
                continue  # cancelled: what the engine made before it heard so was queued already
            if item.finish_reason is not None:
                self.finished(item.request_id)
            return item
        raise StopAsyncIteration

    def finished(self, request_id: str) -> None:
        self.open_ids.discard(request_id)
        self.client._streams.pop(request_id, None)

    async def cancel(self, request_ids: list[str]) -> None:
        """Stop these requests in the engine (a stop string found, the client gone); later outputs are dropped."""
        live = [r for r in request_ids if r in self.open_ids]
        for request_id in live:
            self.finished(request_id)
        await self.client.abort(live)

    async def close(self) -> None:
        await self.cancel(list(self.open_ids))


class EngineClient:
    def __init__(self, config: EngineConfig, sources: Callable[[], list[AdapterRecord]],
                 on_ready: Callable[[Ready], None], supervision: Supervision = Supervision()):
        """sources(): the adapters an engine (re)start loads; on_ready(ready): told after every (re)start."""
        self.config, self.sources, self.on_ready, self.supervision = config, sources, on_ready, supervision
        self.engine: EngineProcess | None = None
        self.ready: Ready | None = None
        self.dead_reason: str | None = "the engine is starting (loading the model and the adapters)"
        self.restarts = 0
        self.stopping = False
        self.paused = False  # as the last Pause / Resume the engine answered left it
        self._streams: dict[str, asyncio.Queue] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> Ready:
        """Spawn the first engine and wait until its model is loaded (or it fails, or time runs out)."""
        await self._spawn()
        self._tasks.append(asyncio.create_task(self._watch()))
        return self.ready

    async def _spawn(self) -> None:
        engine = EngineProcess(self.config, self.sources())
        try:
            ready = await self._first_message(engine)
            if self.paused:  # before anything else reaches it (its answer's id, -1, is no control's)
                await engine.send_sock.send(encode(Pause(-1, "keep", clear_cache=False)))
        except BaseException:
            engine.close()
            raise
        self.engine, self.ready, self.dead_reason = engine, ready, None
        self._tasks.append(asyncio.create_task(self._read(engine)))
        self.on_ready(ready)

    async def _first_message(self, engine: EngineProcess) -> Ready:
        deadline = time.monotonic() + self.supervision.start_timeout_s
        while time.monotonic() < deadline:
            if await engine.recv_sock.poll(200):
                msg = decode_from_engine(await engine.recv_sock.recv())
                if isinstance(msg, StartupFailed):
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
                return msg
            if not engine.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {engine.process.exitcode})")
        raise TimeoutError(f"the engine did not start within {self.supervision.start_timeout_s:.0f} s")

    async def shutdown(self) -> None:
        self.stopping = True
        for task in self._tasks:
            task.cancel()
        self._lost("the server is shutting down")
        if self.engine is not None:
            self.engine.close()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.engine is not None and self.engine.process.is_alive()

    def health(self) -> str | None:
        """None when healthy, else why not (dead, restarting, or no heartbeat). Read off the process itself,
        not the watcher's last look: a killed engine is reported before the watcher or waitpid sees it gone."""
        if not self.alive or prctl.exiting(self.engine.process.pid):
            return self.dead_reason or "the engine process is not running"
        age = self.engine.heartbeat_age()
        if age > self.supervision.unresponsive_s:
            return f"the engine has not responded for {age:.0f} s"
        return None

    # ---- supervision ---------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while not self.stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            engine = self.engine
            if engine is None or self.dead_reason is not None:
                continue
            if not engine.process.is_alive():
                self._lost(f"the engine process exited (code {engine.process.exitcode})")
                await self._restart()
            elif engine.heartbeat_age() > self.supervision.kill_s:
                logger.error("the engine sent no heartbeat for %.0f s; killing it", engine.heartbeat_age())
                engine.process.kill()

    def fail_in_flight(self, error: Exception) -> None:
        """End every request waiting on the engine with `error` (their later outputs are dropped)."""
        for queue in set(self._streams.values()):
            queue.put_nowait(error)
        self._streams.clear()

    def _lost(self, reason: str) -> None:
        """Fail everything in flight: no output of a lost engine will come."""
        if self._streams:
            logger.error("%s; failing %d requests in flight", reason, len(self._streams))
        self.dead_reason = reason
        error = EngineDeadError(reason)
        self.fail_in_flight(error)
        for future in self._controls.values():
            if not future.done():
                future.set_exception(error)
        self._controls.clear()

    async def _restart(self) -> None:
        delay, longest = self.supervision.restart_backoff_s
        old, self.engine = self.engine, None
        if old is not None:
            old.close()
        while not self.stopping:
            self.dead_reason = f"the engine is restarting (restart {self.restarts + 1})"
            await asyncio.sleep(delay)
            try:
                await self._spawn()
            except Exception as e:
                logger.error("engine restart failed: %s", e)
                delay = min(2 * delay, longest)
                continue
            self.restarts += 1
            logger.warning("the engine is back (restart %d)", self.restarts)
            return

    async def _read(self, engine: EngineProcess) -> None:
        try:
            while True:
                self._route(decode_from_engine(await engine.recv_sock.recv()))
        except zmq.ZMQError:  # the engine's sockets were closed: it is gone, and the watcher knows
            return

    def _route(self, msg) -> None:
        if isinstance(msg, Outputs):
            for output in msg.outputs:
                queue = self._streams.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
        elif isinstance(msg, (AdapterResult, EngineStats, PrefixCacheReset, PauseState, ControlFailed)):
            future = self._controls.pop(msg.control_id, None)
            if future is not None and not future.done():
                future.set_result(msg)

    # ---- requests ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")

    async def generate(self, requests: list[AddRequest]) -> OutputStream:
        """Send the requests; their outputs arrive on the returned stream (close it to abort the rest)."""
        self._check_alive()
        messages = [encode(request) for request in requests]  # first: one that cannot be encoded registers nothing
        stream = OutputStream(self, [r.request_id for r in requests])
        for request in requests:
            self._streams[request.request_id] = stream.queue
        for message in messages:
            await self.engine.send_sock.send(message)
        return stream

    async def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.pop(request_id, None)
        if request_ids and self.alive:
            await self.engine.send_sock.send(encode(Abort(request_ids)))

    async def control(self, msg: Control, timeout: float | None = None) -> ControlAnswer:
        """Run a control request between engine steps (its control_id is set here); its answer. TimeoutError
        after `timeout`; ControlError if the engine failed on it."""
        self._check_alive()
        msg = msgspec.structs.replace(msg, control_id=next(self._ids))
        future = asyncio.get_running_loop().create_future()
        self._controls[msg.control_id] = future
        await self.engine.send_sock.send(encode(msg))
        try:
            answer = await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(msg.control_id, None)
        if isinstance(answer, ControlFailed):
            raise ControlError(answer.message)
        if isinstance(answer, PauseState):
            self.paused = answer.paused
        return answer

    async def stats(self, timeout: float | None = None) -> EngineStats:
        return await self.control(GetStats(0), timeout)
