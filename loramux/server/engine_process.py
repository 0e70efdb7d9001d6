"""The engine's own process: receive requests over ZMQ, step the engine, send outputs back.

Only `run_engine` (called in the child) imports torch and the model; this module's top level stays
torch-free so the HTTP process can name it as the child's entry point.
"""
from __future__ import annotations

import dataclasses
import logging
import traceback

import zmq

from loramux.config import EngineConfig
from loramux.server.ipc import (Abort, Control, ControlResult, Generate, Outputs, Ready, RequestFailed,
                                StartupFailed)

logger = logging.getLogger("loramux.engine")
IDLE_POLL_MS = 50


def run_engine(config: EngineConfig, lora_modules: list[str], inbox_addr: str, outbox_addr: str) -> None:
    """Child process entry point: build the engine, then serve until the parent goes away."""
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(inbox_addr)
    outbox.connect(outbox_addr)
    try:
        loop = EngineLoop(_build_engine(config, lora_modules), outbox)
    except Exception as e:
        outbox.send_pyobj(StartupFailed(f"{type(e).__name__}: {e}"))
        raise
    outbox.send_pyobj(loop.ready())
    while True:
        busy = loop.busy
        if inbox.poll(0 if busy else IDLE_POLL_MS):
            while inbox.poll(0):
                loop.handle(inbox.recv_pyobj())
        loop.step()


def _build_engine(config: EngineConfig, lora_modules: list[str]):
    from loramux.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    for spec in lora_modules:
        result = engine.load_adapter(spec)
        if not result:
            raise ValueError(f"--lora-modules {spec}: {result.message}")
    return engine


class EngineLoop:
    """Dispatches messages and steps the engine. Unloads of adapters in use wait here for their
    running requests; meanwhile the adapter takes no new requests."""

    def __init__(self, engine, outbox):
        self.engine, self.outbox = engine, outbox
        self.unloading: dict[str, list[int]] = {}  # adapter -> control ids waiting for its unload

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self.unloading)

    def ready(self) -> Ready:
        manager = self.engine.manager
        return Ready(self.engine.model_name, self.engine.max_model_len, manager.paths if manager else {})

    def handle(self, msg) -> None:
        if isinstance(msg, Generate):
            self._generate(msg)
        elif isinstance(msg, Abort):
            self.engine.abort_request(msg.request_id)
        elif isinstance(msg, Control):
            self._control(msg)

    def step(self) -> None:
        self._retry_unloads()
        if not self.engine.has_unfinished_requests():
            return
        outputs = self.engine.step()
        if outputs:
            self.outbox.send_pyobj(Outputs([dataclasses.asdict(o) for o in outputs]))

    # ---- generation ------------------------------------------------------------------------------
    def _generate(self, msg: Generate) -> None:
        try:
            self._add(msg)
        except LookupError as e:
            self.outbox.send_pyobj(RequestFailed(msg.request_id, str(e).strip("'\""), 404))
        except ValueError as e:
            self.outbox.send_pyobj(RequestFailed(msg.request_id, str(e), 400))
        except Exception as e:  # a bad request must never take the engine down
            logger.error("request %s failed: %s", msg.request_id, traceback.format_exc())
            self.outbox.send_pyobj(RequestFailed(msg.request_id, f"{type(e).__name__}: {e}", 500))

    def _add(self, msg: Generate) -> None:
        engine = self.engine
        if msg.adapter is not None and (msg.adapter in self.unloading or engine.manager is None
                                        or not engine.manager.is_lora(msg.adapter)):
            raise LookupError(f"The model `{msg.adapter}` does not exist.")
        token_ids = self._prompt_ids(msg)
        params = msg.params
        if not msg.max_tokens_given:
            params = dataclasses.replace(params, max_tokens=max(1, engine.max_model_len - len(token_ids)))
        if len(token_ids) + params.max_tokens > engine.max_model_len:
            raise ValueError(f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
                             f"requested {len(token_ids) + params.max_tokens} tokens ({len(token_ids)} in the "
                             f"prompt, {params.max_tokens} in the completion).")
        engine.add_request(token_ids, params, msg.adapter, msg.request_id)

    def _prompt_ids(self, msg: Generate) -> list[int]:
        tokenizer = self.engine.tokenizer
        if msg.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("this model has no chat template; use /v1/completions")
            ids = tokenizer.apply_chat_template(msg.messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
            return list(ids)
        prompt = msg.prompt
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = getattr(self.engine.hf_config, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    # ---- control ------------------------------------------------------------------------------
    def _control(self, msg: Control) -> None:
        try:
            handler = getattr(self, f"_op_{msg.op}")
            result = handler(msg, **msg.args)
        except Exception as e:
            logger.error("control %s failed: %s", msg.op, traceback.format_exc())
            result = {"status": "ERROR", "message": f"{type(e).__name__}: {e}"}
        if result is not None:  # None: answered later (an unload waiting for running requests)
            self.outbox.send_pyobj(ControlResult(msg.control_id, result))

    @staticmethod
    def _status(result) -> dict:
        return {"status": result.status.name, "message": result.message}

    def _op_load(self, msg, name: str, path: str, allowed_dirs: tuple[str, ...] = ()) -> dict:
        if name in self.unloading:
            return {"status": "LOAD_NAME_EXISTS", "message": f"adapter {name!r} is still being unloaded"}
        # name and path stay apart (a name is never parsed as "name=path"); runtime loads: safetensors only,
        # every file inside the allowed directories
        return self._status(self.engine.load_adapter(name, path, allow_pickle=False, allowed_dirs=allowed_dirs))

    def _op_pin(self, msg, name: str) -> dict:
        return self._status(self.engine.pin_adapter(name))

    def _op_unload(self, msg, name: str) -> dict | None:
        if self.engine.manager is None or not self.engine.manager.is_lora(name):
            return {"status": "UNLOAD_NAME_NONEXISTENT", "message": f"no adapter named {name!r} is loaded"}
        self._fail_waiting(name)
        self.unloading.setdefault(name, []).append(msg.control_id)
        self._retry_unloads()
        return None

    def _op_list(self, msg) -> dict:
        return {"status": "SUCCESS", "adapters": self.engine.manager.paths if self.engine.manager else {}}

    def _op_stats(self, msg) -> dict:
        engine, scheduler = self.engine, self.engine.scheduler
        manager = engine.manager
        return {
            "status": "SUCCESS", "num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
            "running_adapters": sorted(scheduler.running_adapters()),
            "waiting_adapters": sorted(scheduler.waiting_adapters()),
            "max_loras": engine.config.max_loras, "lora": dict(manager.stats) if manager else {},
            "num_adapters": len(manager.loras) if manager else 0,
            "kv_blocks_total": engine.block_manager.num_blocks, "kv_blocks_free": engine.block_manager.num_free_blocks,
        }

    def _fail_waiting(self, adapter: str) -> None:
        """Requests for `adapter` that have not started yet fail now; started ones (running, or preempted
        and waiting to resume) finish first."""
        waiting = self.engine.scheduler.waiting
        for seq in [s for s in waiting if s.adapter == adapter and s.num_output_tokens == 0]:
            self.engine.abort_request(seq.request_id)
            self.outbox.send_pyobj(RequestFailed(seq.request_id, f"The model `{adapter}` was unloaded.", 404))

    def _retry_unloads(self) -> None:
        for name in list(self.unloading):
            result = self.engine.unload_adapter(name)
            if result.status.name == "UNLOAD_IN_USE":
                continue
            for control_id in self.unloading.pop(name):
                self.outbox.send_pyobj(ControlResult(control_id, self._status(result)))
