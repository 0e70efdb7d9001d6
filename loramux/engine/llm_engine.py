"""LLMEngine: add requests, step, collect outputs. Continuous batching over mixed adapters.

One step = schedule (Scheduler, no torch) -> activate the step's adapters -> run (ModelRunner) ->
append tokens, detokenize, check stops -> outputs. Adapter control (load/unload/pin) happens between
steps, on the same thread, so no step ever sees an adapter change under it.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass, replace

import torch

from loramux.adapters.status import LoRAResult, LoRAStatus
from loramux.config import EngineConfig
from loramux.engine.block_manager import BlockManager
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.model_runner import ModelRunner
from loramux.engine.output import RequestOutput
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.models.loader import load_model
from loramux.sampling_params import SamplingParams


logger = logging.getLogger(__name__)
NON_FINITE = ("the model produced NaN or Inf logits for this request (check its adapter's weights and "
              "scaling); it was stopped")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detokenizer: Detokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        loaded = load_model(config.model, config.dtype, self.device, config.max_model_len)
        self.config = replace(config, max_model_len=loaded.max_model_len)
        self.model_name, self.tokenizer, self.hf_config = loaded.name, loaded.tokenizer, loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.runner = ModelRunner(loaded, self.config, self.device)
        self.manager = self.runner.manager
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.block_manager, self.manager.cache if self.manager else None)
        self.eos_token_ids = self._eos_token_ids()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()

    def _eos_token_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id, getattr(self.hf_config, "eos_token_id", None)}
        flat = set()
        for i in ids:
            flat.update(i if isinstance(i, (list, tuple)) else [i])
        return {i for i in flat if i is not None}

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; returns its id. Unknown adapters and over-long prompts are refused here."""
        params = params or SamplingParams()
        if adapter is not None and (self.manager is None or not self.manager.is_lora(adapter)):
            loaded = ", ".join(self.manager.loras) if self.manager else "none (LoRA is off)"
            raise ValueError(f"unknown adapter {adapter!r}; loaded adapters: {loaded or 'none'}")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                             "leaves no room for a new token")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(token_ids, params, adapter, request_id)
        detokenizer = Detokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        self._requests[request_id] = _Request(seq, prompt if isinstance(prompt, str) else None, detokenizer)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the step loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; an output for every request that progressed or finished."""
        batch = self.scheduler.schedule()
        outputs = [self._aborted(s, f"adapter {s.adapter!r} was unloaded before the request started")
                   for s in batch.failed]
        seqs = self._drop_failed_adapters(batch.seqs, outputs)
        if seqs:
            for seq, token in zip(seqs, self._run(seqs, batch.is_prefill)):
                outputs.append(self._append(seq, token) if isinstance(token, int) else self._fail(seq, token))
        return outputs

    def _run(self, seqs: list[Sequence], is_prefill: bool) -> list[int | str]:
        """Each sequence's next token, or the error that fails it. A step that raises is run again one
        sequence at a time (each one's step is independent of its batch mates: rerunning rewrites the same
        K/V), so that only a request that causes the error fails; sampling never raises."""
        try:
            tokens = self.runner.run(seqs, is_prefill)
        except Exception as e:
            if len(seqs) > 1:
                logger.warning("a step of %d requests failed (%s); running them one by one", len(seqs), e)
                return [t for seq in seqs for t in self._run([seq], is_prefill)]
            logger.exception("request %s failed in a step", seqs[0].request_id)
            return [f"the engine failed on this request: {type(e).__name__}: {e}"]
        return [NON_FINITE if t is None else t for t in tokens]
    def _drop_failed_adapters(self, seqs: list[Sequence], outputs: list[RequestOutput]) -> list[Sequence]:
        """Activate the step's adapters; requests whose adapter cannot be activated fail alone."""
        errors = self.runner.activate_adapters(seqs)
        for seq in [s for s in seqs if s.adapter in errors]:
            self.scheduler.finish(seq, "abort")
            outputs.append(self._aborted(seq, errors[seq.adapter]))
        return [s for s in seqs if s.adapter not in errors]

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        request = self._requests[seq.request_id]
        seq.append_token(token)
        params = seq.params
        by_token = token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos)
        reason = "stop" if by_token else None
        if reason is None and (seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        text_ids = seq.output_token_ids[:-1] if by_token else seq.output_token_ids
        delta, hit_stop = request.detokenizer.update(text_ids, final=reason is not None)
        reason = "stop" if hit_stop else reason
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq)
        return self._output(request, reason, delta, [token])

    def _aborted(self, seq: Sequence, error: str, reason: str = "abort") -> RequestOutput:
        request = self._requests[seq.request_id]
        self._forget(seq)
        return self._output(request, reason, "", [], error)

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self.scheduler.finish(seq, "error")
        return self._aborted(seq, error, "error")

    def _forget(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)
        self.runner.release(seq)

    def _output(self, request: _Request, reason, delta_text, delta_ids, error=None) -> RequestOutput:
        seq = request.seq
        return RequestOutput(seq.request_id, request.prompt, seq.token_ids[: seq.num_prompt_tokens],
                             request.detokenizer.text, list(seq.output_token_ids), seq.adapter, reason,
                             delta_text, delta_ids, error)

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
        """LoRAManager.load_adapter: "name=path", a bare path, or (name, path)."""
        return self.lora_manager.load_adapter(spec, path, **kwargs)

    def unload_adapter(self, name: str) -> LoRAResult:
        return self.lora_manager.unload_adapter(name)

    def pin_adapter(self, name: str) -> LoRAResult:
        return self.lora_manager.pin_adapter(name)

    @property
    def lora_manager(self):
        if self.manager is None:
            raise RuntimeError("this engine was built with lora=None; adapters are off")
        return self.manager


__all__ = ["LLMEngine", "LoRAResult", "LoRAStatus", "RequestOutput"]
