"""ModelRunner: one scheduled batch -> tensors -> forward pass -> one sampled token per sequence.

It owns the model, the paged KV cache and the LoRAManager (built over the engine's AdapterCache). Each step
comes with every sequence's adapter slot; the runner never looks adapters up itself.
"""
from __future__ import annotations

import math
import os

import torch

from loramux.adapters.cache import AdapterCache
from loramux.adapters.manager import LoRAManager
from loramux.config import EngineConfig
from loramux.engine.sequence import Sequence
from loramux.layers.attention import AttentionMetadata
from loramux.layers.linear import can_prepack, fix_linear_rows, prepack_linears
from loramux.layers.sampler import SamplingRow, sample
from loramux.models.loader import LoadedModel
from loramux.models.llama import head_dim_of
from loramux.ops import LoRAMapping, select_attention_backend, select_kv_store_backend, select_pointwise_backend
from loramux.ops.attention_torch import decode_attention_by_length

INVARIANT_ROWS = 32  # batch_invariant: the row count of every GEMM (decode batches up to 32 take one call)


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


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, device: torch.device, cache: AdapterCache | None):
        self.model, self.config, self.device = loaded.model, config, device
        self.max_model_len = loaded.max_model_len
        self.block_size = config.block_size
        lora_backend = "torch-fixed-rows" if config.batch_invariant else config.lora_backend
        self.manager = LoRAManager(self.model, config.lora, lora_backend, cache) if cache else None
        self.dtype = self.model.model.embed_tokens.weight.dtype
        if can_prepack(device, self.dtype):  # after wrapping: the LoRA layers' base Linears are packed too
            prepack_linears(self.model)
        if config.batch_invariant:
            fix_linear_rows(self.model, INVARIANT_ROWS)
        pointwise = select_pointwise_backend(config.pointwise_backend, device)
        for module in self.model.modules():  # RMSNorm, SiluAndMul, RotaryEmbedding name the ops they run
            for attr, name in getattr(module, "pointwise_ops", {}).items():
                setattr(module, attr, getattr(pointwise, name))
        self.argmax = pointwise.argmax  # greedy sampling
        self.num_blocks = self._allocate_kv_cache(loaded.hf_config)
        self._shared_generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self._generators: dict[int, torch.Generator] = {}

    # ---- KV cache ------------------------------------------------------------------------------
    def _allocate_kv_cache(self, hf_config) -> int:
        layers = self.model.attention_layers()
        kv_heads, head_dim = layers[0].num_kv_heads, head_dim_of(hf_config)
        block_bytes = 2 * len(layers) * self.block_size * kv_heads * head_dim * self.dtype.itemsize
        budget = self.config.kv_cache_memory or int(available_memory(self.device) * self.config.kv_cache_fraction)
        blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        num_blocks = min(budget // block_bytes, self.config.max_num_seqs * blocks_per_seq)
        if num_blocks < blocks_per_seq:
            raise ValueError(f"the KV cache budget ({budget} bytes) holds {num_blocks} blocks of {self.block_size} "
                             f"tokens, fewer than one max_model_len={self.max_model_len} sequence needs ({blocks_per_seq})")
        cache = torch.zeros(2, len(layers), num_blocks * self.block_size, kv_heads, head_dim, dtype=self.dtype, device=self.device)
        invariant = self.config.batch_invariant
        decode_op = (decode_attention_by_length if invariant else
                     select_attention_backend(self.config.attention_backend, self.device))
        store_op = select_kv_store_backend("torch" if invariant else self.config.attention_backend, self.device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache, layer.decode_op, layer.store_op = cache[0, i], cache[1, i], decode_op, store_op
            layer.prefill = layer.prefill_per_sequence if invariant else layer.prefill_padded
        self.kv_cache = cache
        return num_blocks

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs: list[Sequence], slots: list[int], is_prefill: bool) -> list[int | None]:
        """Run one step over `seqs`, slots[i] being seqs[i]'s adapter slot (-1 = base; activated by the
        engine); returns their next tokens in order (None where a row's logits were not finite)."""
        grouped = self.manager is not None and self.manager.wants_grouped_tokens
        order = batch_order(slots, grouped)
        ordered, ordered_slots = [seqs[i] for i in order], [slots[i] for i in order]
        prepare = self._prepare_prefill if is_prefill else self._prepare_decode
        input_ids, positions, meta, token_counts, last_indices = prepare(ordered)
        hidden = self._forward(input_ids, positions, meta, ordered_slots, token_counts)
        logits = self.model.compute_logits(hidden[last_indices])
        tokens = sample(logits, [self._sampling_row(s) for s in ordered], self.argmax)
        result: list[int | None] = [0] * len(seqs)
        for i, token in zip(order, tokens):
            result[i] = token
        return result

    def _forward(self, input_ids, positions, meta, slots: list[int], token_counts: list[int]):
        if self.manager is None or all(s < 0 for s in slots):
            return self.model(input_ids, positions, meta)
        token_slots = [slot for slot, n in zip(slots, token_counts) for _ in range(n)]
        with self.manager.mapping(LoRAMapping.from_slots(token_slots, self.device)):
            return self.model(input_ids, positions, meta)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _cache_index(self, seq: Sequence, positions: range) -> list[int]:
        table, size = seq.block_table, self.block_size
        return [table[p // size] * size + p % size for p in positions]

    def _prepare_prefill(self, seqs: list[Sequence]):
        lengths = [len(s) for s in seqs]
        max_len, offsets = max(lengths), [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        input_ids = self._tensor([t for s in seqs for t in s.token_ids])
        positions = self._tensor([p for n in lengths for p in range(n)])
        slot_mapping = self._tensor([i for s, n in zip(seqs, lengths) for i in self._cache_index(s, range(n))])
        # Padded positions repeat the sequence's last token: causal attention never lets a real query see them.
        pad = [[o + min(p, n - 1) for p in range(max_len)] for o, n in zip(offsets, lengths)]
        unpad = [b * max_len + p for b, n in enumerate(lengths) for p in range(n)]
        meta = AttentionMetadata(True, slot_mapping, pad_index=self._tensor(pad), unpad_index=self._tensor(unpad),
                                 seq_offsets=offsets)
        return input_ids, positions, meta, lengths, self._tensor([o - 1 for o in offsets[1:]])

    def _prepare_decode(self, seqs: list[Sequence]):
        lengths = [len(s) for s in seqs]
        max_blocks = max(len(s.block_table) for s in seqs)
        input_ids = self._tensor([s.last_token_id for s in seqs])
        positions = self._tensor([n - 1 for n in lengths])
        slot_mapping = self._tensor([self._cache_index(s, range(n - 1, n))[0] for s, n in zip(seqs, lengths)])
        tables = self._tensor([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs])
        meta = AttentionMetadata(False, slot_mapping, block_tables=tables, context_lens=positions + 1,
                                 block_size=self.block_size)
        return input_ids, positions, meta, [1] * len(seqs), torch.arange(len(seqs), device=self.device)

    # ---- sampling state ------------------------------------------------------------------------------
    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        params = seq.params
        if params.greedy:
            generator = None
        elif params.seed is None:
            generator = self._shared_generator
        else:
            generator = self._generators.get(seq.seq_id)
            if generator is None:
                seed = params.seed % 2**64  # torch takes [-2**63, 2**64); one signed range maps onto it 1:1
                generator = self._generators[seq.seq_id] = torch.Generator(device="cpu").manual_seed(seed)
        return SamplingRow(params, seq.output_token_ids, generator)

    def release(self, seq: Sequence) -> None:
        """The sequence finished: drop its sampling state."""
        self._generators.pop(seq.seq_id, None)
