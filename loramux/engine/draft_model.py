"""DraftModel: speculative decoding's draft-model proposer (SpeculativeConfig method "draft_model").

A smaller model of the same vocabulary proposes each speculating sequence's next k tokens greedily. It runs in
a model runner of its own, without adapters, whose KV cache has the target's blocks: a sequence's block table
indexes both caches, so the block manager and the scheduler need nothing of their own for it. What the draft
writes only ever changes proposals, never outputs (the target verifies every token), so its K/V need only be
right often, not always: a sequence's `draft_computed` says how many of its positions the draft has K/V for;
before proposing, the draft catches up on the rest (its prompt, the tokens kept since, and whatever a shared
prefix block or a preemption left it), in the same pass that gives its first proposal.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from loramux.adapters.off import NoSlots
from loramux.config import EngineConfig
from loramux.engine.model_runner import ModelRunner
from loramux.engine.sequence import Sequence
from loramux.models.loader import load_model


class DraftModel:
    free = False  # its proposals cost a pass each: made only for the tokens the plan asked for

    def __init__(self, config: EngineConfig, device: torch.device, num_blocks: int, vocab_size: int):
        """config: the engine's (the draft's path in speculative_config.model); num_blocks: the target's KV-cache
        blocks; vocab_size: the target's, which the draft's must equal."""
        path = config.speculative_config.model
        loaded = load_model(path, config.dtype, device, config.max_model_len)
        draft_vocab = int(loaded.hf_config.vocab_size)
        if draft_vocab != vocab_size:
            raise ValueError(f"the draft model {path!r} has a vocabulary of {draft_vocab} tokens, the model "
                             f"{vocab_size}: a draft must share the model's tokenizer")
        if loaded.max_model_len < config.max_model_len:
            raise ValueError(f"the draft model {path!r} takes {loaded.max_model_len} positions, fewer than "
                             f"max_model_len={config.max_model_len}")
        own = replace(config, lora=None, speculative_config=None, enforce_eager=True, startup_adapters=())
        self.runner = ModelRunner(loaded, own, device, NoSlots(), num_blocks=num_blocks)

    def propose_all(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Each sequence's next ks[i] tokens as the draft predicts them greedily (ks[i] = 0: none). Writes the
        draft's K/V for the sequence's positions up to its last proposal but one."""
        rows = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        for i in rows:
            seqs[i].draft_ids = []
        # the first pass: each row from where its draft K/V end to its last token; then one token a pass
        spans = {i: (min(seqs[i].draft_computed, len(seqs[i]) - 1), len(seqs[i])) for i in rows}
        while rows:
            tokens = self._next_tokens([seqs[i] for i in rows], [spans[i] for i in rows])
            for i, token in zip(rows, tokens):
                seq = seqs[i]
                seq.draft_computed = spans[i][1]
                drafts[i].append(token)
                seq.draft_ids = drafts[i]  # the next pass feeds it (model_runner._tokens)
                spans[i] = (spans[i][1], spans[i][1] + 1)
            rows = [i for i in rows if len(drafts[i]) < ks[i]]
        for seq in seqs:
            seq.draft_ids = []
        return drafts

    def _next_tokens(self, seqs: list[Sequence], spans: list[tuple[int, int]]) -> list[int]:
        """One forward pass of the draft over each sequence's span, and its greedy token after the span's end."""
        runner = self.runner
        order = sorted(range(len(seqs)), key=lambda i: spans[i][1] - spans[i][0] > 1)  # one-token rows first
        ordered, ordered_spans = [seqs[i] for i in order], [spans[i] for i in order]
        input_ids, positions, meta, offsets = runner._prepare_mixed(ordered, ordered_spans)
        hidden = runner._forward(input_ids, positions, meta, [-1] * len(input_ids))
        logits = runner.model.compute_logits(hidden[[offsets[j + 1] - 1 for j in range(len(ordered))]])
        tokens = logits.argmax(-1).tolist()
        out = [0] * len(seqs)
        for j, i in enumerate(order):
            out[i] = tokens[j]
        return out
