"""EngineCore: token ids in, new token ids out. Continuous batching over mixed adapters.

One step = schedule (Scheduler, no torch) -> give the step's adapters device slots (LoRAManager) -> run
(ModelRunner) -> append tokens, finish by EOS / stop token / length -> CoreOutputs (deltas only).
It never tokenizes or formats text: the offline LLMEngine and the HTTP front end do that around it, and
they validate requests before they get here (InputProcessor). Adapter control (load/unload/pin) happens
between steps, on the same thread, so no step ever sees an adapter change under it.

Ownership: the core owns the adapter system (a LoRAManager: cache, store and slots, built side by side
over the model) and hands its parts down: the AdapterCache to the Scheduler (which admits requests whose
adapters fit max_loras, resolves their names to identities and holds them) and the AdapterSlots to the
ModelRunner (which sets each step's mapping). Everything else reaches adapters through the core's API.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import replace

import torch

from loramux.adapters.files import modules_to_wrap
from loramux.adapters.manager import LoRAManager
from loramux.adapters.off import NoAdapters, NoLoader
from loramux.adapters.store import Source
from loramux.config import EngineConfig, LoRAConfig
from loramux.engine.adapter_loader import AdapterLoader
from loramux.engine.block_manager import BlockManager
from loramux.engine.draft_model import DraftModel
from loramux.engine.fair_queue import Origin
from loramux.engine.grammar import GrammarCompiler
from loramux.engine.input_processor import EngineLimits
from loramux.engine.model_runner import ModelRunner, Sampled, Verified
from loramux.engine.output import CoreOutput
from loramux.engine.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.engine.speculative import Speculator
from loramux.logprobs import Logprobs
from loramux.models.loader import load_model
from loramux.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
GRAMMAR_WAIT_S = 0.05  # an idle step waits this long at most for a grammar being compiled
LOAD_WAIT_S = 0.05  # and for an adapter being read
NON_FINITE = ("the model produced NaN or Inf logits for this request (check its adapter's weights and "
              "scaling); it was stopped")


def _checked(result: Sampled | Verified) -> Sampled | Verified | str:
    """A step's result, or the error that ends its request (its grammar refused the token; non-finite logits
    where its next token was to come)."""
    if isinstance(result, Verified):
        return NON_FINITE if result.tokens[0].token is None else result
    if result.error:
        return result.error
    return NON_FINITE if result.token is None and result.embedding is None else result


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _memory(device: torch.device) -> tuple[int, str]:
    """A GPU's memory (bytes) and name, for the defaults that depend on them; (0, "") elsewhere."""
    if device.type != "cuda":
        return 0, ""
    props = torch.cuda.get_device_properties(device)
    return props.total_memory, props.name


def _runtime_source(path: str, allowed_dirs: tuple[str, ...]) -> Source:
    """A runtime load's files: safetensors only, every file inside allowed_dirs. One place, so that a read started
    ahead (read_ahead) reads under the rule the load it stands in for would have."""
    return Source(path, False, tuple(allowed_dirs))


def _with_startup_targets(lora: LoRAConfig | None, paths: tuple[str, ...]) -> tuple[LoRAConfig | None, dict]:
    """lora with whatever of embed_tokens, lm_head and experts the start-up adapters at `paths` have LoRA on
    added to its targets; and path -> what it added for that adapter."""
    if lora is None:
        return None, {}
    needs = {path: modules_to_wrap(path) - set(lora.targets) for path in paths}
    added = sorted(set().union(*needs.values()))
    return (replace(lora, target_modules=(*lora.targets, *added)) if added else lora), needs


