"""DecodeInputs: a decode step's inputs in buffers allocated once, refilled every step by one copy.

One int64 buffer of max_rows rows holds, field after field (each field contiguous, so a prefix of rows is
a contiguous view):
    ids [R]             the token each row feeds (its sequence's last)
    positions [R]       that token's position
    cache_rows [R]      where its K/V is written
    context_lens [R]    the keys it attends to, its own included
    token_slots [R]     its adapter slot (-1: the base model)
    block_tables [R, W] its sequence's block table, W = the blocks of a max_model_len sequence
Rows from the step's count up to the rows asked for (a CUDA graph's batch size) are padding: token 0 at
position 0, written to the scratch row (a cache row no sequence owns), attending to one key, base model.
Table entries past a sequence's blocks keep whatever an earlier step wrote there: always a valid block id,
never read (a row reads the blocks its context length covers).

On a GPU the host side is pinned and reaches the device side by one non-blocking copy a step; kernels and
captured graphs read the device side in place. On a CPU the two sides are one buffer.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from loramux.engine.sequence import Sequence

_FIELDS = ("ids", "positions", "cache_rows", "context_lens", "token_slots")


class DecodeViews(NamedTuple):
    """Views of the device side, rows [0, n)."""

    ids: torch.Tensor
    positions: torch.Tensor
    cache_rows: torch.Tensor
    context_lens: torch.Tensor
    token_slots: torch.Tensor
    block_tables: torch.Tensor  # [n, blocks]


class DecodeInputs:
    def __init__(self, max_rows: int, width: int, block_size: int, scratch_row: int, device: torch.device):
        """width: block-table entries per row; scratch_row: the cache row padding rows write to."""
        self.max_rows, self.width, self.block_size, self.scratch_row = max_rows, width, block_size, scratch_row
        size = max_rows * (len(_FIELDS) + width)
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=on_gpu)
        self.device_side = torch.zeros(size, dtype=torch.long, device=device) if on_gpu else self.host
        self._copied = torch.cuda.Event() if on_gpu else None  # the last copy has read the host side
        self._host = self.host.numpy()  # (numpy fills from Python lists without a tensor per field)
        self._fields = {name: self._host[i * max_rows:(i + 1) * max_rows] for i, name in enumerate(_FIELDS)}
        self._tables = self._host[len(_FIELDS) * max_rows:].reshape(max_rows, width)
        self._views = self._split(self.device_side)
        self.pad(0, max_rows)

    def _split(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = self.max_rows
        views = {name: buffer[i * rows:(i + 1) * rows] for i, name in enumerate(_FIELDS)}
        views["block_tables"] = buffer[len(_FIELDS) * rows:].view(rows, self.width)
        return views

    def fill(self, seqs: Seq[Sequence], slots: Seq[int], rows: int | None = None) -> None:
        """Write the step's rows (seqs[i] on adapter slot slots[i]), then padding up to `rows`, and send them
        to the device side."""
        n, rows = len(seqs), rows or len(seqs)
        if not n <= rows <= self.max_rows:
            raise ValueError(f"{n} sequences padded to {rows} rows do not fit {self.max_rows} rows")
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # (done long since, as a rule: each step waits for its sampled tokens)
        f, size = self._fields, self.block_size
        lengths = [len(s) for s in seqs]
        f["ids"][:n] = [s.last_token_id for s in seqs]
        f["positions"][:n] = [length - 1 for length in lengths]
        f["cache_rows"][:n] = [s.block_table[(length - 1) // size] * size + (length - 1) % size
                               for s, length in zip(seqs, lengths)]
        f["context_lens"][:n] = lengths
        f["token_slots"][:n] = slots
        for row, seq in enumerate(seqs):
            self._tables[row, :len(seq.block_table)] = seq.block_table
        self.pad(n, rows)
        self.send()

    def pad(self, start: int, end: int) -> None:
        """Rows [start, end) become padding (host side)."""
        f = self._fields
        f["ids"][start:end] = 0
        f["positions"][start:end] = 0
        f["cache_rows"][start:end] = self.scratch_row
        f["context_lens"][start:end] = 1
        f["token_slots"][start:end] = -1

    def views(self, n: int, blocks: int | None = None) -> DecodeViews:
        """The device side's rows [0, n), block tables cut to `blocks` columns (None: all of them)."""
        v = self._views
        tables = v["block_tables"][:n] if blocks is None else v["block_tables"][:n, :blocks]
        return DecodeViews(*(v[name][:n] for name in _FIELDS), tables)

    def send(self) -> None:
        """The host side as it is to the device side: one non-blocking copy (nothing to do on a CPU)."""
        if self._copied is not None:
            self.device_side.copy_(self.host, non_blocking=True)
            self._copied.record()
