"""SamplingParams: how one request is decoded. Stdlib only (the server validates with it).

Every field is checked here, once, when the params are made (the offline API and the HTTP server both
build them), so that nothing a user sends can fail inside an engine step: a step serves every request.
"""
from __future__ import annotations

import json as _json
import math
import re
from dataclasses import dataclass

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM and torch take it
_SEED_RULE = f"must be an integer in [{SEED_MIN}, {SEED_MAX}]"
MAX_LOGPROBS = 20
"""The most top alternatives a request may ask for per token (OpenAI's top_logprobs limit; vLLM's max_logprobs)."""
GREEDY_BELOW = 1e-5
"""A temperature below this decodes greedily (as vLLM's _SAMPLING_EPS): dividing logits by 1e-40 gives inf
and NaN probabilities."""
MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound (vLLM takes any finite value): past it the distribution is close to uniform, so a
larger value is far likelier a client's mistake (1e6 for 1.0) than a wish, and it is refused."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with n > 1: seed + index, wrapped into the signed 64-bit range.
    `seed` itself must be in that range (ValueError otherwise): wrapping must not hide a bad value."""
    if seed is None:
        return None
    if not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed {_SEED_RULE}, got {seed!r}")
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_LOGPROBS_RULE = f"must be null or an integer in [0, {MAX_LOGPROBS}]"


def _optional_count(value) -> bool:
    return value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS)


def shorten(text: str, limit: int = 80) -> str:
    """`text` for an error message: at most about `limit` characters, its middle elided (a request can be
    megabytes; a message quotes it, never echoes it)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit // 2]}...{text[-(limit // 2):]}"


_TOKEN_ID = re.compile(r"0|-?[1-9][0-9]{0,18}")
"""A token id as JSON's logit_bias keys write it: canonical ASCII decimal ("-" kept for the range check to
name), 19 digits at most (int64's; a longer key is no token id, and int() refuses 4300+ digits)."""


def _int_keys(mapping: dict) -> dict:
    """logit_bias with JSON's string keys as ints. Only the canonical form is read: int() would also take
    " 7 ", "0007" or Arabic-Indic "١٢", biasing a token the client never wrote."""
    out = {}
    for key, value in mapping.items():
        if isinstance(key, str):
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"logit_bias key {shorten(repr(key))} is not a token id: keys must be token ids "
                                 'written as decimal integers, such as "50256"')
            key = int(key)
        out[key] = value
    return out


