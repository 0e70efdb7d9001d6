"""The engine's own process: receive requests over ZMQ, step the EngineCore, send new tokens back.

It only steps: prompts arrive as token ids and outputs leave as token ids (the front end tokenizes and
detokenizes). It lives only as long as its parent: a parent-death signal and a heartbeat thread that
watches the parent's pid end it (and remove its IPC directory) when the server is killed, and the heartbeat
it writes lets the front end tell a frozen engine from a busy one. Only `run_engine` (in the child)
imports torch and the model; this module's top level stays torch-free so that the HTTP process can name it
as the child's entry point.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from dataclasses import replace

import zmq

from loramux.config import EngineConfig
from loramux.server.engine import prctl
from loramux.server.engine.wire import (Abort, AddRequest, AdapterResult, AdapterRecord, ControlFailed, EngineStats, GetStats,
                                 LoadAdapter, Outputs, Pause, PauseState, PinAdapter, PrefixCacheReset, Ready,
                                 ResetPrefixCache, Resume, SpecDecodeStats, StartupFailed, UnloadAdapter,
                                 decode_to_engine, encode)

logger = logging.getLogger("loramux.engine")
IDLE_POLL_MS = 50  # an idle engine blocks this long on its inbox at most (a message wakes it at once)
LOAD_POLL_MS = 5  # while adapters are read on the loader thread: their results are installed this often
HEARTBEAT_S = 0.25


def run_engine(config: EngineConfig, adapters: list[AdapterRecord], ipc_dir: str, heartbeat, parent_pid: int,
               log_level: int = 0) -> None:
    """Child process entry point: build the engine, then serve until told to stop or the parent goes away.
    log_level: the front end's (its --log-level): the engine's own lines (the model's weights, the slot memory,
    what was wrapped for the start-up adapters) go to stderr at it too."""
    _live_with_parent(parent_pid, ipc_dir, heartbeat)
    if log_level:
        from loramux.logs import log_to_stderr

        log_to_stderr(logging.getLevelName(log_level).lower())
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(f"ipc://{ipc_dir}/to_engine")
    outbox.connect(f"ipc://{ipc_dir}/from_engine")
    try:
        # the operator's --lora-modules get what they need wrapped; adapters loaded at run time (read again here
        # after a restart, under their directory rules) were loaded without it, and their files are not opened
        # beyond those rules
        operators = tuple(a.path for a in adapters if not a.allowed_dirs and not a.resolved)
        startup = replace(config, startup_adapters=(*config.startup_adapters, *operators))
        loop = EngineCoreProc(_build_engine(startup), outbox)
        outbox.send(encode(loop.ready(adapters, os.path.join(ipc_dir, "tokenizer"))))
    except Exception as e:
        logger.error("the engine failed to start: %s", traceback.format_exc())
        outbox.send(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        outbox.close(linger=2000)  # let the message reach the front end before the process ends
        raise SystemExit(1) from e
    messages = Inbox(inbox, loop.read_ahead)
    prctl.freeze_startup_heap("engine")  # the model and the start-up adapters are in
    try:
        while True:
            for msg in messages.take(loop.poll_ms):
                loop.handle(msg)
            loop.step()
    except SystemExit:  # SIGTERM: the front end stops us, or the parent died
        # (the context is not destroyed: that would close the inbox under its thread; the process ends now)
        logging.shutdown()
        os._exit(0)  # now: the interpreter's teardown (torch's among it) takes ~0.9 s and saves nothing


def _live_with_parent(parent_pid: int, ipc_dir: str, heartbeat) -> None:
    """Exit on SIGTERM (and with the parent: Linux sends SIGTERM when it dies), ignore SIGINT (a Ctrl-C
    reaches the whole process group; the parent decides), and beat while alive."""
    def stop(*_):
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    prctl.die_with_parent(signal.SIGTERM)
    prctl.set_name("loramux-engine")

    def beat():
        while True:
            heartbeat.value = time.monotonic()
            if os.getppid() != parent_pid:  # the parent died before the death signal was set up
                shutil.rmtree(ipc_dir, ignore_errors=True)
                os._exit(0)
            time.sleep(HEARTBEAT_S)

    if os.getppid() != parent_pid:
        stop()
    threading.Thread(target=beat, name="loramux-heartbeat", daemon=True).start()


class Inbox:
    """The engine's messages, received and decoded on a thread of their own, handed to the step loop in arrival
    order between steps (`take`). Why a thread: a load's files start being read the moment it arrives, while a
    step runs, instead of after it (`read_ahead(msg)` is called for each LoadAdapter before it is queued); a
    step is ~50 ms under load. A message that cannot be decoded is raised by `take`, as the loop's own recv did."""

    def __init__(self, socket: zmq.Socket, read_ahead):
        self._socket, self._read_ahead = socket, read_ahead
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: Exception | None = None
        threading.Thread(target=self._receive, name="loramux-inbox", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                msg = decode_to_engine(self._socket.recv())
            except zmq.ContextTerminated:  # the process is ending
                return
            except Exception as e:
                msg = e
            if isinstance(msg, LoadAdapter):
                self._start_reading(msg)
            self._queue.put(msg)

    def _start_reading(self, msg: LoadAdapter) -> None:
        """A read ahead that cannot start costs nothing but its head start: the load reads, and refuses, as ever."""
        try:
            self._read_ahead(msg)
        except Exception:
            logger.warning("load %s: its files could not start being read ahead: %s", msg.name, traceback.format_exc())

    def take(self, timeout_ms: int) -> list:
        """The messages that arrived, waiting up to timeout_ms for the first (0: none). One that could not be
        decoded is raised once those before it have been handed over (at the next take)."""
        if self._failed is not None:
            raise self._failed
        try:
            taken = [self._queue.get(timeout=timeout_ms / 1000) if timeout_ms else self._queue.get_nowait()]
        except queue.Empty:
            return []
        while not isinstance(taken[-1], Exception):
            try:
                taken.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if isinstance(taken[-1], Exception):
            self._failed = taken.pop()
            if not taken:
                raise self._failed
        return taken


def _spec_decode(stats) -> SpecDecodeStats | None:
    """Speculative decoding's counters (engine/speculative.py SpecStats) for /metrics (None: off)."""
    if stats is None:
        return None
    return SpecDecodeStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                           list(stats.accepted_per_pos), {k or "": list(v) for k, v in stats.by_adapter.items()})


