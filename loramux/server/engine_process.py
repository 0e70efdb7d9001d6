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
import shutil
import signal
import sys
import threading
import time
import traceback

import zmq

from loramux.adapters.cache import name_of
from loramux.config import EngineConfig
from loramux.server.wire import (Abort, AddRequest, AdapterSource, Control, ControlResult, Outputs, Ready,
                                 StartupFailed, decode_to_engine, encode)

logger = logging.getLogger("loramux.engine")
IDLE_POLL_MS = 50  # an idle engine blocks this long on its inbox at most (a message wakes it at once)
HEARTBEAT_S = 0.25


def run_engine(config: EngineConfig, adapters: list[AdapterSource], ipc_dir: str, heartbeat, parent_pid: int) -> None:
    """Child process entry point: build the engine, then serve until told to stop or the parent goes away."""
    _live_with_parent(parent_pid, ipc_dir, heartbeat)
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(f"ipc://{ipc_dir}/to_engine")
    outbox.connect(f"ipc://{ipc_dir}/from_engine")
    try:
        loop = EngineLoop(_build_engine(config), outbox)
        outbox.send(encode(loop.ready(adapters, os.path.join(ipc_dir, "tokenizer"))))
    except Exception as e:
        logger.error("the engine failed to start: %s", traceback.format_exc())
        outbox.send(encode(StartupFailed(f"{type(e).__name__}: {e}")))
        outbox.close(linger=2000)  # let the message reach the front end before the process ends
        raise SystemExit(1) from e
    try:
        while True:
            if inbox.poll(0 if loop.busy else IDLE_POLL_MS):
                while inbox.poll(0):
                    loop.handle(decode_to_engine(inbox.recv()))
            loop.step()
    except SystemExit:  # SIGTERM: the front end stops us, or the parent died
        ctx.destroy(linger=0)


def _live_with_parent(parent_pid: int, ipc_dir: str, heartbeat) -> None:
    """Exit on SIGTERM (and with the parent: Linux sends SIGTERM when it dies), ignore SIGINT (a Ctrl-C
    reaches the whole process group; the parent decides), and beat while alive."""
    def stop(*_):
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

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


def _build_engine(config: EngineConfig):
    from loramux.engine.engine_core import EngineCore

    return EngineCore(config)


