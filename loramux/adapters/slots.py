"""AdapterSlots: the device side of the adapter system over one model.

It wraps the model's target modules in LoRA layers (each holding stacked slot buffers, allocated once),
writes an adapter's weights into a slot and clears it, and sets the per-step mapping every LoRA layer
reads (which slot each token uses; -1 = base model). It knows slots, not adapters: the store decides
which adapter goes where (AdapterCache) and hands it the weights.

On a CUDA device slot writes run on a stream of their own (SlotCopies): a step that does not use the slot
being written runs beside the copy, and the engine holds a slot's requests out of the steps until its copy
is done (ready), or, with nothing else to run, has the step wait for it on the device (wait).
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loramux.adapters.checkpoint import AdapterWeights
from loramux.config import LoRAConfig
from loramux.layers import DirectCall
from loramux.layers.lora import (LoRAContext, LoRAEmbedding, LoRAExperts, LoRAHead, LoRALinear, PackedLoRALinear,
                                 SlotWrites)
from loramux.layers.quantized import QuantizedEmbedding, QuantizedLinear
from loramux.models.moe import FusedExperts
from loramux.ops import LoRAMapping, captures_in_graphs, select_backend, wants_grouped_tokens

logger = logging.getLogger(__name__)

_OUTPUT_HEADS = ("lm_head", "embed_out", "output")  # PEFT's "all-linear" leaves the output layer out


@dataclass(frozen=True)
class _Binding:
    """Where one adapter module (e.g. model.layers.0.self_attn.q_proj) lands: a layer and its slice."""

    layer: LoRALinear
    slice_index: int


def _plain_weight(module: nn.Module) -> torch.Tensor:
    """An embedding's or head's weight as plain values ([vocab, hidden]; a quantized one decoded)."""
    if isinstance(module, (QuantizedEmbedding, QuantizedLinear)):
        from loramux.ops.quant_torch import dequantize

        weights = [module.qweight] if isinstance(module, QuantizedEmbedding) else module.weights
        return torch.cat([dequantize(w) for w in weights])
    return module.weight


def _slot_dtype(lora_dtype: str, device: torch.device) -> torch.dtype | None:
    """LoRAConfig.lora_dtype as the linear layers' slot dtype (None: the activations')."""
    if lora_dtype == "auto":
        return None
    if lora_dtype == "float16" and device.type == "cpu":
        logger.warning("lora_dtype float16 is not supported on CPU; running the LoRA weights in bfloat16")
        return torch.bfloat16
    return getattr(torch, lora_dtype)


class SlotCopies:
    """Where slot writes run. On a CUDA device: a side stream, each slot's latest write marked by an event. A
    write first waits (on the device) for the work the compute stream has queued: earlier steps may still read
    the slot's old contents. On a CPU: in order, done when written (every slot always ready)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events: dict[int, torch.cuda.Event] = {}

    @contextlib.contextmanager
    def writing(self, slot: int) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield
        event = torch.cuda.Event()
        event.record(self.stream)
        self._events[slot] = event

    def ready(self, slot: int) -> bool:
        """Whether `slot`'s latest write is done (a query: the host does not wait)."""
        event = self._events.get(slot)
        if event is not None and not event.query():
            return False
        self._events.pop(slot, None)
        return True

    def wait(self, slot: int) -> None:
        """The compute stream's next work waits (on the device) for `slot`'s latest write."""
        event = self._events.pop(slot, None)
        if event is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(event)