def _is_text(value) -> bool:
    """A str that is valid Unicode: JSON can carry a lone surrogate ("\\ud800"), which no encoder takes (a
    tokenizer raises TypeError on one)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_number(value) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer past float's range
        return False


_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's StructuredOutputsParams): exactly one of these. Enforced by a
    grammar engine (llguidance) token by token, on this request's row only."""

    json: str | None = None
    """A JSON schema (as JSON text): the output is a JSON value that satisfies it."""
    regex: str | None = None
    """The output matches this regular expression (Rust regex syntax)."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar, Lark (llguidance's syntax) or GBNF (llama.cpp's)."""
    json_object: bool = False
    """The output is some JSON object (OpenAI's response_format json_object)."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, grammar or json_object; "
                             f"got {', '.join(set_) or 'none'}")
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured outputs {name} must be a string")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")


POOLINGS = (None, "last", "mean")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """New tokens to generate at most (finish_reason "length" when reached)."""
    temperature: float = 1.0
    """In [0, 2] (OpenAI's range; vLLM allows more): 0 (or below 1e-5) = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability adds up to top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) = all."""
    seed: int | None = None
    """Per-request seed (a signed 64-bit integer): the same seed gives the same tokens whatever the batch mates."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; it is left out of the output."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept in token_ids, left out of the text)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a generated token (OpenAI semantics, -2..2)."""
    repetition_penalty: float = 1.0
    """HF/vLLM semantics over prompt and generated tokens: a positive logit is divided by it, a negative one
    multiplied (1 = off; > 1 discourages repeats)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the most likely token's (after temperature; 0 = off)."""
    min_tokens: int = 0
    """EOS and stop tokens are blocked, and stop strings not looked for, until this many tokens are out."""
    logit_bias: dict[int, float] | None = None
    """OpenAI's: token id -> a bias in [-100, 100] added to its logit (every step, greedy included). A key may
    be a string (JSON's), in canonical decimal form only ("50256"; not " 7 " or "007")."""
    bad_words: tuple[str, ...] = ()
    """vLLM's: words never generated (each as tokenized alone and after a space; the last token of a word
    is blocked once the ones before it are out)."""
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Return each generated token's log-probability and this many top alternatives (0 = the token's alone).
    Raw: from the logits the request's own adapter produced, before penalties, temperature, top-k/top-p or
    a grammar change them (vLLM's logprobs_mode "raw_logprobs")."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first (each one's log-probability given the tokens before it)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (checked when the engine compiles it)."""
    priority: int = 0
    """vLLM's field: with EngineConfig.scheduling_policy "priority", lower runs earlier (and is preempted later);
    under "fcfs" only 0 is taken. Not a sampling parameter either (see cache_salt)."""
    pooling: str | None = None
    """Embeddings: no token is generated; the prompt's hidden states (the last layer's, after the final norm, with
    the request's adapter) pooled into one vector: "last" (the last token's, as vLLM pools decoder models) or
    "mean" (the average over the prompt; such a request computes every position, so it reads no cached
    prefix). None: generate."""
    normalize: bool = True
    """With pooling: the vector scaled to unit length (L2), as vLLM's pooling does by default."""
    cache_salt: str | None = None
    """vLLM's field: the prefix cache is split by it, so a request reads cached blocks only of requests with the
    same salt (and the same adapter identity), and one client's time to first token says nothing of another's
    prompts. Make it secret and unguessable (vLLM suggests 256 random bits). Not a sampling parameter: it is
    here so that it travels with the request wherever its parameters go."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if isinstance(self.logit_bias, dict):  # JSON keys are strings ("50256": -100), as OpenAI sends them
            object.__setattr__(self, "logit_bias", _int_keys(self.logit_bias))
        for name, ok, rule in self._checks():
            if not ok:
                raise ValueError(f"{name} {rule}, got {shorten(repr(getattr(self, name)))}")
        for name in _FLOATS:  # an integer (JSON's 2) is kept as the float the sampler divides by
            object.__setattr__(self, name, float(getattr(self, name)))

    def _checks(self):
        t, p = self.temperature, self.top_p
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", _is_number(t) and 0 <= t <= MAX_TEMPERATURE,
             f"must be a finite number in [0, {MAX_TEMPERATURE:g}]"),
            ("top_p", _is_number(p) and 0 < p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "must be -1 (all) or an integer >= 0"),
            ("seed", self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), _SEED_RULE),
            ("presence_penalty", _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2]"),
            ("logprobs", _optional_count(self.logprobs), _LOGPROBS_RULE),
            ("prompt_logprobs", _optional_count(self.prompt_logprobs), _LOGPROBS_RULE),
            ("repetition_penalty", _is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 10,
             "must be in (0, 10]"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "must be an integer in [0, max_tokens]"),
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                _is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())),
             "must map token ids (integers >= 0) to numbers in [-100, 100]"),
            ("bad_words", all(_is_text(w) and w.strip() for w in self.bad_words),
             "must be non-blank strings of valid Unicode"),
            ("stop", all(_is_text(s) and s for s in self.stop), "must be non-empty strings of valid Unicode"),
            ("priority", _is_int(self.priority) and SEED_MIN <= self.priority <= SEED_MAX,
             "must be a signed 64-bit integer"),
            ("cache_salt", self.cache_salt is None or (_is_text(self.cache_salt) and self.cache_salt != ""),
             "must be a non-empty string of valid Unicode"),
            ("structured_outputs", self.structured_outputs is None or isinstance(self.structured_outputs,
                                                                                 StructuredOutputsParams),
             "must be a StructuredOutputsParams"),
            ("min_tokens", not (self.min_tokens and self.structured_outputs),
             "cannot be used with structured outputs (the grammar decides where the output ends)"),
            ("stop_token_ids", all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
             "must be non-negative integers"),
            ("pooling", self.pooling in POOLINGS, f"must be one of {', '.join(map(str, POOLINGS))}"),
            ("pooling", self.pooling is None or not (self.structured_outputs or self.logprobs is not None
                                                     or self.prompt_logprobs is not None),
             "generates no token: it takes no structured outputs or logprobs"),
            ("normalize", isinstance(self.normalize, bool), "must be a boolean"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
