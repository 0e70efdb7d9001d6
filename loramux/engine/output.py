"""What the engine gives back. CoreOutput: one request's new tokens in one step (what crosses the process
boundary, so it is a compact msgspec struct, stdlib-typed). RequestOutput: the offline API's view of a
request (text and tokens so far, and what is new in this step)."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from loramux.logprobs import Logprobs

FINISH_REASONS = ("stop", "length", "abort", "error")
"""stop: an EOS or stop token (or, outside the engine, a stop string); length: max_tokens or max_model_len;
abort: cancelled (client gone, adapter unloaded, shutdown); error: the request failed (its message says why)."""


class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's progress in one engine step: only the new tokens (deltas), never the totals.

    finish_reason "stop" from the engine always means the last new token is the stop token (stop strings are
    found by the detokenizer, outside the engine)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 0  # for a request refused when added: the HTTP status to answer with (400, 404)
    logprobs: Logprobs | None = None  # of new_token_ids, when the request asked for them
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1..n-1, once, in the request's first output
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held, in the request's first output
    revision: str | None = None  # the adapter load it runs on (AdapterRef.revision), in its first output
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling), in its one output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    adapter: str | None
    finish_reason: str | None = None  # one of FINISH_REASONS; None while running
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why an aborted or failed request ended
    logprobs: Logprobs | None = None  # of token_ids so far (SamplingParams.logprobs set)
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1..n-1 (SamplingParams.prompt_logprobs set)
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache (vLLM's RequestOutput field)
    revision: str | None = None  # the adapter load that produced it, name@rev (None: the base model)
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling; LLM.embed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
