"""EngineClient: the HTTP process's handle on the engine process (spawned, then spoken to over ZMQ).

Outputs are routed to one asyncio queue per request. A watchdog notices when the engine process
dies; from then on every pending and new request fails at once with EngineDeadError (HTTP 503).
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import shutil
import tempfile
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from loramux.config import EngineConfig
from loramux.server.engine_process import run_engine
from loramux.server.ipc import (Abort, Control, ControlResult, Generate, Outputs, Ready, RequestFailed,
                                StartupFailed)

WATCHDOG_INTERVAL_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing can be generated."""


class RequestError(Exception):
    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class EngineClient:
    def __init__(self, config: EngineConfig, lora_modules: list[str] = ()):
        self.config = config
        self.lora_modules = list(lora_modules)
        self.process: multiprocessing.Process | None = None
        self.dead_reason: str | None = None
        self.ready: Ready | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._controls: dict[int, asyncio.Future] = {}
        self._control_ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, timeout: float) -> Ready:
        """Spawn the engine and wait until its model is loaded (or it fails, or time runs out)."""
        self._dir = tempfile.mkdtemp(prefix="loramux-ipc-")
        to_engine, from_engine = f"ipc://{self._dir}/to_engine", f"ipc://{self._dir}/from_engine"
        self._ctx = zmq.asyncio.Context()
        self._send_sock, self._recv_sock = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._send_sock.bind(to_engine)
        self._recv_sock.bind(from_engine)
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch/zmq state
        self.process = spawn.Process(target=run_engine, name="loramux-engine", daemon=True,
                                     args=(self.config, self.lora_modules, to_engine, from_engine))
        self.process.start()
        self.ready = await self._first_message(timeout)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        return self.ready

    async def _first_message(self, timeout: float) -> Ready:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if await self._recv_sock.poll(200):
                msg = await self._recv_sock.recv_pyobj()
                if isinstance(msg, StartupFailed):
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
                return msg
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.process.exitcode})")
        raise TimeoutError(f"the engine did not start within {timeout:.0f} s")

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.process is not None and self.process.is_alive()

    # ---- background tasks ---------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            msg = await self._recv_sock.recv_pyobj()
            if isinstance(msg, Outputs):
                for output in msg.outputs:
                    self._deliver(output["request_id"], output)
            elif isinstance(msg, RequestFailed):
                self._deliver(msg.request_id, RequestError(msg.message, msg.status_code))
            elif isinstance(msg, ControlResult):
                future = self._controls.pop(msg.control_id, None)
                if future is not None and not future.done():
                    future.set_result(msg.result)

    def _deliver(self, request_id: str, item) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    async def _watch(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        self._die(f"the engine process exited (code {self.process.exitcode})")

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(reason))
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._controls.clear()

    # ---- requests ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError(self.dead_reason or "the engine process is not running")

    async def generate(self, request: Generate) -> AsyncIterator[dict]:
        """Yield the request's outputs (RequestOutput fields) until it finishes. Leaving early aborts it."""
        self._check_alive()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request.request_id] = queue
        finished = False
        try:
            await self._send_sock.send_pyobj(request)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                if item.get("error"):
                    finished = True
                    raise RequestError(item["error"], 500)
                finished = item["finish_reason"] is not None
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished and self.alive:
                await self._send_sock.send_pyobj(Abort(request.request_id))

    async def control(self, op: str, **args) -> dict:
        """Run a control request between engine steps; returns its result dict."""
        self._check_alive()
        control_id = next(self._control_ids)
        future = asyncio.get_running_loop().create_future()
        self._controls[control_id] = future
        await self._send_sock.send_pyobj(Control(control_id, op, args))
        return await future