class AdapterSlots:
    def __init__(self, model: nn.Module, config: LoRAConfig, backend: str = "auto"):
        self.model, self.config = model, config
        self.context = LoRAContext()  # the forward pass's tokens
        self.head_context = LoRAContext()  # the rows whose logits are computed (the output head's LoRA)
        self.base_weights: dict[str, torch.Tensor] = {}  # wrapped embedding / head -> its plain weight
        self.add_lora = select_backend(backend, next(model.parameters()).device)  # the LoRA op, chosen once
        self.wants_grouped_tokens = wants_grouped_tokens(self.add_lora)  # see ModelRunner.run
        self._layers: dict[str, tuple[LoRALinear, tuple[str, ...]]] = {}  # layer name -> (layer, module names)
        self._bindings: dict[str, _Binding] = {}
        self.unwrapped_experts: dict[str, tuple[int, int, int]] = {}  # MoE blocks left without expert LoRA
        self._lora_dtype = _slot_dtype(config.lora_dtype, next(model.parameters()).device)
        self._dora_slots: set[int] = set()  # slots holding an adapter with DoRA
        self._wrap_targets()
        self.copies = SlotCopies(self.device)

    # ---- wrapping --------------------------------------------------------------------------------
    def _wrap_targets(self) -> None:
        packed = getattr(self.model, "packed_modules_mapping", {})
        targets = set(self.config.targets)
        found = []
        linear = set()  # what PEFT's "all-linear" stands for here: every Linear but the output head
        for name, module in self.model.named_modules():
            attr = name.rsplit(".", 1)[-1]
            if isinstance(module, FusedExperts) and "experts" not in targets:
                self.unwrapped_experts[name] = (module.num_experts, module.hidden_size, module.intermediate_size)
            if isinstance(module, (nn.Linear, QuantizedLinear, LoRALinear)) and attr not in _OUTPUT_HEADS:
                linear.update(packed.get(attr, (attr,)))
            if not isinstance(module, (nn.Linear, QuantizedLinear, nn.Embedding, QuantizedEmbedding, FusedExperts)):
                continue  # a LoRA layer is none of these, so nothing is wrapped twice
            if attr in targets or targets & set(packed.get(attr, ())):
                found.append((name, module, packed.get(attr)))
        if not found:
            raise ValueError(f"no Linear module of the model matches target_modules {sorted(targets)}")
        for name, module, sub_names in found:
            self._wrap(name, module, sub_names)
        self.all_linear = tuple(sorted(linear))
        self.wraps_head = any(isinstance(layer, LoRAHead) for layer, _ in self._layers.values())

    def _wrap(self, name: str, base: nn.Module, sub_names: Sequence[str] | None) -> None:
        prefix, _, attr = name.rpartition(".")
        layer, modules = self._layer_for(name, base, sub_names)
        parent = self.model.get_submodule(prefix) if prefix else self.model
        parent.register_module(attr, layer)
        if isinstance(layer, LoRALinear):  # called by the engine's own modules: no hook dispatch either
            layer.direct_call = isinstance(parent, DirectCall)
        self._layers[name] = (layer, modules)
        for i, module in enumerate(modules):
            self._bindings[module] = _Binding(layer, i)

    def _layer_for(self, name: str, base: nn.Module, sub_names: Sequence[str] | None):
        """The LoRA layer that wraps `base`, and the adapter module names it takes weights for."""
        prefix, _, attr = name.rpartition(".")
        config = self.config
        kw = dict(max_loras=config.max_loras, max_rank=config.max_lora_rank, context=self.context,
                  add_lora=self.add_lora, dtype=self._lora_dtype)
        if isinstance(base, (nn.Embedding, QuantizedEmbedding)) or attr in _OUTPUT_HEADS:
            self.base_weights[name] = _plain_weight(base)  # (before prepacking) for adapters' copies of it
        if isinstance(base, FusedExperts):  # an MoE block's experts: one layer, both 3D weights
            layer = LoRAExperts(base, config.max_loras, config.max_lora_rank, self.context)
            return layer, (f"{name}.gate_up_proj", f"{name}.down_proj")
        if isinstance(base, (nn.Embedding, QuantizedEmbedding)):
            op = self.add_lora if captures_in_graphs(self.add_lora) else None  # the per-slot form reads the host
            return LoRAEmbedding(base, config.max_loras, config.max_lora_rank, self.context, op), (name,)
        if attr in _OUTPUT_HEADS:  # its rows are the ones whose logits are computed: a context of its own
            return LoRAHead(base, **{**kw, "context": self.head_context}), (name,)
        if sub_names:
            sizes = getattr(base, "output_sizes", None)
            if sizes is None or len(sizes) != len(sub_names):
                raise ValueError(f"packed module {name!r} needs output_sizes for {list(sub_names)}")
            modules = tuple(f"{prefix}.{s}" if prefix else s for s in sub_names)
            return PackedLoRALinear(base, output_slices=sizes, **kw), modules
        return LoRALinear(base, **kw), (name,)

    # ---- what an adapter may hold ------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        """Bytes of the LoRA layers' slot buffers, allocated for max_loras x max_lora_rank at start."""
        return sum(buffer.nbytes for layer, _ in self._layers.values() for buffer in layer.buffers())

    def slot_bytes_of(self, targets: Sequence[str]) -> int:
        """Bytes of the slot buffers of the layers wrapping `targets` (module-name suffixes, as target_modules)."""
        return sum(buffer.nbytes for name, (layer, _) in self._layers.items() if name.rsplit(".", 1)[-1] in targets
                   for buffer in layer.buffers())

    @functools.cached_property
    def _module_shapes(self) -> dict[str, tuple[int, int]]:  # the wrapping is done once, in __init__
        return {m: (b.layer.in_features, b.layer.output_slices[b.slice_index]) for m, b in self._bindings.items()
                if not isinstance(b.layer, LoRAExperts)}

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """Adapter module name -> (in, out) features, for every wrapped linear module (packed ones by slice)."""
        return dict(self._module_shapes)

    def expert_shapes(self) -> dict[str, tuple[int, int, int]]:
        """MoE blocks with expert LoRA: block name -> (experts, hidden, one expert's intermediate size)."""
        return {name: layer.shape for name, (layer, _) in self._layers.items() if isinstance(layer, LoRAExperts)}

    def max_weight_bytes(self) -> int:
        """The most bytes a weights file of a servable adapter can need: every wrapped module at max rank in
        fp32, and whole copies of a wrapped embedding / head (PEFT's save_embedding_layers and modules_to_save:
        two each), with room for a header and for weights of modules PEFT would ignore (x2)."""
        rank = self.config.max_lora_rank
        lora = sum(4 * rank * (i + o) for i, o in self.module_shapes().values())
        experts = [*self.expert_shapes().values(), *self.unwrapped_experts.values()]  # (refused by what they hold)
        lora += sum(4 * rank * e * (4 * h + 3 * i) for e, h, i in experts)
        whole = sum(2 * 4 * w.numel() for w in self.base_weights.values())
        return 2 * (lora + whole) + (1 << 20)

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype adapters' host tensors are built in: whole copies and expert LoRA stay in it (bf16 slots,
        lora_dtype, round on copy)."""
        layer = next(iter(self._layers.values()))[0]
        return getattr(layer, "activation_dtype", self._slot_buffer.dtype)

    # ---- slot buffers ------------------------------------------------------------------------------
    def write(self, slot: int, weights: AdapterWeights) -> None:
        """The linear layers' writes gathered and run at once (SlotWrites): all their parts are checked before
        any is written. (Embeddings and experts, rarer, write their own.)"""
        writes, saved = SlotWrites(), []
        for layer, modules in self._layers.values() if weights.has_dora else ():
            if any(weights.modules[m].scale is not None for m in modules if m in weights.modules):
                layer.ensure_dora_scale()  # (on the steps' stream: see LoRALinear.ensure_dora_scale)
        with self.copies.writing(slot):  # copies into the slot buffers
            for layer, modules in self._layers.values():
                found = [weights.modules.get(m) for m in modules]
                parts = [None if p is None else (p.a, p.b) for p in found]
                if isinstance(layer, LoRALinear):
                    layer.plan_slot(slot, parts, writes)
                    layer.plan_scale(slot, [None if p is None else p.scale for p in found], writes)
                else:
                    layer.write_slot(slot, parts)
                if isinstance(layer, (LoRAHead, LoRAEmbedding)):
                    saved.append((layer, weights.copies.get(modules[0])))
            writes.run()
        for layer, copy in saved:  # whole saved copies are new device tensors: made on the compute stream
            layer.set_copy(slot, copy)
        if weights.has_dora:
            self._dora_slots.add(slot)
        else:
            self._dora_slots.discard(slot)

    def clear(self, slot: int) -> None:
        with self.copies.writing(slot):
            for layer, _ in self._layers.values():
                layer.clear_slot(slot)
        self._dora_slots.discard(slot)

    def dora_scale(self, module: str, a: torch.Tensor, b: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        """fp32 [out]: the DoRA scale magnitude / ||W + b a|| of each output row of `module` (b: scaling folded
        in), against the base weight the engine runs (LoRALinear.dora_norm). Made once per load."""
        binding = self._bindings[module]
        return magnitude.float() / binding.layer.dora_norm(binding.slice_index, a, b)

    # ---- forward-pass mappings ---------------------------------------------------------------------
    @contextlib.contextmanager
    def mapping(self, mapping, head: bool = False) -> Iterator[None]:
        """Set the LoRA mapping every layer reads (an ops.LoRAMapping; LoRAModel's RowSlots or UniformSlot);
        head: the output head's too (an HF model computes the logits of every token it is given; the engine
        sets the head's rows itself, head_mapping)."""
        contexts = [self.context] + ([self.head_context] if head else [])
        previous = [c.mapping for c in contexts]
        for c in contexts:
            c.mapping = mapping
        try:
            yield
        finally:
            for c, p in zip(contexts, previous):
                c.mapping = p

    @contextlib.contextmanager
    def head_mapping(self, row_slots: Sequence[int]) -> Iterator[None]:
        """The slot of each row whose logits are computed next, for a LoRA output head (when it is wrapped)."""
        if not self.wraps_head or all(s < 0 for s in row_slots):
            yield
            return
        previous, self.head_context.mapping = self.head_context.mapping, LoRAMapping.from_host(row_slots, self.device)
        try:
            yield
        finally:
            self.head_context.mapping = previous

    def set_mapping(self, mapping) -> None:
        """Every row, the head's too, on `mapping` until set again (LoRAModel.switch; None = base model)."""
        self.context.mapping = self.head_context.mapping = mapping

    @property
    def needs_eager(self) -> bool:
        """Whether a slot holds what a CUDA graph captured without it cannot replay: a whole embedding table of its
        adapter's (modules_to_save; a forward picks rows per slot, LoRAEmbedding) or a DoRA adapter (its rows
        scaled by a gather the graph does not hold)."""
        return bool(self._dora_slots) or any(layer.copies for layer in self._embeddings)

    @functools.cached_property
    def _embeddings(self) -> list[LoRAEmbedding]:  # (the wrapping is done once, in __init__)
        return [layer for layer, _ in self._layers.values() if isinstance(layer, LoRAEmbedding)]

    @property
    def _slot_buffer(self) -> torch.Tensor:
        """A LoRA layer's slot buffer: every layer's share its dtype and device."""
        return next(next(iter(self._layers.values()))[0].buffers())

    @property
    def device(self) -> torch.device:
        return self._slot_buffer.device