class EngineLoop:
    """Dispatches messages and steps the core. Unloads of adapters in use wait here for their running
    requests; meanwhile the adapter takes no new requests."""

    def __init__(self, core, outbox):
        self.core, self.outbox = core, outbox
        self.unloading: dict[str, list[int]] = {}  # adapter -> control ids waiting for its unload
        self._pending: list = []  # outputs of refused requests, sent with the next step's

    @property
    def busy(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self.unloading) or bool(self._pending)

    def ready(self, adapters: list[AdapterSource], tokenizer_dir: str) -> Ready:
        """Load the start-up adapters (a failing one is reported, not fatal after a restart) and describe the
        engine; saves the tokenizer for the front end."""
        self.core.hf_tokenizer.save_pretrained(tokenizer_dir)
        loaded, failed = [], {}
        for source in adapters:
            result = self._load(source)
            (loaded.append(source) if result else failed.__setitem__(source.name, result.message))
        limits = self.core.limits
        return Ready(self.core.model_name, tokenizer_dir, limits.max_model_len, limits.vocab_size, loaded, failed)

    def _load(self, source: AdapterSource):
        return self.core.load_adapter(source.name, source.path, allowed_dirs=source.allowed_dirs, pinned=source.pinned)

    def handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, Abort):
            for request_id in msg.request_ids:
                self.core.abort_request(request_id)
        elif isinstance(msg, Control):
            self._control(msg)

    def step(self) -> None:
        self._retry_unloads()
        outputs, self._pending = self._pending, []
        if self.core.has_unfinished_requests():
            outputs += self.core.step()
        if outputs:
            self.outbox.send(encode(Outputs(outputs)))

    # ---- generation ------------------------------------------------------------------------------
    def _add(self, msg: AddRequest) -> None:
        from loramux.engine.output import CoreOutput

        try:
            if msg.adapter in self.unloading:
                raise LookupError(f"The model `{msg.adapter}` does not exist.")
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.adapter)
        except LookupError as e:
            self._pending.append(CoreOutput(msg.request_id, [], "error", str(e).strip("'\""), 404))
        except ValueError as e:
            self._pending.append(CoreOutput(msg.request_id, [], "error", str(e), 400))
        except Exception as e:  # a bad request must never take the engine down
            logger.error("request %s failed: %s", msg.request_id, traceback.format_exc())
            self._pending.append(CoreOutput(msg.request_id, [], "error", f"{type(e).__name__}: {e}", 500))

    # ---- control ------------------------------------------------------------------------------
    def _control(self, msg: Control) -> None:
        try:
            handler = getattr(self, f"_op_{msg.op}")
            result = handler(msg, **msg.args)
        except Exception as e:
            logger.error("control %s failed: %s", msg.op, traceback.format_exc())
            result = {"status": "ERROR", "message": f"{type(e).__name__}: {e}"}
        if result is not None:  # None: answered later (an unload waiting for running requests)
            self.outbox.send(encode(ControlResult(msg.control_id, result)))

    @staticmethod
    def _status(result) -> dict:
        return {"status": result.status.name, "message": result.message}

    def _op_load(self, msg, name: str, path: str, allowed_dirs: list[str] = (), pinned: bool = False,
                 replace: bool = False) -> dict:
        if name in self.unloading:
            return {"status": "LOAD_NAME_EXISTS", "message": f"adapter {name!r} is still being unloaded"}
        # name and path stay apart (a name is never parsed as "name=path"); runtime loads: safetensors only,
        # every file inside the allowed directories
        return self._status(self.core.load_adapter(name, path, allow_pickle=False, allowed_dirs=tuple(allowed_dirs),
                                                   replace=replace, pinned=pinned))

    def _op_pin(self, msg, name: str) -> dict:
        return self._status(self.core.pin_adapter(name))

    def _op_unpin(self, msg, name: str) -> dict:
        return self._status(self.core.lora_manager.unpin_adapter(name))

    def _op_unload(self, msg, name: str) -> dict | None:
        if self.core.manager is None or not self.core.manager.is_lora(name):
            return {"status": "UNLOAD_NAME_NONEXISTENT", "message": f"no adapter named {name!r} is loaded"}
        self._fail_waiting(name)
        self.unloading.setdefault(name, []).append(msg.control_id)
        self._retry_unloads()
        return None

    def _op_list(self, msg) -> dict:
        manager = self.core.manager
        return {"status": "SUCCESS", "adapters": manager.paths if manager else {}}

    def _op_stats(self, msg) -> dict:
        core, scheduler = self.core, self.core.scheduler
        manager = core.manager
        return {
            "status": "SUCCESS", "num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
            "running_adapters": sorted({name_of(k) for k in scheduler.running_adapters()}),
            "waiting_adapters": sorted(scheduler.waiting_adapters()),
            "max_loras": core.config.max_loras, "lora": dict(manager.stats) if manager else {},
            "num_adapters": len(manager.loras) if manager else 0,
            "pinned": sorted(name_of(k) for k in manager.cache.pinned) if manager else [],
            "kv_blocks_total": core.block_manager.num_blocks, "kv_blocks_free": core.block_manager.num_free_blocks,
            "weight_bytes": core.runner.weight_bytes,
            "lora_slot_bytes": manager.slot_bytes if manager else 0,
            "lora_host_bytes": manager.cache.host_bytes if manager else 0,
            "finished": dict(core.num_finished),
        }

    def _fail_waiting(self, adapter: str) -> None:
        """Requests for `adapter` that have not started yet fail now; started ones (running, or preempted
        and waiting to resume) finish first."""
        from loramux.engine.output import CoreOutput

        for seq in [s for s in self.core.scheduler.waiting if s.adapter == adapter and s.num_output_tokens == 0]:
            self.core.abort_request(seq.request_id)
            self._pending.append(CoreOutput(seq.request_id, [], "error", f"The model `{adapter}` was unloaded.", 404))

    def _retry_unloads(self) -> None:
        for name in list(self.unloading):
            result = self.core.unload_adapter(name)
            if result.status.name == "UNLOAD_IN_USE":
                continue
            for control_id in self.unloading.pop(name):
                self.outbox.send(encode(ControlResult(control_id, self._status(result))))