def _build_engine(config: EngineConfig):
    from loramux.engine.engine_core import EngineCore

    return EngineCore(config)


class EngineCoreProc:
    """Dispatches messages and steps the core. An unload is answered once the adapter's memory is free
    (after the requests that started on it); meanwhile the name takes no new requests. While paused (wire.Pause)
    no step runs; messages are still handled, and requests that arrive are held until Resume."""

    def __init__(self, core, outbox):
        self.core, self.outbox = core, outbox
        self.unloading: dict = {}  # adapter identity (AdapterRef) -> the UnloadAdapter messages waiting for it
        self.loading: list = []  # (LoadAdapter, the future of its LoRAResult): read off the step loop
        self._pending: list = []  # outputs of refused requests, sent with the next step's
        self.paused = False
        self.pausing: list[Pause] = []  # Pause(wait)s, answered once the requests in flight have finished
        self.held: list[AddRequest] = []  # arrived while paused or pausing: added at Resume, in arrival order
        self._ahead: dict = {}  # control_id -> the read of a LoadAdapter's files, started as it arrived

    @property
    def busy(self) -> bool:
        """Work to step: poll the inbox without waiting. (While paused, neither running requests nor the unloads
        waiting for them can progress.)"""
        stepping = not self.paused and (self.core.has_unfinished_requests() or bool(self.unloading))
        return stepping or bool(self._pending)

    @property
    def poll_ms(self) -> int:
        """How long the loop may wait for a message: not at all while busy, a little while adapters load."""
        return 0 if self.busy else LOAD_POLL_MS if self.loading or self.core.loading else IDLE_POLL_MS

    def ready(self, adapters: list[AdapterRecord], tokenizer_dir: str) -> Ready:
        """Load the start-up adapters (a failing one is reported, not fatal after a restart) and describe the
        engine; saves the tokenizer for the front end."""
        self.core.hf_tokenizer.save_pretrained(tokenizer_dir)
        loaded, failed, seconds = [], {}, {}
        for source in adapters:
            started = time.monotonic()
            result = self.core.adapters.load_adapter(source.name, source.path, allowed_dirs=source.allowed_dirs,
                                                     pinned=source.pinned)
            if result:
                loaded.append(source)
                seconds[source.name] = time.monotonic() - started
            else:
                failed[source.name] = result.message
        limits = self.core.limits
        return Ready(self.core.model_name, tokenizer_dir, limits.max_model_len, limits.vocab_size, loaded, failed,
                     sorted(self.core.eos_token_ids), limits.priority_scheduling, seconds)

    def read_ahead(self, msg: LoadAdapter) -> None:
        """The Inbox thread, as a load arrives (before `handle` takes it): its files start being read now (unless
        the front end expects no read: the loaded name's own path again)."""
        if not msg.read_ahead:
            return
        ahead = self.core.read_ahead(msg.name, msg.path, msg.allowed_dirs)
        if ahead is not None:
            self._ahead[msg.control_id] = ahead

    def handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            if self.paused or self.pausing:
                self.held.append(msg)
            else:
                self._add(msg)
        elif isinstance(msg, Abort):
            aborted = set(msg.request_ids)
            self.held = [m for m in self.held if m.request_id not in aborted]
            for request_id in msg.request_ids:
                self.core.abort_request(request_id)
        else:
            self._control(msg)

    def step(self) -> None:
        self._answer_unloads()
        outputs, self._pending = self._pending, []
        if self.core.loading:  # what the loader has read goes in, and its loads are answered, before the step runs
            outputs += self.core.install_loaded()
            self._answer_loads()
        if self.core.has_unfinished_requests() and not self.paused:
            outputs += self.core.step()
        self._answer_loads()
        self._answer_pauses()
        if outputs:
            self.outbox.send(encode(Outputs(outputs)))

    # ---- generation ------------------------------------------------------------------------------
    def _add(self, msg: AddRequest) -> None:
        from loramux.engine.fair_queue import Origin
        from loramux.engine.output import CoreOutput

        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.adapter,
                                  Origin(msg.tenant, msg.share, msg.weight))
        except LookupError as e:
            self._pending.append(CoreOutput(msg.request_id, [], "error", str(e).strip("'\""), 404))
        except ValueError as e:
            self._pending.append(CoreOutput(msg.request_id, [], "error", str(e), 400))
        except Exception as e:  # a bad request must never take the engine down
            logger.error("request %s failed: %s", msg.request_id, traceback.format_exc())
            self._pending.append(CoreOutput(msg.request_id, [], "error", f"{type(e).__name__}: {e}", 500))

    # ---- control ------------------------------------------------------------------------------
    def _control(self, msg) -> None:
        try:
            answer = self._answer(msg)
        except Exception as e:
            logger.error("control %s failed: %s", type(msg).__name__, traceback.format_exc())
            answer = ControlFailed(msg.control_id, f"{type(e).__name__}: {e}")
        if answer is not None:  # None: answered later (an unload waiting for running requests)
            self.outbox.send(encode(answer))

    def _answer(self, msg):
        core = self.core
        if isinstance(msg, GetStats):
            return self._stats(msg.control_id)
        if isinstance(msg, ResetPrefixCache):
            return PrefixCacheReset(msg.control_id, core.reset_prefix_cache())
        if isinstance(msg, LoadAdapter):  # read on the loader thread; answered once installed (_answer_loads)
            result = core.load_adapter_async(msg.name, msg.path, msg.allowed_dirs, msg.replace, msg.pinned,
                                             self._ahead.pop(msg.control_id, None))
            if result.done():  # nothing to read (the same directory again)
                return self._result(msg.control_id, msg.name, result.result())
            self.loading.append((msg, result))
            return None
        if isinstance(msg, Pause):
            return self._pause(msg)
        if isinstance(msg, Resume):
            return self._resume(msg.control_id)
        if isinstance(msg, PinAdapter):
            result = core.adapters.pin_adapter(msg.name) if msg.pinned else core.adapters.unpin_adapter(msg.name)
        else:
            return self._unload(msg)
        return self._result(msg.control_id, msg.name, result)

    def _result(self, control_id: int, name: str, result) -> AdapterResult:
        pinned = name in self.core.adapters.pinned
        return AdapterResult(control_id, result.status, result.message, pinned, result.revision)

    def _unload(self, msg: UnloadAdapter) -> AdapterResult | None:
        ref = self.core.adapters.current(msg.name)
        if ref is None:
            return self._result(msg.control_id, msg.name, self._no_adapter(msg.name))
        self.unloading.setdefault(ref, []).append((msg, self.core.adapters.unload_adapter(msg.name)))
        self._answer_unloads()
        return None

    @staticmethod
    def _no_adapter(name: str):
        from loramux.adapters.status import LoRAResult, LoRAStatus

        return LoRAResult(LoRAStatus.UNLOAD_NAME_NONEXISTENT, f"no adapter named {name!r} is loaded")

    # ---- pause ---------------------------------------------------------------------------------------------
    def _pause(self, msg: Pause) -> PauseState | None:
        if msg.mode == "abort":
            self._abort_all()
        if msg.mode == "wait" and not self.paused and self.core.has_unfinished_requests():
            self.pausing.append(msg)  # answered by _answer_pauses; meanwhile new requests are held
            return None
        return self._paused(msg)

    def _paused(self, msg: Pause) -> PauseState:
        if not self.paused:
            logger.info("paused (%s)", msg.mode)
        self.paused = True
        if msg.clear_cache:
            self.core.reset_prefix_cache()
        return PauseState(msg.control_id, True)

    def _abort_all(self) -> None:
        """End every request in flight and every held one, each with finish_reason "abort"."""
        from loramux.engine.output import CoreOutput

        request_ids = self.core.abort_all() + [m.request_id for m in self.held]
        self.held = []
        self._pending += [CoreOutput(request_id, [], "abort") for request_id in request_ids]

    def _answer_pauses(self) -> None:
        if self.pausing and not self.core.has_unfinished_requests():
            pauses, self.pausing = self.pausing, []
            for msg in pauses:
                self.outbox.send(encode(self._paused(msg)))

    def _resume(self, control_id: int) -> PauseState:
        """Step again: the kept requests go on, the held ones are added; a Pause(wait) still waiting is answered
        as not paused."""
        if self.paused:
            logger.info("resumed")
        self.paused = False
        for msg in self.pausing:
            self.outbox.send(encode(PauseState(msg.control_id, False)))
        held, self.held, self.pausing = self.held, [], []
        for msg in held:
            self._add(msg)
        return PauseState(control_id, False)

    def _answer_loads(self) -> None:
        for msg, result in [entry for entry in self.loading if entry[1].done()]:
            self.loading.remove((msg, result))
            self.outbox.send(encode(self._result(msg.control_id, msg.name, result.result())))

    def _answer_unloads(self) -> None:
        for ref in [r for r in self.unloading if r not in self.core.adapters]:
            for msg, result in self.unloading.pop(ref):
                self.outbox.send(encode(self._result(msg.control_id, msg.name, result)))

    def _stats(self, control_id: int) -> EngineStats:
        stats = self.core.stats()
        return EngineStats(control_id, **{**stats, "num_waiting": stats["num_waiting"] + len(self.held),
                                          "spec_decode": _spec_decode(stats["spec_decode"])}, paused=self.paused)
