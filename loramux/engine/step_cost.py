"""StepCost: how long the engine's steps take, learned from the steps it runs (the scheduler's step bound). No
torch.

A step that decodes is bounded to about `slowdown` times a decode-only step of D rows, the batch about to
decode (the rows decoding now, and the requests whose prompts finish within a step's token budget):
`prompt_allowance(rows, D)` says how many prompt tokens that leaves. The time model, fitted by least squares to
the steps run (the newer weighted more; decode-only and mixed steps in separate moving averages):
    step seconds = fixed + per_row x (decode rows + prompt tokens) + per_chunk x [the step has prompt tokens]
A step that decodes may always carry MIN_CHUNK prompt tokens, and KEEP_UP times the prompt tokens admitted per
step lately (`admitted`) of prompts that fit in one step's budget, so that a sustained load of short prompts
keeps pace while long prompts move at the slowdown's pace. The bound uses the latest fit that told a row's cost
(fitted more than TRUSTED standard errors above zero): steps all alike, such as a flood of long prompts moving
MIN_CHUNK tokens a step with nothing decoding, tell only what such a step costs, and one of them slowed by
another process could fit a token as free and lift the bound to the whole token budget. Why each of these:
docs/performance.md (the step bound under saturation).
"""
from __future__ import annotations

import math

import numpy as np

MIN_CHUNK = 16  # prompt tokens a step that decodes may always carry: every prompt moves on
RIDGE = 1e-9  # relative to each term's own scale: a unique fit while some term has not varied yet
KEEP_UP = 2  # short prompts' work a step may take against what is admitted: a backlog drains, it does not build
TRUSTED = 2.0  # a row's fitted cost is trusted once it is this many standard errors above 0
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
        self._yy = _Mean(smoothing)

    def add(self, x: np.ndarray, y: float) -> None:
        self._xx.add(np.outer(x, x))
        self._xy.add(x * y)
        self._yy.add(y * y)

    @property
    def count(self) -> int:
        return self._xx.count

    @property
    def points(self) -> float:
        """How many equally weighted points the weighted means are worth: all of them until 1 / smoothing, then
        (2 - s) / s (the inverse of the weights' sum of squares)."""
        s = self._xx.smoothing
        return min(self.count, (2 - s) / s)

    def residual(self, beta: np.ndarray) -> float:
        """The weighted mean of (y - x . beta)^2."""
        return float(self._yy.value - 2 * beta @ self.xy + beta @ self.xx @ beta)

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
        self._trusted: tuple[float, float, float] | None = None  # the latest fit that told a row's cost
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
        """(fixed, per_row, per_chunk) seconds, none negative (zeros before any step): the fit to the steps lately."""
        if self._costs is None:
            kinds = [m for m in (self._decode, self._mixed) if m.count]
            if not kinds:
                return 0.0, 0.0, 0.0
            a, b = sum(m.xx for m in kinds), sum(m.xy for m in kinds)
            beta = np.linalg.solve(_ridged(a), b)
            fixed, per_row, per_chunk = (max(float(c), 0.0) for c in beta)
            self._costs = fixed, per_row, per_chunk
            if per_row > TRUSTED * _row_error(kinds, beta):
                self._trusted = self._costs
        return self._costs

    def trusted_costs(self) -> tuple[float, float, float] | None:
        """The latest fit that told a row's cost (fitted more than TRUSTED standard errors above zero); None
        before any did."""
        self.costs()
        return self._trusted

    def seen(self, steps: int) -> bool:
        """Whether at least `steps` steps of each kind (decode-only, with prompt tokens) have been observed."""
        return self._decode.count >= steps and self._mixed.count >= steps

    def decode_time(self, rows: int) -> float:
        """A decode-only step of `rows` rows, by the fit to the steps lately."""
        fixed, per_row, _ = self.costs()
        return fixed + per_row * rows

    @property
    def bounding(self) -> bool:
        """Whether prompt_allowance bounds anything yet (a slowdown bound, both kinds of step seen, and a fit
        that told a row's cost)."""
        seen = self.slowdown is not None and bool(self._decode.count and self._mixed.count)
        return seen and self.trusted_costs() is not None

    def prompt_allowance(self, rows: int, demand: int | None = None) -> int | None:
        """Prompt tokens a step that decodes `rows` rows may carry, so that it takes at most `slowdown` times a
        decode step of `demand` rows (None: `rows`), or KEEP_UP times the short prompts' tokens admitted per step
        lately if that is more; None: no bound beyond the token budget (no slowdown bound, or the costs not known
        yet: a decode-only step and one with prompt tokens must have run, and a fit must have told a row's cost).
        The costs are the latest trusted fit's: while the steps are all alike, the last ones that told."""
        if not self.bounding:
            return None
        fixed, per_row, per_chunk = self.trusted_costs()
        limit = self.slowdown * (fixed + per_row * max(rows, demand or 0))
        capped = int((limit - fixed - per_chunk) / per_row + 1e-6) - rows  # (1e-6: rounding)
        return max(MIN_CHUNK, capped, math.ceil(KEEP_UP * self._demand.value))


def _ridged(a: np.ndarray) -> np.ndarray:
    """`a` with RIDGE on its diagonal, relative to each term's own scale: a unique fit while a term has not varied."""
    return a + RIDGE * np.diag(np.maximum(a.diagonal(), 1e-12))


def _row_error(kinds: list[_Moments], beta: np.ndarray) -> float:
    """The standard error of a fitted row's cost, by least squares: the residual variance over the points the
    moments are worth, less the 3 costs fitted, x (X^T X)^-1; infinite while there are no more points than costs."""
    points = sum(m.points for m in kinds)
    if points <= len(beta):
        return math.inf
    variance = max(0.0, sum(m.points * m.residual(beta) for m in kinds) / (points - len(beta)))
    xtx = _ridged(sum(m.points * m.xx for m in kinds))
    return math.sqrt(variance * max(0.0, float(np.linalg.inv(xtx)[1, 1])))

