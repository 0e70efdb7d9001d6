"""LoRALinear: a base nn.Linear plus stacked per-slot LoRA buffers, for batches that mix adapters.

Buffers are allocated once and are zero where no adapter is loaded:
    lora_a[max_loras, num_slices * max_rank, in]
    lora_b[max_loras, out, max_rank], stored rank-major (lora_b.transpose(1, 2) is contiguous): the
        expand reads whole rows of outputs per rank, and a slot of lower rank reads fewer rows
A packed layer (one Linear computing q|k|v or gate|up) has one slice per sub-module: slice i's A is
rows [i*max_rank, (i+1)*max_rank) of lora_a, its B the output rows output_slices[i] of lora_b, so one
shrink serves all slices and B holds no zero blocks (see ops.lora_torch). A missing sub-module stays zero.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from loramux.ops import captures_in_graphs, fuses_with_quantized
from loramux.ops.moe_torch import ExpertLoRA
from loramux.ops.quant_torch import quantized_linear_lora


class LoRAContext:
    """The mapping every LoRA layer of one model reads in a forward pass; None = base model only.

    `mapping` has `for_tokens(num_tokens) -> LoRAMapping` (see ops.mapping)."""

    def __init__(self):
        self.mapping = None


class SlotWrites:
    """Zero fills and copies that put adapters in slots, gathered over many layers and run as two calls. A
    whole adapter is ~20 small writes a layer: one by one, their dispatch (not their bytes) cost the step
    thread ~7 ms an adapter on CPU. `run` zeroes first, so a copy may land inside a region zeroed with it."""

    def __init__(self):
        self.zeros: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor | int] = []

    def zero(self, target: torch.Tensor) -> None:
        self.zeros.append(target)

    def copy(self, target: torch.Tensor, source: torch.Tensor | int) -> None:
        """source: a tensor of target's shape, or an int for a 0-d target."""
        self.targets.append(target)
        self.sources.append(source)

    @torch.no_grad()
    def run(self) -> None:
        if self.zeros:
            torch._foreach_zero_(self.zeros)
        numbers = [i for i, s in enumerate(self.sources) if isinstance(s, int)]
        if numbers:  # one host tensor for all of them: a tensor per number would cost what the copies save
            values = torch.tensor([self.sources[i] for i in numbers], dtype=self.targets[numbers[0]].dtype).unbind()
            for i, value in zip(numbers, values):
                self.sources[i] = value
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources, non_blocking=True)


