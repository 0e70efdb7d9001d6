"""ModelRunner: one scheduled batch -> tensors -> forward pass -> one sampled token per sequence.

It owns the paged KV cache and runs the model, whose LoRA layers it reaches through the engine's
AdapterSlots (the per-step mapping). Each step comes with every sequence's adapter slot; the runner never
looks adapters up itself.
"""
from __future__ import annotations

import logging
import math
import os
from typing import NamedTuple

import torch

from loramux.adapters.off import NoSlots
from loramux.adapters.slots import AdapterSlots
from loramux.config import EngineConfig
from loramux.engine.cuda_graphs import DecodeGraphs, capture_sizes, graph_blockers
from loramux.engine.decode_inputs import DecodeInputs
from loramux.engine.sequence import Sequence
from loramux.layers.attention import AttentionMetadata
from loramux.layers.linear import can_prepack, fix_linear_rows, prepack_linears
from loramux.logprobs import Logprobs
from loramux.layers.sampler import SamplingRow, allowed_tokens, sample_and_score, token_logprobs
from loramux.models.loader import LoadedModel
from loramux.models.llama import head_dim_of
from loramux.models.moe import FusedExperts
from loramux.ops import (LoRAMapping, attention_cpu, bind_ops, select_attention_ops, select_moe_backend,
                         select_pointwise_backend, select_quant_backend)

logger = logging.getLogger(__name__)

INVARIANT_ROWS = 32  # batch_invariant: the row count of every GEMM (decode batches up to 32 take one call)
PROMPT_LOGPROBS_ROWS = 512  # prompt logprobs: logits for this many positions at a time ([512, vocab] float32)


class Sampled(NamedTuple):
    """One sequence's result of a step: its next token (None: its logits were not finite) and, when its
    request asked, that token's logprobs and (in its first prefill) its prompt's."""

    token: int | None
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    error: str | None = None  # the request cannot go on (its grammar refused the token)
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling): no token


class Verified(NamedTuple):
    """A speculating sequence's result of a step (Sequence.draft_ids verified): its new tokens in order, the
    proposed ones the model agreed with and then its own next one (fewer where logits were not finite: a first
    token of None fails the request), and how many tokens it had proposed."""

    tokens: list[Sampled]
    proposed: int
    accepted: int  # the proposed tokens kept


def _position_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's output token `index` where speculation is on: its draws then depend on
    the request alone, not on how many tokens each step verified."""
    return (seed * 0x9E3779B97F4A7C15 + index) % 2**64


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    if "MemAvailable" in fields:
        return int(fields["MemAvailable"].split()[0]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def batch_order(row_slots: list[int], grouped: bool) -> list[int]:
    """The order of a step's rows: by slot when the LoRA op is faster on grouped tokens (the segmented
    torch op), else the batch's own. Keeping it keeps decode attention reading the KV cache in the order
    it was allocated: regrouping 8 interleaved adapters cost ~0.35 ms a step at batch 32 (SmolLM2, bf16)."""
    if not grouped:
        return list(range(len(row_slots)))
    return sorted(range(len(row_slots)), key=row_slots.__getitem__)


def _decode_only(seqs: list[Sequence], is_prefill: bool, spans: list[tuple[int, int]] | None) -> bool:
    """Whether a step feeds each sequence its last token alone (a decode step; or a chunk that is only the
    last prompt token, after a prefix-cache hit: the same computation)."""
    if spans is None:
        return not is_prefill
    return all(end - start == 1 and end == len(s) for s, (start, end) in zip(seqs, spans))


def _tokens(seq: Sequence, start: int, end: int) -> list[int]:
    """Its tokens at positions [start, end): past its last one, the tokens it proposes (speculative decoding)."""
    n = len(seq)
    if end <= n:
        return seq.token_ids[start:end]
    return seq.token_ids[start:] + seq.draft_ids[max(0, start - n):end - n]


def _token_slots(seqs: list[Sequence], slots: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Each new token's slot: its sequence's, or -1 (the base model) at positions before an aLoRA adapter's
    activation (Sequence.activation)."""
    out = []
    for seq, slot, (start, end) in zip(seqs, slots, spans):
        if slot < 0 or seq.activation <= start:
            out += [slot] * (end - start)
        else:
            split = min(max(seq.activation, start), end)
            out += [-1] * (split - start) + [slot] * (end - split)
    return out


