"""GrammarChecker: the front end checks and compiles each client's structured output in worker processes, so
that no schema, regex, choice list or grammar can crash, freeze or bloat the server, or hold up requests that
have none.

A worker holds the model's tokenizer and does what the engine will do with a new structured output: the
limits (GrammarLimits), llguidance's validation and a full compile with the first mask (which finds an empty
language). Each check has a wall-time limit and each worker an address-space limit; a worker that crashes
(the grammar engine overflowing its stack, say), runs out of memory or time is replaced and the request gets
a 400 saying so. Verdicts are cached by spec, so the same schema sent with every request is checked once.
Messages to and from a worker are msgspec-encoded (no pickle of client data).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import multiprocessing
import os
import signal
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from loramux.config import GrammarLimits
from loramux.sampling_params import StructuredOutputsParams

logger = logging.getLogger("loramux.server")
VERDICTS = 4096  # cached verdicts (spec digest -> None or the error)
STARTUP_S = 120.0  # a worker's start (Python, the tokenizer) at most
_encode = msgspec.msgpack.Encoder().encode
_decode_params = msgspec.msgpack.Decoder(StructuredOutputsParams).decode


@dataclass(frozen=True)
class GrammarSource:
    """What a worker needs to compile as the engine does: the tokenizer and the logits' width."""

    tokenizer_json: str  # tokenizer.json's text
    vocab_size: int
    eos_token_ids: tuple[int, ...]


class GrammarChecker:
    def __init__(self, source: GrammarSource, limits: GrammarLimits, workers: int = 1):
        self.source, self.limits = source, limits
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for _ in range(workers):
            self._idle.put_nowait(_Worker(source, limits))
        self._verdicts: OrderedDict[bytes, str | None] = OrderedDict()
        self.replaced = 0  # workers that crashed or ran out of time (for logs and tests)

    async def check(self, params: StructuredOutputsParams) -> None:
        """ValueError naming the problem (or the limit it ran into) if the engine would refuse `params`."""
        job = _encode(params)
        digest = hashlib.sha256(job).digest()
        if digest not in self._verdicts:
            self._remember(digest, await self._run(job))
        self._verdicts.move_to_end(digest)
        error = self._verdicts[digest]
        if error is not None:
            raise ValueError(error)

    async def _run(self, job: bytes) -> str | None:
        worker = await self._idle.get()
        try:
            return await asyncio.to_thread(worker.run, job, self.limits.check_timeout_s)
        except _WorkerLost as lost:
            self.replaced += 1
            logger.warning("a structured output check %s; the worker was replaced", lost)
            worker = _Worker(self.source, self.limits)
            return f"the structured output could not be checked: its check {lost} (it is refused)"
        finally:
            self._idle.put_nowait(worker)

    def _remember(self, digest: bytes, verdict: str | None) -> None:
        self._verdicts[digest] = verdict
        while len(self._verdicts) > VERDICTS:
            self._verdicts.popitem(last=False)

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait().close()


class _WorkerLost(Exception):
    """The worker died or was killed during a check; the message says how (for the client's 400)."""


class _Worker:
    """One worker process and the pipe to it; one check at a time."""

    def __init__(self, source: GrammarSource, limits: GrammarLimits):
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the server's state
        self.conn, child = spawn.Pipe()
        self.process = spawn.Process(target=_serve, args=(child, source, limits), name="loramux-grammar",
                                     daemon=True)
        self.process.start()
        child.close()
        self.ready = False  # the worker says so once its tokenizer is built (its start is not a job's time)

    def run(self, job: bytes, timeout_s: float) -> str | None:
        """The job's verdict (None: accepted; else the error), in this thread; _WorkerLost if it dies or takes
        longer than timeout_s (then it is killed)."""
        try:
            if not self.ready:
                self.ready = self.conn.poll(STARTUP_S) and self.conn.recv_bytes() == b"ready"
                if not self.ready:
                    raise EOFError
            self.conn.send_bytes(job)
            if not self.conn.poll(timeout_s):
                self.close()
                raise _WorkerLost(f"took longer than {timeout_s:g} s (--grammar-check-timeout)")
            reply = self.conn.recv_bytes()
        except (EOFError, OSError, BrokenPipeError):
            self.close()
            raise _WorkerLost(f"crashed the checker (exit code {self.process.exitcode}): it is too complex for the "
                              "grammar engine or needs more than --grammar-check-memory") from None
        return msgspec.msgpack.decode(reply)

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _serve(conn, source: GrammarSource, limits: GrammarLimits) -> None:
    """The worker: build the tokenizer once, then answer jobs until the pipe closes."""
    import resource

    from loramux.server.engine import prctl

    prctl.die_with_parent(signal.SIGKILL)
    prctl.set_name("loramux-grammar")
    resource.setrlimit(resource.RLIMIT_AS, (limits.check_memory_bytes, limits.check_memory_bytes))
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer

    from loramux.engine import grammar

    tokenizer = grammar.grammar_tokenizer(Tokenizer.from_str(source.tokenizer_json), source.vocab_size,
                                          list(source.eos_token_ids))
    conn.send_bytes(b"ready")
    while True:
        try:
            job = conn.recv_bytes()
        except EOFError:
            return
        conn.send_bytes(_encode(_verdict(grammar, tokenizer, _decode_params(job), limits)))


def _verdict(grammar, tokenizer, params: StructuredOutputsParams, limits: GrammarLimits) -> str | None:
    try:
        grammar.compile_matcher(tokenizer, grammar.check(params, limits), grammar.kind_of(params))
    except (ValueError, RecursionError, MemoryError) as e:
        return str(e) if isinstance(e, ValueError) else f"the structured output is too complex to check ({type(e).__name__})"
    return None
