"""StepCost: how long the engine's steps take, learned from the steps it runs. No torch.

Chunked prefill mixes decode rows (one token for each running stream) with prompt chunks. A long prompt's
chunk can make a step many times longer than a decode step, and every stream, and every request that
arrives meanwhile, then waits that long. The scheduler bounds a step to about `slowdown` times a decode-only
step of D rows, the batch the engine is about to decode (the rows decoding now, and the requests whose
prompts finish within a step's token budget): `prompt_allowance(rows, D)` says how many prompt tokens that
leaves.

The model, fitted by least squares to the steps run (the newer weighted more):
    step seconds = fixed + per_row x (decode rows + prompt tokens) + per_chunk x [the step has prompt tokens]
- One per_row for decode rows and prompt tokens: each takes one row through every weight matrix, and a cost
  fitted to both kinds of step stays current. Under load almost every step carries a prompt chunk; a decode
  step's time learned from the decode-only steps alone went stale, and a chunk's whole excess over it,
  charged to the chunk's tokens, made the small chunks the bound allows look dear, which shrank the
  allowance further: the engine settled at whatever batch it started from.
- per_chunk: what a step pays for carrying prompt chunks at all (their attention calls, sampling at a prompt's
  end), whatever their size. Where it alone exceeds the allowed slowdown (a small model, whose steps are
  mostly fixed costs) a step carries MIN_CHUNK tokens.
The decode-only and the mixed steps keep separate moving averages: what tells fixed from per_chunk is the
difference between the two kinds, and a long stretch of one kind must not wipe out the other.

D, not the rows decoding now: referred to those, the bound feeds on itself: few rows decoding -> a short
decode step -> few prompt tokens allowed -> few requests admitted -> few rows decoding, while the queue grows
and slots stand free. Referred to the batch about to decode, the short prompts waiting raise the allowance
that admits them; a long prompt does not (it is many steps from decoding), so it still cannot stall the
streams. The price of the bound: a long prompt alone is prefilled in smaller chunks (each step's fixed cost
is paid more often).

The bound decides when short prompts run, not how many: the prompts a sustained load sends must be
prefilled anyway, and holding them back only parks requests in prefill while fewer rows decode. Where the
load's prompt tokens outweigh what the slowdown leaves (128-token prompts for 64 new tokens: two prompt
tokens a decoding row, ~2.2x a decode step at 32 rows, past a cap of 2), the capped engine settled with a
third of its requests in prefill, TTFT of seconds and ~12% less throughput. So a step may always carry
KEEP_UP times the prompt tokens admitted per step lately (`admitted`: a moving average over ~1 /
DEMAND_SMOOTHING steps) of the prompts that fit in one step's budget (the scheduler counts those alone): a
sustained load of short prompts keeps pace, while long prompts, one or many at once, still move at the
slowdown's pace.
"""
from __future__ import annotations

import math

import numpy as np

MIN_CHUNK = 16  # prompt tokens a step that decodes may always carry: every prompt moves on
RIDGE = 1e-9  # relative to each term's own scale: a unique fit while some term has not varied yet
KEEP_UP = 2  # short prompts' work a step may take against what is admitted: a backlog drains, it does not build
DEMAND_SMOOTHING = 1 / 32  # ~a stream's lifetime in steps: a closed loop's admissions average out over it


class _Mean:
    """An exponentially weighted mean of numbers or arrays: the newest value weighs `smoothing`; until there
    are 1 / smoothing values, a plain mean."""

    def __init__(self, smoothing: float, zero=0.0):
        self.smoothing, self.count, self.value = smoothing, 0, zero

    def add(self, x) -> None:
        self.count += 1
        self.value = self.value + max(self.smoothing, 1.0 / self.count) * (x - self.value)


class _Moments:
    """Weighted means (_Mean) of x x^T and x y over the points added."""

    def __init__(self, smoothing: float):
        self._xx, self._xy = _Mean(smoothing, np.zeros((3, 3))), _Mean(smoothing, np.zeros(3))

    def add(self, x: np.ndarray, y: float) -> None:
        self._xx.add(np.outer(x, x))
        self._xy.add(x * y)

    @property
    def count(self) -> int:
        return self._xx.count

    @property
    def xx(self) -> np.ndarray:
        return self._xx.value

    @property
    def xy(self) -> np.ndarray:
        return self._xy.value


class StepCost:
    def __init__(self, slowdown: float | None, smoothing: float = 0.1):
        """slowdown: the most a step that decodes should take against a decode-only step (None: no bound).
        smoothing: the newest step's weight among the recent steps of its kind (decode-only, or with prompt)."""
        if slowdown is not None and not slowdown > 1:
            raise ValueError(f"the step slowdown bound must be > 1, got {slowdown!r}")
        self.slowdown = slowdown
        self._decode, self._mixed = _Moments(smoothing), _Moments(smoothing)
        self._costs: tuple[float, float, float] | None = None
        self._demand = _Mean(DEMAND_SMOOTHING)  # short prompts' tokens admitted a step

    def admitted(self, prompt_tokens: int) -> None:
        """A step was scheduled: the prompt tokens (past their cached prefixes) of the short prompts it admitted
        (ScheduledBatch.new_prompt_work; 0 for most steps)."""
        self._demand.add(prompt_tokens)

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step ran: its decode rows, its prompt tokens and its wall time."""
        if not decode_rows and not prompt_tokens:
            return
        x = np.array([1.0, decode_rows + prompt_tokens, prompt_tokens > 0])  # (fixed, per_row, per_chunk)
        (self._mixed if prompt_tokens else self._decode).add(x, seconds)
        self._costs = None

    def costs(self) -> tuple[float, float, float]:
        """(fixed, per_row, per_chunk) seconds, none negative (zeros before any step)."""
        if self._costs is None:
            kinds = [m for m in (self._decode, self._mixed) if m.count]
            if not kinds:
                return 0.0, 0.0, 0.0
            a, b = sum(m.xx for m in kinds), sum(m.xy for m in kinds)
            a = a + RIDGE * np.diag(np.maximum(a.diagonal(), 1e-12))
            fixed, per_row, per_chunk = (max(float(c), 0.0) for c in np.linalg.solve(a, b))
            self._costs = fixed, per_row, per_chunk
        return self._costs

    def decode_time(self, rows: int) -> float:
        """A decode-only step of `rows` rows."""
        fixed, per_row, _ = self.costs()
        return fixed + per_row * rows

    @property
    def bounding(self) -> bool:
        """Whether prompt_allowance bounds anything yet (a slowdown bound, and both kinds of step seen)."""
        return self.slowdown is not None and bool(self._decode.count and self._mixed.count)

    def prompt_allowance(self, rows: int, demand: int | None = None) -> int | None:
        """Prompt tokens a step that decodes `rows` rows may carry, so that it takes at most `slowdown` times a
        decode step of `demand` rows (None: `rows`), or KEEP_UP times the short prompts' tokens admitted per step
        lately if that is more; None: no bound beyond the token budget (no slowdown bound, or the costs not known
        yet: a decode-only step and one with prompt tokens must have run)."""
        if not self.bounding:
            return None
        fixed, per_row, per_chunk = self.costs()
        if not per_row:
            return None
        limit = self.slowdown * self.decode_time(max(rows, demand or 0))
        capped = int((limit - fixed - per_chunk) / per_row + 1e-6) - rows  # (1e-6: rounding)
        return max(MIN_CHUNK, capped, math.ceil(KEEP_UP * self._demand.value))

