"""DecodeGraphs: decode steps replayed as CUDA graphs, one captured per batch size.

A decode step's forward reads nothing but DecodeInputs' device side (and the weights, slots and KV cache,
which stay where they are), so a graph captured once for a batch size replays every later step of that size
or less, padded up to it: the host's work per step falls from ~35-40 launches a layer to one input copy and
one replay. The LoRA op's programs for the base model's rows and for unused slots return at once
(ops/lora_triton.py), so one graph serves any mix of adapters. Sizes are vLLM's: 1, 2, 4, then every
multiple of 8 up to max_num_seqs; a step of more rows than the largest runs eagerly.

What cannot be captured (an op that reads tensors on the host, or picks its work by their values) keeps decode
eager, through the same buffers; graph_blockers says why, and the runner logs it once at start.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.config import EngineConfig
from loramux.layers.lora import LoRAEmbedding
from loramux.models.moe import FusedExperts
from loramux.ops import captures_in_graphs


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's batch sizes: 1, 2, 4, then the multiples of 8, up to max_num_seqs (which is one of them)."""
    sizes = [s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    return tuple(sorted({*sizes, max_num_seqs}))


def graph_blockers(model: torch.nn.Module, config: EngineConfig, add_lora, decode_op) -> list[str]:
    """Why decode steps of `model` cannot run as CUDA graphs ([]: they can). add_lora: the LoRA op (None:
    LoRA off); decode_op: the decode-attention op."""
    reasons = []
    if config.enforce_eager:
        reasons.append("enforce_eager is set")
    if config.batch_invariant:
        reasons.append("batch_invariant attention groups rows by their lengths on the host")
    if add_lora is not None and not captures_in_graphs(add_lora):
        reasons.append(f"the LoRA op {add_lora.__name__} reads its token segments on the host (the 'triton' "
                       "backend does not)")
    if not captures_in_graphs(decode_op):
        reasons.append(f"the decode-attention op {decode_op.__name__} cannot be captured")
    if any(isinstance(m, FusedExperts) and not captures_in_graphs(m.op) for m in model.modules()):
        reasons.append("the fused-experts op counts each expert's tokens on the host (the 'triton' one does not)")
    if any(isinstance(m, LoRAEmbedding) and m.add_lora is None for m in model.modules()):
        reasons.append("embedding LoRA picks each adapter's rows on the host (its LoRA op is not graph-safe)")
    return reasons


class DecodeGraphs:
    """One CUDA graph per batch size, of `forward(rows)` -> hidden [rows, hidden] over the first `rows` rows
    of the decode inputs. Captured at start (largest first, sharing one memory pool), after one eager run
    each (Triton compiles and the ops' small per-shape tensors are made outside the capture)."""

    def __init__(self, forward: Callable[[int], torch.Tensor], sizes: tuple[int, ...],
                 prepare: Callable[[int], None]):
        """prepare(rows): the decode inputs' first `rows` rows made padding, on the device (a capture's run)."""
        self.sizes = sizes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(sizes, reverse=True):
            prepare(size)
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()

    def size_for(self, rows: int) -> int | None:
        """The captured batch size a step of `rows` rows pads to (None: more rows than any)."""
        return next((s for s in self.sizes if s >= rows), None)

    def replay(self, size: int, rows: int) -> torch.Tensor:
        """Replay the graph of `size` over the inputs as they are: hidden [rows, hidden] (a view of the graph's
        output, valid until the next replay)."""
        graph, out = self._graphs[size]
        graph.replay()
        return out[:rows]