def base_row_squares(base: nn.Module) -> torch.Tensor:
    """fp32 [out]: the squared L2 norm of each output row of a base layer's weight as it runs (a prepacked one's
    kept from before packing, a quantized one decoded), made once per layer (DoRA's weight norms use it)."""
    if hasattr(base, "linear"):  # FixedRowsLinear: the Linear it runs in fixed-size pieces
        return base_row_squares(base.linear)
    cached = getattr(base, "row_squares", None)
    if cached is None:
        if hasattr(base, "weights"):  # QuantizedLinear: one or more quantized parts, stacked by rows
            from loramux.ops.quant_torch import dequantize

            weight = torch.cat([dequantize(w) for w in base.weights])
        else:
            weight = base.weight
        cached = weight.detach().float().square().sum(1).cpu()
        base.row_squares = cached
    return cached


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Linear,
        max_loras: int,
        max_rank: int,
        context: LoRAContext,
        add_lora: Callable[..., None],
        output_slices: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
    ):
        """dtype: the slot buffers' (LoRAConfig.lora_dtype); None = the activations'. Only 16-bit weights under
        fp32 activations differ (widened exactly; the C++ kernel takes bf16 only, so CPU never asks for fp16):
        fp32 weights under 16-bit activations would be rounded in every product."""
        super().__init__()
        self.base = base
        # True where the engine's own modules (layers.DirectCall) call this one, set by the LoRAManager: forward
        # without nn.Module's hook dispatch, as theirs; in a plain HF model it stays False and hooks run
        self.direct_call = False
        self.context = context
        self.add_lora = add_lora  # backend op, chosen once (ops.select_backend)
        self.max_rank = max_rank
        self.output_slices = tuple(output_slices or (base.out_features,))
        if sum(self.output_slices) != base.out_features:
            raise ValueError(f"output slices {self.output_slices} do not add up to {base.out_features}")
        a_rows = len(self.output_slices) * max_rank
        ref = base.weight if isinstance(base, nn.Linear) else base  # a QuantizedLinear says its activations' dtype
        if dtype not in (None, ref.dtype) and (ref.dtype != torch.float32 or dtype not in (torch.bfloat16, torch.float16)):
            raise ValueError(f"lora_dtype {str(dtype).removeprefix('torch.')} on a "
                             f"{str(ref.dtype).removeprefix('torch.')} model: only 16-bit LoRA weights under "
                             "float32 activations are supported (or auto: the activations' dtype)")
        self.activation_dtype = ref.dtype  # (the slots' may be bf16 under fp32: LoRAConfig.lora_dtype)
        kw = dict(dtype=dtype or ref.dtype, device=ref.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, a_rows, base.in_features, **kw), persistent=False)
        rank_major = torch.zeros(max_loras, max_rank, base.out_features, **kw)
        self.register_buffer("lora_b", rank_major.transpose(1, 2), persistent=False)  # [max_loras, out, max_rank]
        # Real rank per slot (max over slices; 0 = free): ops may skip the zero padding beyond it.
        self.register_buffer("slot_ranks", torch.zeros(max_loras, dtype=torch.long, device=kw["device"]),
                             persistent=False)
        self._views: dict[int, tuple] = {}  # slot -> (the lora_a they view, _slot_views' views)
        self.dora_slots: set[int] = set()  # slots whose adapter has DoRA here (their rows in dora_scale, made then)
        # A quantized base of one format beside the C++ LoRA kernel: a one-token pass on an adapter runs the base
        # matmul and the LoRA as one op, `lora_op` (the quantized-matmul backend's quantized_linear_lora, set by the
        # model runner as QuantizedLinear's op): at batch 1 a second call per projection was most of an adapter's
        # cost. (Other LoRA backends, and every pass of more tokens: base + add_lora.) That call stands in for the
        # base's forward: hooks on the base do not run, and the weight is the one the base had when wrapped.
        self.lora_op = None
        if len(getattr(base, "weights", ())) == 1 and fuses_with_quantized(add_lora):
            self.quant_ops = {"lora_op": "quantized_linear_lora"}
            self.lora_op = quantized_linear_lora
            self.quantized = (base.weights[0], base.bias)  # (a plain tuple: no nn.Module lookup per call)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs) if self.direct_call else super().__call__(*args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_op is not None and x.dim() == 2 and x.shape[0] == 1:
            mapping = self.context.mapping
            slot = -1 if mapping is None else mapping.one_slot
            if slot >= 0:
                buffers = self._buffers
                weight, bias = self.quantized
                y = self.lora_op(x, weight, bias, buffers["lora_a"], buffers["lora_b"], buffers["slot_ranks"], slot,
                                 self.output_slices)
                return self._dora(y) if self.dora_slots else y
        y = self._add_lora(x, self.base(x))
        return self._dora(y) if self.dora_slots else y

    # ---- DoRA: y = g * (W x + s B A x) + bias per row, g = magnitude / ||W + s B A|| of its slot's adapter ----
    def _dora(self, y: torch.Tensor) -> torch.Tensor:
        """Each row's output scaled by its slot's DoRA scale g (row 0 of dora_scale: ones, the base model's; a
        slot without DoRA holds ones too), the bias kept: PEFT's DoRA forward, result = bias + g * (W x + lora)."""
        mapping = self.context.mapping
        if mapping is None:
            return y
        flat = y.view(-1, y.shape[-1])
        scale = self.dora_scale[mapping.for_tokens(flat.shape[0]).token_slots + 1]  # [tokens, out]
        bias = self.base.bias
        if bias is None:
            flat.mul_(scale)
        else:
            flat.sub_(bias).mul_(scale).add_(bias)
        return y

    @torch.no_grad()
    def dora_norm(self, index: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """PEFT's DoRA weight norm ||W_k + b a|| of each output row of slice `index` (b: scaling folded in), fp32
        [out_k], against the base weight this layer runs (a quantized one as it decodes): W_k a^T through the
        base's own forward (a prepacked weight is not kept), each row's |W_k|^2 from base_row_squares."""
        start = sum(self.output_slices[:index])
        rows = slice(start, start + self.output_slices[index])
        device = self.lora_a.device
        wa = self.base(a.to(device=device, dtype=self.activation_dtype)).float()  # [r, out]: a W^T + bias
        if self.base.bias is not None:
            wa -= self.base.bias.float()
        wa = wa[:, rows].t().cpu()  # [out_k, r]
        a32, b32 = a.float().cpu(), b.float().cpu()
        squares = base_row_squares(self.base)[rows] + 2 * (b32 * wa).sum(1) + ((b32 @ (a32 @ a32.t())) * b32).sum(1)
        return squares.clamp(min=0).sqrt()

    def ensure_dora_scale(self) -> None:
        """dora_scale [max_loras + 1, out], all ones (row 0: the base model's), made the first time a DoRA adapter
        comes to this layer (only layers that ever hold one pay for it). Made on the stream the steps run on, so
        a step reading other slots' rows of it never races its making (slot writes may run on a side stream)."""
        if "dora_scale" not in self._buffers:
            self.register_buffer("dora_scale", torch.ones(self.lora_b.shape[0] + 1, self.out_features,
                                                          dtype=self.activation_dtype, device=self.lora_a.device),
                                 persistent=False)

    def plan_scale(self, slot: int, scales: Sequence[torch.Tensor | None], writes: SlotWrites) -> None:
        """Add to `writes` slot's DoRA scales (one per output slice, None: no DoRA there, scale 1); a slot
        without any holds ones, as the base model's row does. (ensure_dora_scale first, where any is given.)"""
        if all(s is None for s in scales):
            if slot in self.dora_slots:
                writes.copy(self.dora_scale[slot + 1], torch.ones(self.out_features, dtype=self.dora_scale.dtype))
                self.dora_slots.discard(slot)
            return
        row = torch.ones(self.out_features)
        start = 0
        for size, scale in zip(self.output_slices, scales):
            if scale is not None:
                row[start:start + size] = scale
            start += size
        writes.copy(self.dora_scale[slot + 1], row.to(self.dora_scale.dtype))
        self.dora_slots.add(slot)

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mapping = self.context.mapping
        if mapping is None:
            return y
        flat_x, flat_y = (x, y) if x.dim() == 2 else (x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1]))
        # 120+ calls per decode step: read the buffers from the dict, not through nn.Module.__getattr__
        buffers = self._buffers
        self.add_lora(flat_y, flat_x, buffers["lora_a"], buffers["lora_b"], mapping.for_tokens(flat_x.shape[0]),
                      self.output_slices, buffers["slot_ranks"])
        return y

    @torch.no_grad()
    def write_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Fill `slot` with one (a [r, in], b [out_i, r]) pair per output slice; None leaves a slice zero.

        Scaling must already be folded into b. Ranks below max_rank are zero-padded."""
        writes = SlotWrites()
        self.plan_slot(slot, parts, writes)
        writes.run()

    def plan_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                  writes: SlotWrites) -> None:
        """Add to `writes` what write_slot(slot, parts) does (checking every part first: nothing is written
        for parts that do not fit)."""
        if len(parts) != len(self.output_slices):
            raise ValueError(f"expected {len(self.output_slices)} parts, got {len(parts)}")
        whole_a, whole_b, ranks, slices = self._slot_views(slot)
        rank, whole = 0, True  # whole: every slice at max_rank, so the copies cover the slot and nothing is zeroed
        for out_i, part, (a_view, b_view) in zip(self.output_slices, parts, slices):
            if part is None:
                whole = False
                continue
            a, b = part
            self._check_part(a, b, out_i)
            r = a.shape[0]
            if r != self.max_rank:
                whole, a_view, b_view = False, a_view[:r], b_view[:, :r]
            writes.copy(a_view, a)
            writes.copy(b_view, b)
            rank = max(rank, r)
        if not whole:
            writes.zero(whole_a)
            writes.zero(whole_b)
        writes.copy(ranks, rank)  # (known here: reading the buffer back would wait for a GPU)

    def _slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """slot's lora_a, lora_b and slot_ranks entry, and each slice's full-rank (A, B) views: made once (an
        indexing op costs more than the small copy it feeds), again if the buffers were replaced (.to())."""
        buffers = self._buffers
        cached = self._views.get(slot)
        if cached is None or cached[0] is not buffers["lora_a"]:
            a, b, r = buffers["lora_a"][slot], buffers["lora_b"][slot], buffers["slot_ranks"][slot]
            rows = [sum(self.output_slices[:i]) for i in range(len(self.output_slices))]
            slices = [(a[i * self.max_rank:(i + 1) * self.max_rank], b[row:row + out_i])
                      for i, (row, out_i) in enumerate(zip(rows, self.output_slices))]
            cached = self._views[slot] = (buffers["lora_a"], (a, b, r, slices))
        return cached[1]

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, scaling: float = 1.0) -> None:
        """Load one adapter's A [r, in] and B [out, r] into `slot`, folding `scaling` into B."""
        self.write_slot(slot, [(a, b * scaling)])

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_ranks[slot] = 0
        if slot in self.dora_slots:
            self.dora_scale[slot + 1].fill_(1)
            self.dora_slots.discard(slot)

    def _check_part(self, a: torch.Tensor, b: torch.Tensor, out_features: int) -> None:
        rank = a.shape[0]
        if rank > self.max_rank:
            raise ValueError(f"rank {rank} is above max_lora_rank={self.max_rank}")
        if a.shape != (rank, self.in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                f"A [r, {self.in_features}] / B [{out_features}, r]"
            )