def pool(seqs: list[Sequence], spans: list[tuple[int, int]], hidden: torch.Tensor,
         offsets) -> tuple[dict[int, torch.Tensor], dict[int, list[float]]]:
    """Pooling requests' share of a step (SamplingParams.pooling): {i: the mean's running sum with this chunk} for
    those whose prompt goes on, and {i: the vector} for those whose prompt ends here. hidden: [rows, hidden],
    sequence i's rows offsets[i]:offsets[i+1] (its span's positions)."""
    sums, vectors = {}, {}
    for i, (seq, (start, end)) in enumerate(zip(seqs, spans)):
        how = seq.params.pooling
        if how is None:
            continue
        rows = hidden[offsets[i]:offsets[i + 1]].float()
        if how == "mean":  # (a prompt computed from its start again, after a preemption, sums afresh)
            total = rows.sum(0) if start == 0 or seq.pooled_sum is None else seq.pooled_sum + rows.sum(0)
            if end < len(seq):
                sums[i] = total
                continue
            vector = total / len(seq)
        else:
            if end < len(seq):
                continue
            vector = rows[-1]
        if seq.params.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        vectors[i] = vector.tolist()
    return sums, vectors


def padding_indices(offsets: list[int], lengths: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of `lengths` new tokens starting at token `offsets` of a step, for one padded causal
    attention call (Attention._padded): (pad_index [batch, max_len], unpad_index [sum(lengths)]). A padded
    position repeats its sequence's last token: causal attention never lets a real query see it."""
    max_len = max(lengths)
    pad = [[o + min(p, n - 1) for p in range(max_len)] for o, n in zip(offsets, lengths)]
    unpad = [b * max_len + p for b, n in enumerate(lengths) for p in range(n)]
    return (torch.tensor(pad, dtype=torch.long, device=device), torch.tensor(unpad, dtype=torch.long, device=device))


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, slots: AdapterSlots | NoSlots,
                 eos_token_ids: frozenset[int] = frozenset(), num_blocks: int | None = None):
        """slots: the model's LoRA layers, already wrapped (NoSlots: LoRA is off); num_blocks: the KV cache's
        blocks (None: as many as its memory budget holds; a draft model takes the target's, to share its block
        tables)."""
        self.model, self.config, self.device = loaded.model, config, device
        self.eos_token_ids = eos_token_ids  # blocked before a request's min_tokens
        self.max_model_len = loaded.max_model_len
        self.block_size = config.block_size
        self.slots = slots
        self.dtype = loaded.dtype
        self.weight_bytes = loaded.weight_bytes
        if can_prepack(device, self.dtype):  # after wrapping: the LoRA layers' base Linears are packed too
            prepack_linears(self.model)
        if config.batch_invariant:
            if any(isinstance(m, FusedExperts) for m in self.model.modules()):
                raise ValueError("batch_invariant does not cover mixture-of-experts models: each expert's GEMM runs "
                                 "on the rows the batch routes to it, so a row's result depends on its batch mates")
            fix_linear_rows(self.model, INVARIANT_ROWS)
        pointwise = select_pointwise_backend(config.pointwise_backend, device)
        attention = select_attention_ops(config.attention_backend, device, config.batch_invariant)
        bind_ops(self.model, {"pointwise": pointwise, "quant": select_quant_backend(config.quant_backend, device),
                              "moe": select_moe_backend(config.moe_backend, device), "attention": attention})
        self.argmax = pointwise.argmax  # greedy sampling
        # Where the C++ paged decode kernel runs, it takes prompts too: every new token of a step is a row of
        # one call (row i of a chunk starting at position s sees s + i + 1 keys through its sequence's block
        # table). One call a layer instead of one a prompt, and faster than SDPA at every prompt length
        # measured (benchmarks/mixed_attention.py, docs/performance.md).
        self.rows_attention = attention.decode_attention is attention_cpu.decode_attention_cpu
        # A mixed step's prompts that start in it run as one padded attention call on a GPU (one launch, not
        # one per prompt and layer); on a CPU one call per prompt is as fast for equal lengths, and padding
        # unequal ones costs up to 2x (benchmarks/mixed_attention.py).
        self.pad_fresh_chunks = device.type == "cuda"
        self.num_blocks = self._allocate_kv_cache(loaded.hf_config, num_blocks)
        self.decode_inputs = DecodeInputs(config.max_num_seqs, math.ceil(self.max_model_len / self.block_size),
                                          self.block_size, self.num_blocks * self.block_size, device)
        self.graphs = self._capture_graphs(attention.decode_attention) if device.type == "cuda" else None
        # Seeded requests draw from their own generators, on the device that samples (a GPU's draw needs no copy)
        self._generator_device = "cuda" if device.type == "cuda" else "cpu"
        self._shared_generator = torch.Generator(device=self._generator_device).manual_seed(config.seed)
        self._generators: dict[int, torch.Generator] = {}
        self._position_seeded = config.speculative_config is not None

    # ---- KV cache ------------------------------------------------------------------------------
    def _allocate_kv_cache(self, hf_config, num_blocks: int | None = None) -> int:
        layers = self.model.attention_layers()
        kv_heads, head_dim = layers[0].num_kv_heads, head_dim_of(hf_config)
        block_bytes = 2 * len(layers) * self.block_size * kv_heads * head_dim * self.dtype.itemsize
        budget = self.config.kv_cache_memory or int(available_memory(self.device) * self.config.kv_cache_fraction)
        blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        if num_blocks is None:
            num_blocks = min(budget // block_bytes, self.config.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds {num_blocks} blocks of {self.block_size} "
                             f"tokens, fewer than one max_model_len={self.max_model_len} sequence needs ({blocks_per_seq})")
        # and one block beyond the budget, which the block manager never hands out: padded decode rows write there
        rows = (num_blocks + 1) * self.block_size
        cache = torch.zeros(2, len(layers), rows, kv_heads, head_dim, dtype=self.dtype, device=self.device)
        invariant = self.config.batch_invariant
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]
            layer.prefill = layer.prefill_per_sequence if invariant else layer.prefill_padded
        self.kv_cache = cache
        return num_blocks

    def _capture_graphs(self, decode_op) -> DecodeGraphs | None:
        """Decode as CUDA graphs, where everything the forward runs can be captured (else None, logged once)."""
        add_lora = self.slots.add_lora
        blockers = graph_blockers(self.model, self.config, add_lora, decode_op)
        if blockers:
            logger.info("decode steps run eagerly, without CUDA graphs: %s", "; ".join(blockers))
            return None
        sizes = capture_sizes(self.config.max_num_seqs)
        with torch.inference_mode():  # (as every step runs)
            graphs = DecodeGraphs(self._decode_forward, sizes, lambda rows: self.decode_inputs.fill([], [], rows))
        logger.info("decode steps run as CUDA graphs for batch sizes %s", ", ".join(map(str, sizes)))
        return graphs

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], slots: list[int], is_prefill: bool,
            spans: list[tuple[int, int]] | None = None) -> list[Sampled | None]:
        """Run one step over `seqs`, slots[i] being seqs[i]'s adapter slot (-1 = base; activated by the
        engine); returns their results in order. spans (chunked prefill): the positions [start, end) each
        sequence computes; one whose span ends before its last token samples nothing (None)."""
        grouped = self.slots.wants_grouped_tokens
        order = batch_order(slots, grouped)
        if spans is not None:  # decode rows first: the paged decode op takes them as one block
            order = sorted(order, key=lambda i: spans[i][1] - spans[i][0] > 1)
        ordered = [seqs[i] for i in order]
        # each row's slot at its last token (aLoRA: the base model's before its invocation)
        ordered_slots = [slots[i] if len(seqs[i]) - 1 >= seqs[i].activation else -1 for i in order]
        if _decode_only(seqs, is_prefill, spans):
            ordered_spans = [(len(s) - 1, len(s)) for s in ordered]
            hidden, offsets = self._decode(ordered, ordered_slots), range(len(ordered) + 1)
        else:
            ordered_spans = [spans[i] for i in order] if spans is not None else \
                [(0, len(s)) if is_prefill else (len(s) - 1, len(s)) for s in ordered]
            prepare = self._prepare_mixed if spans is not None else self._prepare_prefill
            input_ids, positions, meta, offsets = prepare(ordered, ordered_spans)
            token_slots = _token_slots(ordered, [slots[i] for i in order], ordered_spans)
            hidden = self._forward(input_ids, positions, meta, token_slots)
        prompt = self._prompt_logprobs(ordered, ordered_slots, ordered_spans, hidden, offsets)
        sums, pooled = pool(ordered, ordered_spans, hidden, offsets)
        done = [i for i, (s, (_, end)) in enumerate(zip(ordered, ordered_spans)) if end == len(s) and i not in pooled]
        verify = [i for i, (s, (_, end)) in enumerate(zip(ordered, ordered_spans)) if end > len(s)]
        last = hidden if len(done) == hidden.shape[0] else hidden[[offsets[i + 1] - 1 for i in done]]
        sampled = self._sample([ordered[i] for i in done], last, [ordered_slots[i] for i in done])
        verified = self._verify([ordered[i] for i in verify], hidden, [offsets[i] for i in verify],
                                [ordered_slots[i] for i in verify])
        # Nothing raised: commit. (Sampling advanced generators and grammars, so it comes last: a step that
        # raises is rerun per sequence and must not have changed any sequence's state.)
        for i, parts in prompt.items():
            ordered[i].prompt_logprobs = parts
        for i, total in sums.items():
            ordered[i].pooled_sum = total
        result: list[Sampled | Verified | None] = [None] * len(seqs)
        for i, out in zip(done, sampled):  # the prompt's logprobs go out with the chunk that completes it
            result[order[i]] = out._replace(prompt_logprobs=prompt.get(i))
        for i, out in zip(verify, verified):
            result[order[i]] = out
        for i, vector in pooled.items():
            result[order[i]] = Sampled(None, embedding=vector)
        return result

    def _logits(self, hidden: torch.Tensor, row_slots: list[int]) -> torch.Tensor:
        """hidden: [rows, hidden] -> float32 logits [rows, vocab]; row_slots: each row's adapter slot (a LoRA
        output head reads them)."""
        with self.slots.head_mapping(row_slots):
            return self.model.compute_logits(hidden)

    def _sample(self, seqs: list[Sequence], hidden: torch.Tensor, slots: list[int]) -> list[Sampled]:
        """hidden: [len(seqs), hidden], each sequence's last position -> its next token (and logprobs); then
        each grammar consumes its token."""
        if not seqs:
            return []
        logits = self._logits(hidden, slots)
        scored = {i: s.params.logprobs for i, s in enumerate(seqs) if s.params.logprobs is not None}
        tokens, logprobs = sample_and_score(logits, [self._sampling_row(s, logits.shape[1]) for s in seqs], scored,
                                            self.argmax)
        errors = [self._advance_grammar(s, t) for s, t in zip(seqs, tokens)]
        return [Sampled(t, logprobs.get(i), None, e) for i, (t, e) in enumerate(zip(tokens, errors))]

    def _verify(self, seqs: list[Sequence], hidden: torch.Tensor, firsts: list[int], slots: list[int]) -> list[Verified]:
        """Speculative decoding: each sequence's k proposed tokens (Sequence.draft_ids) were fed after its last
        token, its rows of `hidden` from firsts[i] on ([k + 1, hidden]). Position p's token is drawn as without
        speculation, from the model's distribution given the proposed tokens before it (penalties, min_tokens and
        bad words see them); the sequence keeps the draws up to the first that differs from its proposal (or
        the last position's). With a one-token proposal that is exact rejection sampling: the kept tokens have
        the distribution (greedy: the tokens) of decoding one at a time."""
        if not seqs:
            return []
        lengths = [len(s.draft_ids) + 1 for s in seqs]
        rows = [first + p for first, n in zip(firsts, lengths) for p in range(n)]
        logits = self._logits(hidden[rows], [slot for slot, n in zip(slots, lengths) for _ in range(n)])
        sampling = [self._sampling_row(s, logits.shape[1], s.draft_ids[:p]) for s, n in zip(seqs, lengths)
                    for p in range(n)]
        owners = [s for s, n in zip(seqs, lengths) for _ in range(n)]
        scored = {r: s.params.logprobs for r, s in enumerate(owners) if s.params.logprobs is not None}
        tokens, logprobs = sample_and_score(logits, sampling, scored, self.argmax)
        out, row = [], 0
        for seq, n in zip(seqs, lengths):
            kept = []
            for p in range(n):
                token = tokens[row + p]
                if token is None and kept:  # the next step computes this position again, and fails it then
                    break
                kept.append(Sampled(token, logprobs.get(row + p)))
                if token is None or p == n - 1 or token != seq.draft_ids[p]:
                    break
            agreed = sum(p < n - 1 and k.token == seq.draft_ids[p] for p, k in enumerate(kept))
            out.append(Verified(kept, n - 1, agreed))
            row += n
        return out

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int | None) -> str | None:
        """Feed a constrained sequence's grammar its new token; the error that ends the request, if any."""
        if seq.grammar is None or token is None:
            return None
        if not seq.grammar.consume_token(token):
            return f"the structured output's grammar failed: {seq.grammar.get_error()}"
        return None

    def _prompt_logprobs(self, seqs: list[Sequence], slots: list[int], spans: list[tuple[int, int]],
                         hidden: torch.Tensor, offsets: list[int]) -> dict[int, Logprobs]:
        """For the sequences in their first prefill whose requests ask: the logprobs of prompt tokens 1..n-1,
        each from the hidden state of the position before it (sequence i's rows: offsets[i]:offsets[i+1], its
        positions spans[i]). A chunked prefill's pieces gather on the sequence; the whole comes out with the
        chunk that completes the prompt (run() stores them on the sequence once the step succeeded). A resumed
        sequence (after preemption) is not scored again. Returns {i: the prompt's logprobs so far}."""
        out = {}
        for i, (seq, (start, end)) in enumerate(zip(seqs, spans)):
            k = seq.params.prompt_logprobs
            if k is None or seq.num_output_tokens:
                continue
            last = min(end, seq.num_prompt_tokens - 1)  # positions start..last-1 predict prompt tokens
            parts = seq.prompt_logprobs.slice(0) if start else Logprobs()  # a copy: committed by run()
            for a in range(start, last, PROMPT_LOGPROBS_ROWS):
                b = min(a + PROMPT_LOGPROBS_ROWS, last)
                rows = hidden[offsets[i] + a - start: offsets[i] + b - start]
                parts.extend(token_logprobs(torch.log_softmax(self._logits(rows, [slots[i]] * rows.shape[0]), -1),
                                            seq.token_ids[a + 1:b + 1], k))
            out[i] = parts
        return out

    def _decode(self, seqs: list[Sequence], slots: list[int]) -> torch.Tensor:
        """A decode step (one new token per sequence) through the decode inputs: replayed as the CUDA graph of
        the smallest captured size that holds it, else run eagerly on exactly its rows (also while a slot holds what
        graphs cannot replay: AdapterSlots.needs_eager). -> hidden [rows, hidden]"""
        graphs = self.graphs is not None and not self.slots.needs_eager
        size = self.graphs.size_for(len(seqs)) if graphs else None
        self.decode_inputs.fill(seqs, slots, size)
        if size is not None:
            return self.graphs.replay(size, len(seqs))
        return self._decode_forward(len(seqs), slots, max(len(s.block_table) for s in seqs))

    def _decode_forward(self, rows: int, slots: list[int] | None = None, blocks: int | None = None) -> torch.Tensor:
        """The model over the decode inputs' first `rows` rows. slots: theirs, known on the host (None: a graph's
        capture, whose LoRA op reads them on the device only); blocks: the block-table columns they need (None:
        all, a graph's fixed width)."""
        inputs = self.decode_inputs.views(rows, blocks)
        meta = AttentionMetadata(False, inputs.cache_rows, block_tables=inputs.block_tables,
                                 context_lens=inputs.context_lens, block_size=self.block_size)
        base = self.slots.add_lora is None or (slots is not None and all(s < 0 for s in slots))
        mapping = None if base else LoRAMapping(inputs.token_slots, host_slots=slots)
        return self._run_model(inputs.ids, inputs.positions, meta, mapping)

    def _forward(self, input_ids, positions, meta, token_slots: list[int]):
        mapping = LoRAMapping.from_slots(token_slots, self.device) if any(s >= 0 for s in token_slots) else None
        return self._run_model(input_ids, positions, meta, mapping)

    def _run_model(self, input_ids, positions, meta, mapping: LoRAMapping | None) -> torch.Tensor:
        """The forward pass, every LoRA layer on `mapping` (None: the base model alone)."""
        if mapping is None:
            return self.model(input_ids, positions, meta)
        with self.slots.mapping(mapping):
            return self.model(input_ids, positions, meta)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _cache_index(self, seq: Sequence, positions: range) -> list[int]:
        table, size = seq.block_table, self.block_size
        return [table[p // size] * size + p % size for p in positions]

    def _prepare_prefill(self, seqs: list[Sequence], spans=None):
        lengths = [len(s) for s in seqs]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        input_ids = self._tensor([t for s in seqs for t in s.token_ids])
        positions = self._tensor([p for n in lengths for p in range(n)])
        cache_rows = self._tensor([i for s, n in zip(seqs, lengths) for i in self._cache_index(s, range(n))])
        if self.rows_attention:
            return input_ids, positions, self._rows_metadata(seqs, lengths, positions, cache_rows), offsets
        pad, unpad = padding_indices(offsets, lengths, self.device)
        meta = AttentionMetadata(True, cache_rows, pad_index=pad, unpad_index=unpad, seq_offsets=offsets)
        return input_ids, positions, meta, offsets

    def _rows_metadata(self, seqs: list[Sequence], counts: list[int], positions: torch.Tensor,
                       cache_rows: torch.Tensor) -> AttentionMetadata:
        """Each new token as a row of the paged decode op: seqs[i] has counts[i] consecutive rows, each with
        its sequence's block table and positions[row] + 1 keys. (One sequence's rows share one table, a view:
        a long prompt alone would otherwise copy ~length^2 / 2 bytes of tables.)"""
        tables = self._block_tables(seqs)
        if len(seqs) == 1:
            tables = tables.expand(counts[0], -1)
        elif any(n != 1 for n in counts):
            tables = tables.repeat_interleave(self._tensor(counts), dim=0)
        return AttentionMetadata(False, cache_rows, block_tables=tables, context_lens=positions + 1,
                                 block_size=self.block_size)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """[len(seqs), max_blocks]: each sequence's block table, padded with block 0."""
        max_blocks = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs])

    def _prepare_mixed(self, seqs: list[Sequence], spans: list[tuple[int, int]]):
        """Chunked prefill: decode rows (spans of one token, first) then prompt chunks; each chunk attends to
        its sequence's cached positions [0, start) and to itself (as decode-op rows with rows_attention, else
        AttentionMetadata.chunks)."""
        lengths = [end - start for start, end in spans]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        num_decode = sum(n == 1 for n in lengths)  # run() put them first
        input_ids = self._tensor([t for s, (a, b) in zip(seqs, spans) for t in _tokens(s, a, b)])
        positions = self._tensor([p for a, b in spans for p in range(a, b)])
        cache_rows = self._tensor([i for s, (a, b) in zip(seqs, spans) for i in self._cache_index(s, range(a, b))])
        if self.rows_attention:
            return input_ids, positions, self._rows_metadata(seqs, lengths, positions, cache_rows), offsets
        decode = seqs[:num_decode]
        chunks = range(num_decode, len(seqs))
        fresh = [i for i in chunks if spans[i][0] == 0]
        if len(fresh) < 2 or not self.pad_fresh_chunks:
            fresh = []
        alone = [i for i in chunks if spans[i][0] != 0 or not fresh]
        meta = AttentionMetadata(False, cache_rows, block_size=self.block_size, num_decode=num_decode,
                                 chunks=[(offsets[i], *spans[i]) for i in alone],
                                 chunk_context=[self._chunk_context(seqs[i], *spans[i]) for i in alone])
        if fresh:
            rows = self._tensor([t for i in fresh for t in range(offsets[i], offsets[i + 1])])
            meta.fresh = (rows, *padding_indices([offsets[i] for i in fresh], [lengths[i] for i in fresh], self.device))
        if decode:
            meta.block_tables = self._block_tables(decode)
            meta.context_lens = self._tensor([b for _, b in spans[:num_decode]])
        return input_ids, positions, meta, offsets

    def _chunk_context(self, seq: Sequence, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A later chunk's keys: the cache rows of positions [0, end) and its mask [end - start, end] (True =
        attend: position <= the query's); None for a chunk that starts the prompt (it needs neither)."""
        if start == 0:
            return None
        keys = torch.arange(end, device=self.device)
        mask = keys[None, :] <= torch.arange(start, end, device=self.device)[:, None]
        return self._tensor(self._cache_index(seq, range(end))), mask

    # ---- sampling state ------------------------------------------------------------------------------
    def _sampling_row(self, seq: Sequence, vocab_size: int, proposed: list[int] = ()) -> SamplingRow:
        """The row that draws `seq`'s next token, after the `proposed` tokens (speculative decoding) if any."""
        params = seq.params
        out = seq.output_token_ids + list(proposed) if proposed else seq.output_token_ids
        if params.greedy:
            generator = None
        elif params.seed is None:
            generator = self._shared_generator
        elif self._position_seeded:
            generator = torch.Generator(self._generator_device).manual_seed(_position_seed(params.seed, len(out)))
        else:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                seed = params.seed % 2**64  # torch takes [-2**63, 2**64); one signed range maps onto it 1:1
                generator = self._generators[seq.seq_id] = torch.Generator(self._generator_device).manual_seed(seed)
        allowed = None if seq.grammar is None else allowed_tokens(seq.grammar.compute_bitmask(), vocab_size)
        prompt = seq.token_ids[:seq.num_prompt_tokens] if params.repetition_penalty != 1.0 else []
        return SamplingRow(params, out, generator, allowed, self._blocked(seq, out), prompt)

    def _blocked(self, seq: Sequence, out: list[int]) -> list[int]:
        """Tokens the sequence may not take after its output `out`: EOS and stop tokens before min_tokens, and
        the last token of any bad word whose other tokens were just generated."""
        params = seq.params
        vocab = self.model.config.vocab_size  # ids past it cannot be sampled anyway (and would not index)
        early = len(out) < params.min_tokens
        blocked = [t for t in (*self.eos_token_ids, *params.stop_token_ids) if t < vocab] if early else []
        for word in seq.bad_words_ids:
            if len(word) == 1 or (len(out) >= len(word) - 1 and out[len(out) - len(word) + 1:] == list(word[:-1])):
                blocked.append(word[-1])
        return blocked

    def release(self, seq: Sequence) -> None:
        """The sequence finished: drop its sampling state."""
        self._generators.pop(seq.seq_id, None)
