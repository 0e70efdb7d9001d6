"""Sequence: one request's tokens and state as it moves through the engine. No torch."""
from __future__ import annotations

import enum
import itertools
import time

from loramux.engine.fair_queue import Origin
from loramux.sampling_params import SamplingParams

PROMPT_LOGPROBS_WEIGHT = 2
"""A prompt token scored with its logprobs costs about twice a plain one (the output head's logits and a
log-softmax over the vocabulary at every position: +60-100% on the default model). The scheduler weighs such
a prefill's chunks by it, and the server's admission its prompt."""

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None = None,
                 request_id: str | None = None, origin: Origin = Origin()):
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.adapter = adapter  # the name the request asked for
        self.origin = origin  # its tenant (a prefix cache of its own) and fair share
        self.fair_tag = 0.0  # its start tag in the fair queue (engine.fair_queue), set when it is queued
        self.adapter_ref = None  # the identity (AdapterRef) it runs on, fixed when it is first admitted
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (0 again after a preemption)
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.waited_steps = 0  # scheduler steps spent waiting while others were admitted (age bound)
        self.num_preemptions = 0
        self.bad_words_ids: list[tuple[int, ...]] = []  # SamplingParams.bad_words as token ids (set by the engine)
        self.prompt_logprobs = None  # a chunked prefill's prompt logprobs so far (engine.output.Logprobs)
        self.pooled_sum = None  # mean pooling: the sum of its prompt's hidden states so far (float32 [hidden])
        self.grammar = None  # structured outputs: its llguidance matcher (engine.grammar), fed every token it samples
        # the prefix cache (BlockManager): the chain of its full blocks' hashes, their salt (its adapter identity,
        # set at admission), blocks already cached, hashes it is computing, and what its first admission found
        self.block_hashes: list[bytes] = []
        self.cache_salt: bytes | None = None
        # aLoRA (set at admission): the first position its adapter acts on (0: every position), and the salt of
        # the blocks before it, computed by the base model (shared with the base model's requests)
        self.activation = 0
        self.base_salt: bytes | None = None
        self.num_registered_blocks = 0
        self.claims: list[tuple[int, bytes]] = []
        self.num_cached_tokens: int | None = None
        # speculative decoding (engine/speculative.py): the tokens it proposes for the step being scheduled (their
        # K/V are written at positions len..len+k-1 and kept only where accepted), and its acceptance so far
        self.draft_ids: list[int] = []
        self.acceptance = None
        self.draft_computed = 0  # a draft model's positions with K/V (engine/draft_model.py)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        """More than the last token still lacks K/V: the next step runs (a chunk of) a prefill."""
        return self.num_computed_tokens < len(self.token_ids) - 1

    @property
    def scores_prompt(self) -> bool:
        """A first prefill whose prompt logprobs are asked for: every prompt position is computed and scored."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def prompt_token_cost(self) -> int:
        """What one of its prompt tokens costs a step, in plain prompt tokens."""
        return PROMPT_LOGPROBS_WEIGHT if self.scores_prompt else 1

    @property
    def prompt_work_left(self) -> int:
        """Its tokens still without K/V, in a step's budget units (prompt_token_cost each)."""
        return (len(self.token_ids) - self.num_computed_tokens) * self.prompt_token_cost

    @property
    def reads_cache(self) -> bool:
        """Whether its prefill may start from cached blocks: not when it scores its prompt or mean-pools it
        (every position must be computed; as vLLM, such a request bypasses the cache)."""
        return not self.scores_prompt and self.params.pooling != "mean"

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