class PackedLoRALinear(LoRALinear):
    """LoRA over a fused Linear (q|k|v or gate|up): each sub-adapter lands in its output slice."""

    def set_slot(self, slot, a: Sequence, b: Sequence, scaling: Sequence[float] | None = None) -> None:
        """One (A, B) per slice; None for a sub-module the adapter does not touch."""
        scaling = scaling or [1.0] * len(a)
        parts = [None if ai is None else (ai, bi * si) for ai, bi, si in zip(a, b, scaling)]
        self.write_slot(slot, parts)


class SavedCopies:
    """Whole per-slot copies of a layer's weight (PEFT modules_to_save), for LoRAHead and LoRAEmbedding:
    `copies` slot -> [vocab, hidden], on the layer's device (its `lora_a`'s)."""

    copies: dict[int, torch.Tensor]

    def set_copy(self, slot: int, weight: torch.Tensor | None) -> None:
        if weight is None:
            self.copies.pop(slot, None)
        else:  # the host tier's tensor, on this layer's device (the same tensor on a CPU)
            self.copies[slot] = weight.to(self.lora_a.device, non_blocking=True)


class LoRAHead(SavedCopies, LoRALinear):
    """The output head with LoRA, over the rows whose logits are computed (its context maps those rows, not
    the forward pass's tokens), and whole per-slot copies (PEFT modules_to_save): a row whose adapter saved
    the head takes its logits from that adapter's copy."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copies: dict[int, torch.Tensor] = {}  # slot -> [vocab, hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, hidden] (the engine) or [batch, seq, hidden] (an HF model) -> [..., vocab]."""
        y = self.base(x)
        if self.copies and self.context.mapping is not None:
            flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
            mapping = self.context.mapping.for_tokens(flat_x.shape[0])
            for slot, weight in self.copies.items():
                rows = self._rows_of(mapping, slot)
                if rows is not None:
                    flat_y[rows] = torch.nn.functional.linear(flat_x[rows], weight).to(y.dtype)
        return self._add_lora(x, y)

    @staticmethod
    def _rows_of(mapping, slot: int) -> torch.Tensor | None:
        """The rows on `slot` (None: none): picked from the host's list where the mapping has one (the engine's
        head mapping: no wait for the device), else on the device (an HF model's: its nonzero reads back)."""
        host = mapping.host_slots
        if host is None:
            rows = (mapping.token_slots == slot).nonzero().squeeze(1)
            return rows if rows.numel() else None
        picked = [i for i, s in enumerate(host) if s == slot]
        return torch.tensor(picked).to(mapping.token_slots.device, non_blocking=True) if picked else None

    def write_slot(self, slot: int, parts) -> None:
        self.copies.pop(slot, None)  # a write replaces all the slot held (AdapterSlots.write sets the new copy)
        super().write_slot(slot, parts)

    def clear_slot(self, slot: int) -> None:
        super().clear_slot(slot)
        self.copies.pop(slot, None)


