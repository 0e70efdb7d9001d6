"""LLMEngine: the offline engine. Text in, text out, around an EngineCore in the same process.

add_request checks and tokenizes the input (InputProcessor), the core steps, and each request's
Detokenizer turns its new tokens into text; a stop string found there ends the request in the core
(aborted one token late at most, as in vLLM: the text is cut at the stop string either way).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence as Seq
from dataclasses import dataclass, field

from loramux.adapters.names import combination_name
from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import EngineConfig
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.engine_core import EngineCore, resolve_device
from loramux.engine.input_processor import InputProcessor
from loramux.engine.output import CoreOutput, RequestOutput
from loramux.logprobs import Logprobs
from loramux.sampling_params import SamplingParams
from loramux.tokenizer import Tokenizer


@dataclass
class _Request:
    prompt: str | None
    prompt_token_ids: list[int]
    adapter: str | None
    detokenizer: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    revision: str | None = None


def _copy(logprobs: Logprobs | None) -> Logprobs | None:
    """An output's own copy: the request's record keeps growing after the output is handed out."""
    return None if logprobs is None else logprobs.slice(0)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.core = EngineCore(config)
        self.config, self.model_name = self.core.config, self.core.model_name
        self.tokenizer = Tokenizer.from_pretrained(self.core.hf_tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.core.limits)
        self.max_model_len = self.core.limits.max_model_len
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()

    # the core's parts, for callers that look inside (tests, benchmarks)
    @property
    def adapters(self):
        """The adapter system: a LoRAManager, or with LoRA off the null one (adapters/off.py)."""
        return self.core.adapters

    @property
    def runner(self):
        return self.core.runner

    @property
    def scheduler(self):
        return self.core.scheduler

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    adapter: str | Mapping[str, float] | None = None, request_id: str | None = None) -> str:
        """Queue one request; returns its id. adapter: a name, or {name: weight} for a weighted combination of
        loaded adapters (adapters/combinations.py; its outputs name it as combination_name does). Bad input is
        refused here (ValueError naming the cause)."""
        params = params or SamplingParams()
        if isinstance(adapter, Mapping):
            adapter = combination_name(adapter)
        token_ids = self.inputs.prompt_ids(prompt)
        self.inputs.check_length(len(token_ids), params, strict=False)
        self.inputs.check_params(params)
        self.inputs.check_structured(params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            self.core.add_request(request_id, token_ids, params, adapter)
        except LookupError as e:
            loaded = ", ".join(self.adapters.loras) or ("none" if self.core.config.lora else "none (LoRA is off)")
            raise ValueError(f"unknown adapter {adapter!r}; loaded adapters: {loaded}") from e
        detokenizer = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens, params.min_tokens)
        self._requests[request_id] = _Request(prompt if isinstance(prompt, str) else None, token_ids, adapter,
                                              detokenizer)
        return request_id

    def chat_ids(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.inputs.chat_ids(messages, add_generation_prompt)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        self._requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def is_lora(self, name: str) -> bool:
        return self.adapters.is_lora(name)

    # ---- the step loop ---------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One engine step; an output for every request that progressed or finished (finished_only: only
        those that finished. An output carries the request's whole record so far, tokens and logprobs, so
        one per step is O(n^2) over a long request: LLM.generate only wants the last.)"""
        outputs = [self._process(out, finished_only) for out in self.core.step() if out.request_id in self._requests]
        return [o for o in outputs if o is not None]

    def _process(self, out: CoreOutput, finished_only: bool = False) -> RequestOutput | None:
        request = self._requests[out.request_id]
        request.token_ids += out.new_token_ids
        if out.logprobs is not None:
            request.logprobs = request.logprobs or Logprobs()
            request.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            request.prompt_logprobs = out.prompt_logprobs
        request.num_cached_tokens = max(request.num_cached_tokens, out.num_cached_tokens)
        request.revision = request.revision or out.revision
        reason = out.finish_reason
        delta, hit_stop, used = request.detokenizer.take(out.new_token_ids, reason)
        new_ids = list(out.new_token_ids[:used])
        if used < len(out.new_token_ids):  # tokens after a stop string (several came in one step)
            del request.token_ids[len(request.token_ids) - len(out.new_token_ids) + used:]
            if request.logprobs is not None:
                request.logprobs = request.logprobs.slice(0, len(request.token_ids))
        if hit_stop and reason is None:
            self.core.abort_request(out.request_id)
            reason = "stop"
        if reason is not None:
            del self._requests[out.request_id]
        elif finished_only:
            return None
        return RequestOutput(out.request_id, request.prompt, request.prompt_token_ids, request.detokenizer.text,
                             list(request.token_ids), request.adapter, reason, delta, new_ids,
                             out.error, _copy(request.logprobs), request.prompt_logprobs, request.num_cached_tokens,
                             request.revision, out.embedding)

    # ---- offline helpers -----------------------------------------------------------------------------
    def stream(self, prompts: Seq, params: Seq[SamplingParams], adapters: Seq[str | None]) -> Iterator[RequestOutput]:
        """Add the requests, then yield every increment (delta_text / delta_token_ids) until all finish."""
        ids = {self.add_request(p, sp, a) for p, sp, a in zip(prompts, params, adapters)}
        while ids:
            for output in self.step():
                if output.request_id in ids:
                    if output.finished:
                        ids.discard(output.request_id)
                    yield output

    # ---- adapters (between steps) ----------------------------------------------------------------------
    def load_adapter(self, spec: str, path: str | None = None, **kwargs) -> LoRAResult:
        return self.adapters.load_adapter(spec, path, **kwargs)

    def load_adapter_from_tensors(self, name: str, tensors: dict, peft_config: dict, replace: bool = False) -> LoRAResult:
        return self.adapters.add_adapter(name, tensors, peft_config, replace)

    def unload_adapter(self, name: str) -> LoRAResult:
        return self.adapters.unload_adapter(name)

    def pin_adapter(self, name: str) -> LoRAResult:
        return self.adapters.pin_adapter(name)

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def unpin_adapter(self, name: str) -> LoRAResult:
        return self.adapters.unpin_adapter(name)


__all__ = ["LLMEngine", "LoRAResult", "LoRAStatus", "RequestOutput", "resolve_device"]
