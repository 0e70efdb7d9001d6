"""One HTTP generation request in the front end: its choices (one engine request each), their text as the
engine's new tokens arrive, and how it ends. No torch.

The engine sends token ids; each choice's Detokenizer turns them into text here, in the HTTP process, and a
stop string found there cancels that engine request (the text is cut at the stop string).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from loramux.engine.detokenizer import Detokenizer
from loramux.engine.output import CoreOutput
from loramux.logprobs import Logprobs
from loramux.server.engine.engine_client import OutputStream
from loramux.server.engine.wire import AddRequest


@dataclass
class Choice:
    index: int
    request: AddRequest
    detokenizer: Detokenizer
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    status: int = 0  # a request refused by the engine when added: its HTTP status (400, 404)
    discard: bool = False  # echo with max_tokens 0: the engine makes one token, which nobody sees
    logprobs: Logprobs | None = None  # of the tokens so far, when asked for
    prompt_logprobs: Logprobs | None = None
    logprobs_sent: int = 0  # streaming: how many of `logprobs` went out already
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held
    revision: str | None = None  # the adapter load that answers it (name@rev; None: the base model)
    embedding: list[float] | None = None  # a pooling request's vector (its one output)

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    def update(self, out: CoreOutput) -> tuple[str, bool]:
        """Take one engine output; returns (new text, a stop string ended it here)."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        self.revision = self.revision or out.revision
        self.embedding = out.embedding if out.embedding is not None else self.embedding
        if self.discard:  # the token is not part of the answer; zero tokens were asked for: "length"
            reason = out.finish_reason
            self.finish_reason = "length" if reason in ("stop", "length") else reason
            self.error, self.status = out.error, out.status
            return "", False
        if out.logprobs is not None:
            self.logprobs = self.logprobs or Logprobs()
            self.logprobs.extend(out.logprobs)
        self.num_tokens += len(out.new_token_ids)
        reason = out.finish_reason
        delta, hit_stop, used = self.detokenizer.take(out.new_token_ids, reason)
        unused = len(out.new_token_ids) - used
        if unused:  # tokens after a stop string (several came in one step)
            self.num_tokens -= unused
            if self.logprobs is not None:
                self.logprobs = self.logprobs.slice(0, len(self.logprobs) - unused)
        if hit_stop and reason in (None, "length"):  # a stop string in its last tokens ends it, as in vLLM
            reason = "stop"
        self.finish_reason, self.error, self.status = reason, out.error, out.status
        return delta, hit_stop and out.finish_reason is None


    def unsent_logprobs(self) -> Logprobs | None:
        """Streaming: the logprobs of the tokens not reported yet (they are marked as reported)."""
        if self.logprobs is None or self.logprobs_sent == len(self.logprobs):
            return None
        start, self.logprobs_sent = self.logprobs_sent, len(self.logprobs)
        return self.logprobs.slice(start)


def new_choices(requests: list[AddRequest], tokenizer, discard: bool = False) -> list[Choice]:
    return [Choice(i, r, Detokenizer(tokenizer, r.params.stop, r.params.skip_special_tokens, r.params.min_tokens),
                   discard=discard) for i, r in enumerate(requests)]


async def run_choices(stream: OutputStream, choices: list[Choice], on_tokens=None) -> AsyncIterator[tuple[Choice, str]]:
    """Drive the choices from the engine's outputs: yields (choice, new text) whenever a choice progressed
    or finished. A choice that hits a stop string is cancelled in the engine. on_tokens(n): output tokens seen.
    The caller closes the stream when it stops early (that aborts what still runs)."""
    by_id = {c.request.request_id: c for c in choices}
    async for out in stream:
        choice = by_id[out.request_id]
        delta, stopped_here = choice.update(out)
        if on_tokens is not None and out.new_token_ids:
            on_tokens(len(out.new_token_ids))
        if stopped_here:
            await stream.cancel([out.request_id])
        if delta or choice.finish_reason is not None:
            yield choice, delta