class LoRAEmbedding(SavedCopies, nn.Module):
    """An embedding table with per-slot LoRA (PEFT's lora_embedding_A [r, vocab], lora_embedding_B [hidden, r]:
    a token t adds s * B @ A[:, t]) and whole per-slot copies of the table (modules_to_save).

    Buffers: lora_a[max_loras, vocab, max_rank] holds A transposed (a token's rank vector is one row, so a
    lookup is a gather), lora_b[max_loras, hidden, max_rank]. Two forms, chosen once:
    - per slot (add_lora None, the reference and the CPU's): each slot's rows picked out (read on the host);
      a forward pass over adapters without embedding LoRA or copies is the base lookup;
    - through the LoRA op (a graph-safe one: on a GPU): every token's rank vector gathered from its slot's A
      (h [tokens, max_rank]), then the op's expand adds B @ h (its shrink against an identity, exact), with
      slot_ranks 0 for slots without embedding LoRA. Nothing is read on the host and the work does not
      depend on which slots hold what, so a CUDA graph captures it. Copies still pick rows per slot (a dict
      that changes with the slots): decode runs eagerly while one is held (ModelRunner)."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, context: LoRAContext,
                 add_lora: Callable[..., None] | None = None):
        super().__init__()
        self.base, self.context, self.max_rank, self.add_lora = base, context, max_rank, add_lora
        self.in_features, self.out_features = base.num_embeddings, base.embedding_dim  # (one-hot rows in)
        self.output_slices = (self.out_features,)
        ref = base.weight if isinstance(base, nn.Embedding) else base.qweight.data
        kw = dict(dtype=base.weight.dtype if isinstance(base, nn.Embedding) else base.dtype, device=ref.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, self.in_features, max_rank, **kw), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, **kw), persistent=False)
        if add_lora is not None:
            eye = torch.eye(max_rank, **kw).expand(max_loras, max_rank, max_rank).contiguous()
            self.register_buffer("eye", eye, persistent=False)  # the op's A: its shrink passes h through
            self.register_buffer("slot_ranks", torch.zeros(max_loras, dtype=torch.long, device=ref.device),
                                 persistent=False)
        self.ranks: dict[int, int] = {}  # slot -> its embedding LoRA's rank (slots without one are absent)
        self.copies: dict[int, torch.Tensor] = {}  # slot -> [vocab, hidden]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [n] (the engine) or [batch, seq] (an HF model) -> [..., hidden]."""
        y = self.base(ids)
        mapping = self.context.mapping
        if mapping is None or not (self.ranks or self.copies or self.add_lora is not None):
            return y
        flat_ids, flat_y = ids.reshape(-1), y.view(-1, y.shape[-1])
        mapping = mapping.for_tokens(flat_ids.shape[0])
        if self.add_lora is not None:
            return self._through_op(y, flat_ids, flat_y, mapping)
        slots = mapping.token_slots
        for slot in set(self.ranks) | set(self.copies):
            rows = (slots == slot).nonzero().squeeze(1)
            if not rows.numel():
                continue
            tokens = flat_ids[rows]
            if slot in self.copies:
                flat_y[rows] = self.copies[slot][tokens].to(y.dtype)
            r = self.ranks.get(slot, 0)
            if r:
                flat_y[rows] += self.lora_a[slot, tokens, :r] @ self.lora_b[slot, :, :r].t()
        return y

    def _through_op(self, y, flat_ids, flat_y, mapping) -> torch.Tensor:
        slots = mapping.token_slots
        for slot, table in self.copies.items():  # (never inside a graph: see the class)
            flat_y.copy_(torch.where((slots == slot)[:, None], table[flat_ids].to(y.dtype), flat_y))
        h = self.lora_a[slots.clamp(min=0), flat_ids]  # [tokens, max_rank]; base tokens' rows: the op skips them
        self.add_lora(flat_y, h, self.eye, self.lora_b, mapping, (), self.slot_ranks)
        return y

    @torch.no_grad()
    def write_slot(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """parts: [(a [r, vocab], b [hidden, r])] or [None]; scaling already folded into b."""
        self.clear_slot(slot)
        if parts[0] is not None:
            a, b = parts[0]
            self.lora_a[slot, :, : a.shape[0]].copy_(a.t(), non_blocking=True)
            self.lora_b[slot, :, : a.shape[0]].copy_(b, non_blocking=True)
            self.ranks[slot] = a.shape[0]
            if self.add_lora is not None:
                self.slot_ranks[slot] = a.shape[0]

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.ranks.pop(slot, None)
        self.copies.pop(slot, None)
        if self.add_lora is not None:
            self.slot_ranks[slot] = 0


class LoRAExperts(nn.Module):
    """LoRA on an MoE block's experts (models.moe.FusedExperts), per slot and expert: gate_up_proj with two
    slices (gate, up) and down_proj, handed to the fused-experts op, which applies each token's slot on each
    of its experts (ops.moe_torch.ExpertLoRA).

    Buffers: gate_up_a[max_loras, E, 2, max_rank, H], gate_up_b[max_loras, E, 2I, max_rank],
    down_a[max_loras, E, 1, max_rank, I], down_b[max_loras, E, H, max_rank] (the b's stored rank-major);
    ranks: each slot's rank (0 = none)."""

    def __init__(self, base: nn.Module, max_loras: int, max_rank: int, context: LoRAContext):
        super().__init__()
        self.base, self.context, self.max_rank = base, context, max_rank
        num, hidden, inter = base.num_experts, base.hidden_size, base.intermediate_size
        kw = dict(dtype=base.gate_up_proj.dtype, device=base.gate_up_proj.device)
        self.register_buffer("gate_up_a", torch.zeros(max_loras, num, 2, max_rank, hidden, **kw), persistent=False)
        self.register_buffer("down_a", torch.zeros(max_loras, num, 1, max_rank, inter, **kw), persistent=False)
        # B rank-major (as LoRALinear's): the C++ add_lora reads one rank row of contiguous outputs at a time
        self.register_buffer("gate_up_b", torch.zeros(max_loras, num, max_rank, 2 * inter, **kw).transpose(2, 3),
                             persistent=False)
        self.register_buffer("down_b", torch.zeros(max_loras, num, max_rank, hidden, **kw).transpose(2, 3),
                             persistent=False)
        self.ranks = [0] * max_loras
        # ranks, each repeated for E experts; on the buffers' device (the Triton op reads it there)
        self.expert_ranks = torch.zeros(max_loras * num, dtype=torch.long, device=kw["device"])

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.base.num_experts, self.base.hidden_size, self.base.intermediate_size

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """With no expert LoRA in any slot the base op alone, except under a graph-safe op: a CUDA graph
        captured now must also serve adapters with expert LoRA later (their programs run where ranks > 0)."""
        mapping = self.context.mapping
        if mapping is None or not (any(self.ranks) or captures_in_graphs(self.base.op)):
            return self.base(x, topk_ids, topk_weights)
        num, slots = self.base.num_experts, self.gate_up_a.shape[0]
        lora = ExpertLoRA(self.gate_up_a.view(slots, num, 2 * self.max_rank, -1), self.gate_up_b,
                          self.down_a.view(slots, num, self.max_rank, -1), self.down_b, self.ranks, self.expert_ranks,
                          mapping.for_tokens(x.shape[0]).token_slots)
        return self.base(x, topk_ids, topk_weights, lora)

    @torch.no_grad()
    def write_slot(self, slot: int, parts) -> None:
        """parts: [(a [E, 2, r, H], b [E, 2I, r]) or None, (a [E, 1, r, I], b [E, H, r]) or None]."""
        self.clear_slot(slot)
        for (a_buf, b_buf), part in zip(((self.gate_up_a, self.gate_up_b), (self.down_a, self.down_b)), parts):
            if part is not None:
                a, b = part
                r = b.shape[-1]
                a_buf[slot, :, :, :r].copy_(a, non_blocking=True)
                b_buf[slot, :, :, :r].copy_(b, non_blocking=True)
                self.ranks[slot] = max(self.ranks[slot], r)
        self._sync_expert_ranks(slot)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        for buffer in (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b):
            buffer[slot].zero_()
        self.ranks[slot] = 0
        self._sync_expert_ranks(slot)

    def _sync_expert_ranks(self, slot: int) -> None:
        num = self.base.num_experts
        self.expert_ranks[slot * num:(slot + 1) * num] = self.ranks[slot]