class EngineCore:
    def __init__(self, config: EngineConfig):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        loaded = load_model(config.model, config.dtype, self.device, config.max_model_len, config.quantization,
                            config.quantization_group_size)
        lora, needs = _with_startup_targets(config.lora, config.startup_adapters)
        self.config = replace(config, lora=lora, max_model_len=loaded.max_model_len,
                              max_num_batched_tokens=config.step_token_budget(self.device.type, *_memory(self.device)))
        self.model_name, self.hf_tokenizer, self.hf_config = loaded.name, loaded.tokenizer, loaded.hf_config
        self.adapters = self._adapter_system(loaded.model, needs)
        self.eos_token_ids = self._eos_token_ids()
        self.runner = ModelRunner(loaded, self.config, self.device, self.adapters.slots, frozenset(self.eos_token_ids))
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.loader = self._loader()
        self.speculator = self._speculator()
        self.scheduler = Scheduler(self.config, self.block_manager, self.adapters.cache, self.adapters.lookup,
                                   self.loader.readiness, self.adapters.activation, self.speculator)
        self.limits = EngineLimits(max_model_len=loaded.max_model_len,
                                   vocab_size=int(getattr(self.hf_config, "vocab_size", 0) or len(self.hf_tokenizer)),
                                   grammar=self.config.grammar_limits,
                                   priority_scheduling=self.config.scheduling_policy == "priority")
        self._seqs: dict[str, Sequence] = {}
        self.grammars = GrammarCompiler(self.hf_tokenizer.backend_tokenizer, self.limits.vocab_size,
                                        sorted(self.eos_token_ids), self.config.grammar_limits)
        self._compiling: dict[str, tuple[Sequence, Future]] = {}  # structured requests whose grammar is not ready
        self.num_finished: collections.Counter[str] = collections.Counter()  # finish reason -> requests
        self._warm_up()

    def _adapter_system(self, model, needs: dict[str, set[str]]) -> LoRAManager | NoAdapters:
        """The model's LoRA layers wrapped (before the runner prepacks the base weights), with their cache
        and store; with LoRA off, the null system (adapters/off.py). needs: what the start-up adapters made it
        wrap (_with_startup_targets)."""
        lora = self.config.lora
        if lora is None:
            return NoAdapters()
        backend = "torch-fixed-rows" if self.config.batch_invariant else self.config.lora_backend
        adapters = LoRAManager(model, lora, backend)
        logger.info("LoRA slot buffers: %.1f MB (%d slots x rank %d)", adapters.slot_bytes / 2**20,
                    lora.max_loras, lora.max_lora_rank)
        added = sorted(set().union(*needs.values()))
        if added:
            asked = "; ".join(f"{path}: {', '.join(sorted(m))}" for path, m in needs.items() if m)
            logger.info("wrapped %s for the start-up adapters (%s): %.1f MB of those slot buffers", ", ".join(added),
                        asked, adapters.slots.slot_bytes_of(added) / 2**20)
        return adapters

    def _speculator(self) -> Speculator | None:
        """Speculative decoding's policy and proposer (None: off); a draft model shares the runner's KV blocks."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        proposer = None
        if spec.method == "draft_model":
            proposer = DraftModel(self.config, self.device, self.runner.num_blocks, int(self.hf_config.vocab_size))
        return Speculator(spec, self.device.type, proposer)

    def _loader(self) -> AdapterLoader | NoLoader:
        """Adapter files read off the step loop (adapter_loader.py); with LoRA off, nothing is ever read."""
        lora = self.config.lora
        if lora is None:
            return NoLoader()
        return AdapterLoader(self.adapters.store, max_prefetch=(lora.max_cpu_loras - lora.max_loras) // 2,
                             load_timeout_s=lora.load_timeout_s)

    def _warm_up(self) -> None:
        """A prefill and a decode of two throwaway sequences before the first request (as vLLM warms up with a
        dummy LoRA): the ops' kernels load or compile (Triton's on a GPU take seconds), allocators and thread
        pools start, so the first request pays none of it. With LoRA one row runs on slot 0, all zeros until an
        adapter is loaded (it adds nothing), so the LoRA ops run too. The blocks go back; no state is left."""
        greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        length = max(1, min(8, self.config.max_model_len - 1))  # the prompt and one decoded token fit the model
        seqs = [Sequence([1] * length, greedy) for _ in range(min(2, self.config.max_num_seqs))]
        slots = [-1, 0 if self.adapters.cache.max_loras else -1][-len(seqs):]  # (one row: on slot 0)
        chunked = self.config.enable_chunked_prefill
        try:
            for seq in seqs:
                if self.block_manager.can_allocate(seq):
                    self.block_manager.allocate(seq)
            slots = [slot for q, slot in zip(seqs, slots) if q.block_table]  # as many as the cache holds
            seqs = [q for q in seqs if q.block_table]
            for prefill in (True, False)[:1 + (length < self.config.max_model_len)]:
                spans = [(q.num_computed_tokens, len(q)) for q in seqs] if chunked else None
                for seq, result in zip(seqs, self.runner.run(seqs, slots, prefill and not chunked, spans) if seqs else ()):
                    seq.num_computed_tokens = len(seq)
                    seq.append_token(result.token if result is not None and result.token is not None else 1)
                    self.block_manager.may_append(seq)
        finally:
            for seq in seqs:
                if seq.block_table:
                    self.block_manager.deallocate(seq)
                self.runner.release(seq)

    def _eos_token_ids(self) -> set[int]:
        ids = {self.hf_tokenizer.eos_token_id, getattr(self.hf_config, "eos_token_id", None)}
        flat = set()
        for i in ids:
            flat.update(i if isinstance(i, (list, tuple)) else [i])
        return {i for i in flat if i is not None}

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, origin: Origin = Origin()) -> None:
        """Queue a validated request (InputProcessor). LookupError: no adapter has that name (now: it may have
        been unloaded after the caller looked); ValueError: the id is in use, or the request could never run.
        The name is resolved to an identity when the request is admitted (Scheduler). origin: its tenant and
        fair share (engine/fair_queue.py)."""
        if adapter is not None:
            self.adapters.identity_for(adapter)
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(prompt_token_ids, params, adapter, request_id, origin)
        seq.bad_words_ids = self._bad_words_ids(params.bad_words)
        if params.structured_outputs is not None:  # queued once its grammar is compiled (off this thread)
            self._compiling[request_id] = (seq, self.grammars.submit(params.structured_outputs))
        else:
            self.scheduler.add(seq)
        self._seqs[request_id] = seq

    def _bad_words_ids(self, words: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Each bad word as it tokenizes alone and after a space (as vLLM does), without duplicates."""
        encode = self.hf_tokenizer.backend_tokenizer.encode
        ids = {tuple(encode(text, add_special_tokens=False).ids) for w in words for text in (w, " " + w.lstrip())}
        return sorted(i for i in ids if i)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; False if it is not here (finished already, or never added)."""
        seq = self.scheduler.abort(request_id)
        if seq is None and request_id in self._compiling:
            seq, future = self._compiling.pop(request_id)
            future.cancel()
            seq.finish_reason = "abort"
        if seq is not None:
            self._forget(seq)
        return seq is not None

    def abort_all(self) -> list[str]:
        """Stop every request wherever it is (a pause that aborts); their ids."""
        request_ids = list(self._seqs)
        for request_id in request_ids:
            self.abort_request(request_id)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._compiling)

    def sequence(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    # ---- the step loop ---------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """One scheduler step: an output for every request that progressed or finished."""
        outputs = self._queue_compiled() + self.install_loaded()
        batch = self.scheduler.schedule()
        if not batch.seqs and self.loading:
            self.loader.wait(LOAD_WAIT_S)  # the queue waits for adapters being read: do not spin meanwhile
        outputs += [self._ended(s, "error", f"The model `{s.adapter}` was unloaded before the request started.",
                                404) for s in batch.failed]
        spans = dict(zip(map(id, batch.seqs), batch.spans)) if batch.spans is not None else None
        seqs, slots = self._activate(batch.seqs, outputs)
        if seqs:
            seq_spans = [spans[id(s)] for s in seqs] if spans is not None else None
            for seq, result in zip(seqs, self._timed_run(seqs, slots, batch.is_prefill, seq_spans)):
                if isinstance(result, str):
                    outputs.append(self._fail(seq, result))
                    continue
                if isinstance(result, Verified):
                    outputs.append(self._verified(seq, result))
                    continue
                seq.num_computed_tokens = spans[id(seq)][1] if spans is not None else len(seq)
                self.block_manager.cache_computed(seq)  # its full blocks of computed K/V can be shared now
                if result is not None:  # None: a prompt chunk that does not end the prompt samples nothing
                    outputs.append(self._append(seq, result) if result.embedding is None else self._pooled(seq, result))
        return outputs

    def _timed_run(self, seqs: list[Sequence], slots: list[int], is_prefill: bool,
                   spans: list[tuple[int, int]] | None) -> list[Sampled | None | str]:
        """_run, timed for the scheduler's step bound."""
        started = time.perf_counter()
        results = self._run(seqs, slots, is_prefill, spans)
        self.scheduler.observe(seqs, spans, time.perf_counter() - started)
        return results

    def install_loaded(self) -> list[CoreOutput]:
        """Install the adapters the loader thread has read (between steps); fail the waiting requests of one
        that could not be read back."""
        outputs = []
        for ref, error in self.loader.install_ready():
            logger.warning("%s", error)
            outputs += [self._ended(seq, "error", error, 400) for seq in self.scheduler.fail_waiting_on(ref)]
        return outputs

    @property
    def loading(self) -> bool:
        """Adapter files are being read on the loader thread."""
        return self.loader.busy

    def _queue_compiled(self) -> list[CoreOutput]:
        """Queue the structured requests whose grammar is ready (in arrival order); fail those whose grammar
        is invalid. With nothing else to run, wait a little for one (the step loop must not spin)."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished:
            futures.wait([f for _, f in self._compiling.values()], GRAMMAR_WAIT_S, futures.FIRST_COMPLETED)
        outputs = []
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                seq.grammar = future.result()
                self.scheduler.add(seq)
            except Exception as e:
                seq.finish_reason = "error"
                outputs.append(CoreOutput(request_id, [], "error", str(e), status=400))
                self._forget(seq)
        return outputs

    def _activate(self, seqs: list[Sequence], outputs: list[CoreOutput]) -> tuple[list[Sequence], list[int]]:
        """Give the step's adapters device slots; requests whose adapter cannot get one fail alone.
        Returns the runnable sequences and each one's slot (-1 = base model)."""
        slots = {None: -1}
        for ref in dict.fromkeys(s.adapter_ref for s in seqs if s.adapter_ref is not None):
            try:
                slots[ref] = self.adapters.activate(ref)
            except Exception as e:  # a broken adapter (e.g. its file changed on disk) fails its own requests
                logger.warning("adapter %r could not be activated: %s", ref.name, e)
                for seq in [s for s in seqs if s.adapter_ref == ref]:
                    outputs.append(self._fail(seq, f"adapter {ref.name!r} could not be activated: {e}"))
        runnable = [s for s in seqs if s.adapter_ref in slots]
        return self._copied(runnable, [slots[s.adapter_ref] for s in runnable])

    def _copied(self, seqs: list[Sequence], slots: list[int]) -> tuple[list[Sequence], list[int]]:
        """The sequences whose slot holds its adapter already: a slot whose write (on the side stream of a GPU)
        is not done keeps its requests out of this step, so the rest run beside the copy. Where that would
        leave nothing to run, or would hold back a whole prefill (without chunked prefill, a request left out
        of it would next be decoded unprefilled), the step waits for the copies on the device instead."""
        copies = self.adapters.slots.copies
        pending = {slot for slot in slots if slot >= 0 and not copies.ready(slot)}
        if not pending:
            return seqs, slots
        keep = [i for i, slot in enumerate(slots) if slot not in pending]
        if not keep or not self.scheduler.chunked:
            for slot in pending:
                copies.wait(slot)
            return seqs, slots
        return [seqs[i] for i in keep], [slots[i] for i in keep]

    def _run(self, seqs: list[Sequence], slots: list[int], is_prefill: bool,
             spans: list[tuple[int, int]] | None) -> list[Sampled | None | str]:
        """Each sequence's result, or the error that fails it. A step that raises is run again one
        sequence at a time (each one's step is independent of its batch mates: rerunning rewrites the same
        K/V), so that only a request that causes the error fails; sampling never raises."""
        try:
            results = self.runner.run(seqs, slots, is_prefill, spans)
        except Exception as e:
            if len(seqs) > 1:
                logger.warning("a step of %d requests failed (%s); running them one by one", len(seqs), e)
                return [t for i, (seq, slot) in enumerate(zip(seqs, slots))
                        for t in self._run([seq], [slot], is_prefill, None if spans is None else [spans[i]])]
            logger.exception("request %s failed in a step", seqs[0].request_id)
            return [f"the engine failed on this request: {type(e).__name__}: {e}"]
        return [r if r is None else _checked(r) for r in results]

    def _append(self, seq: Sequence, result: Sampled) -> CoreOutput:
        reason = self._take(seq, result.token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq)
        return self._output(seq, [result.token], reason, result.logprobs, result.prompt_logprobs)

    def _verified(self, seq: Sequence, result: Verified) -> CoreOutput:
        """A speculating sequence's step: its new tokens up to the first that ends it; K/V stays for the
        positions before its newest token, the blocks of rejected proposals go back."""
        if self.speculator is not None:
            self.speculator.verified(seq, result.proposed, result.accepted)
        kept, reason = [], None
        for sampled in result.tokens:
            kept.append(sampled)
            reason = self._take(seq, sampled.token)
            if reason is not None:
                break
        seq.num_computed_tokens = len(seq) - 1
        seq.draft_computed = min(seq.draft_computed, len(seq) - 1)  # a draft model's K/V of rejected tokens
        self.block_manager.cache_computed(seq)
        self.block_manager.trim(seq)
        seq.draft_ids = []
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget(seq)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = Logprobs()
            for sampled in kept:
                logprobs.extend(sampled.logprobs)
        return self._output(seq, [s.token for s in kept], reason, logprobs)

    def _take(self, seq: Sequence, token: int) -> str | None:
        """Append a sampled token; the reason it ends the request, if it does."""
        seq.append_token(token)
        params = seq.params
        # a grammar only lets EOS through once it is complete: then the request ends, even with ignore_eos
        eos = token in self.eos_token_ids and (not params.ignore_eos or seq.grammar is not None)
        if token in params.stop_token_ids or eos:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.limits.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, tokens: list[int], reason: str | None, logprobs: Logprobs | None,
                prompt_logprobs: Logprobs | None = None) -> CoreOutput:
        first = seq.num_output_tokens == len(tokens)
        cached = (seq.num_cached_tokens or 0) if first else 0  # in its first output only, as the revision
        revision = seq.adapter_ref.revision if first and seq.adapter_ref is not None else None
        return CoreOutput(seq.request_id, tokens, reason, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          num_cached_tokens=cached, revision=revision)

    def _pooled(self, seq: Sequence, result: Sampled) -> CoreOutput:
        """A pooling request's one output: its vector; it ends (no token)."""
        self.scheduler.finish(seq, "stop")
        self._forget(seq)
        revision = seq.adapter_ref.revision if seq.adapter_ref is not None else None
        return CoreOutput(seq.request_id, [], "stop", num_cached_tokens=seq.num_cached_tokens or 0, revision=revision,
                          embedding=result.embedding)

    def _ended(self, seq: Sequence, reason: str, error: str, status: int = 0) -> CoreOutput:
        """The output of a request the scheduler has already finished."""
        self._forget(seq)
        return CoreOutput(seq.request_id, [], reason, error, status=status)

    def _fail(self, seq: Sequence, error: str) -> CoreOutput:
        self.scheduler.finish(seq, "error")
        return self._ended(seq, "error", error)

    def _forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self.runner.release(seq)
        self.num_finished[seq.finish_reason] += 1
        if seq.adapter_ref is not None:
            self.adapters.retire()  # an unloaded or replaced identity goes with its last request

    # ---- adapters (between steps) ----------------------------------------------------------------------
    # Loads, unloads and pins read nothing off the step loop: callers use the adapter system itself
    # (self.adapters.load_adapter, ...). A runtime load reads its files on the loader thread:
    def load_adapter_async(self, name: str, path: str, allowed_dirs: tuple[str, ...] = (), replace: bool = False,
                           pinned: bool = False, ahead: Future | None = None) -> Future:
        """A runtime load (safetensors only, every file inside allowed_dirs): read on the loader thread, so the
        running streams keep stepping; the future's LoRAResult comes once it is installed between steps.
        ahead: read_ahead's future for these files, if the caller started one."""
        return self.loader.load(name, _runtime_source(path, allowed_dirs), replace, pinned, ahead)

    def read_ahead(self, name: str, path: str, allowed_dirs: tuple[str, ...] = ()) -> Future | None:
        """Start reading a runtime load's files now, from any thread (the engine process's inbox, while a step
        runs); None with LoRA off."""
        return self.loader.read_ahead(name, _runtime_source(path, allowed_dirs))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (vLLM's reset_prefix_cache); how many there were."""
        return self.block_manager.reset_cache()

    # ---- state -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The engine's state for /metrics, one read of its parts: the engine process's EngineStats fields
        (wire.py) it can answer (the process adds the requests it holds back and whether it is paused)."""
        scheduler, adapters, blocks, counters = self.scheduler, self.adapters, self.block_manager, self.adapters.stats
        return dict(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            running_adapters=sorted({ref.name for ref in scheduler.running_adapters()}),
            waiting_adapters=sorted(scheduler.waiting_adapters()), max_loras=scheduler.max_loras,
            num_adapters=len(adapters.loras), pinned=adapters.pinned, lora_loads=counters.get("loads", 0),
            lora_host_evictions=counters.get("host_evictions", 0),
            lora_slot_evictions=counters.get("slot_evictions", 0), kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks, weight_bytes=self.runner.weight_bytes,
            lora_slot_bytes=adapters.slot_bytes, lora_host_bytes=adapters.host_bytes, finished=dict(self.num_finished),
            prefix_cache_queries=blocks.queries, prefix_cache_hits=blocks.hits, resident=adapters.resident,
            revisions=adapters.kept_revisions, spec_decode=None if self.speculator is None else self.speculator.stats)
